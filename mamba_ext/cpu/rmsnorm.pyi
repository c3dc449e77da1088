"""Compiled kernels with a C-level (cimport) API only: see _rmsnorm.pxd."""
