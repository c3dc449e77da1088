"""Compiled kernels with a C-level (cimport) API only: see _conv1d.pxd."""
