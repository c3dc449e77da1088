"""Numeric constants of the maths, defined once (see mamba_ext/cpu/csrc/mx_constants.h).

A_LOG_MIN, A_LOG_MAX: A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX)); the gradient of
A_log is exactly 0 at and beyond them. DEFAULT_EPS: the RMSNorm epsilon.
The GPU kernels get the clamp bounds as pipeline override constants
(``a_log_min``, ``a_log_max``) from here.
"""
# TODO(merge): from .cpu.block import A_LOG_MIN, A_LOG_MAX, DEFAULT_EPS (CPU branch);
# literal values until then (the gpu branch only needs them to exist).
A_LOG_MIN = -10.0
A_LOG_MAX = 5.0
DEFAULT_EPS = 1e-6

__all__ = ["A_LOG_MIN", "A_LOG_MAX", "DEFAULT_EPS"]
