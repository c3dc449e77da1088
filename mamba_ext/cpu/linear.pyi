"""Compiled kernels with a C-level (cimport) API (see linear.pxd), plus the BLAS thread
controls found at import (csrc/mx_blas.h)."""

import numpy as np

BLAS_CONTROLS: str    # "openblas", "mkl", "blis" or "none": the controls of SciPy's BLAS

def blas_threads() -> int: ...    # SciPy's BLAS thread count now (-1: no known control)

GEMM_KINDS: tuple[str, ...]   # ("auto", "blas", "avx512")
AVX512_CORES: tuple[str, ...]   # OpenBLAS's kernel sets with AVX-512 (lower case)

def set_gemm(kind: str = "auto") -> str: ...   # the float32 GEMM of every product; returns the previous kind
def gemm_kernel(weight_gradient: bool = False) -> str: ...  # "avx512" (csrc/mx_sgemm.h) or "blas"
def blas_corename() -> str: ...                 # OpenBLAS's kernel set ("" for another BLAS)
def blas_config() -> str: ...                   # OpenBLAS's description of its build ("" for another BLAS)
def product(x: np.ndarray, weight: np.ndarray, n_threads: int | None = None,
            out: np.ndarray | None = None) -> np.ndarray: ...

