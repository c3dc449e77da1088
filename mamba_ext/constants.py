"""Numeric constants of the maths, defined once.

The values of the clamp bounds and the default RMSNorm epsilon come from the C header
``mamba_ext/cpu/csrc/mx_constants.h`` (``MX_A_LOG_MIN``, ``MX_A_LOG_MAX``,
``MX_DEFAULT_EPS``), exposed by the compiled module ``mamba_ext.cpu.block``; every Python
module imports them from here. The WGSL kernels receive the clamp bounds as pipeline
override constants (``a_log_min``, ``a_log_max``) set from these values.

* ``A_LOG_MIN``, ``A_LOG_MAX``: ``A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX))``; the
  gradient of A_log is exactly 0 at and beyond the bounds (docs/semantics.md, step 7).
* ``DEFAULT_EPS``: the RMSNorm epsilon (inside the square root) when none is given.
* ``DEFAULT_NO_DECAY``: parameter names (or ``layer{i}.`` suffixes) that AdamW leaves
  without weight decay by default: the SSM parameters A_log and D_vec, every bias and
  the RMSNorm gains.
"""
from __future__ import annotations

from typing import Final

from .cpu.block import A_LOG_MAX, A_LOG_MIN, DEFAULT_EPS  # values of cpu/csrc/mx_constants.h

__all__ = ["A_LOG_MIN", "A_LOG_MAX", "DEFAULT_EPS", "DEFAULT_NO_DECAY"]

DEFAULT_NO_DECAY: Final[frozenset[str]] = frozenset({
    "A_log", "D_vec",
    "bInProj", "bConv", "bXProj", "bDtProj", "bOutProj", "lm_head_bias",
    "normWeight", "final_norm",
})
