"""Compiled kernels with a C-level (cimport) API only: see conv1d.pxd."""
