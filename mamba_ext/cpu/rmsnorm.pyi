"""Compiled kernels with a C-level (cimport) API only: see rmsnorm.pxd."""
