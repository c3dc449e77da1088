"""Compiled kernels with a C-level (cimport) API only: see linear.pxd."""
