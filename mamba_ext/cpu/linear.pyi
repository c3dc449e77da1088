"""Compiled kernels with a C-level (cimport) API (see linear.pxd), plus the BLAS thread
controls found at import (csrc/mx_blas.h)."""

BLAS_CONTROLS: str    # "openblas", "mkl", "blis" or "none": the controls of SciPy's BLAS

def blas_threads() -> int: ...    # SciPy's BLAS thread count now (-1: no known control)
