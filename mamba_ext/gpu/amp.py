"""Mixed precision on the GPU (kernels/amp.wgsl), the mirror of mamba_ext/amp.py:
the fp16-rounded copy of the weights the forward/backward runs on, and the
gradients rounded to fp16 and unscaled. The scale itself (mamba_ext.amp.
DynamicLossScaler) lives on the host, as on the CPU.

Size letters: n elements of the parameter arena.
"""
from __future__ import annotations

import numpy as np

from .device import elementwise


def amp_params(n: int, inv_scale: float = 1.0, cols: int = 0, src_off: int = 0,
               src_rs: int = 0, dst_off: int = 0, rows: int = 0, dst_t_off: int = 0,
               dst_cols: int = 0) -> list:
    """The uniform Params of kernels/amp.wgsl, in its field order (each entry point reads
    the fields it needs)."""
    return [int(n), float(inv_scale), int(cols), int(src_off), int(src_rs), int(dst_off),
            int(rows), int(dst_t_off), int(dst_cols)]


class AmpOps:
    """Recorded ops over the arenas: ``weights_op`` w16 (n) = round_f16(w (n));
    ``grads_op`` g (n) = round_f16(g) * (1 / scale), its scale set by :meth:`set_scale`."""

    def __init__(self, g, n, w, w16, gr):
        self.g, self.n = g, n
        self.weights_op = elementwise(g, "amp", "amp_round_weights", n, amp_params(n), [w, w16])
        self.grads_op = elementwise(g, "amp", "amp_round_grads", n, amp_params(n), [None, gr])

    def set_scale(self, scale: float) -> None:
        """The loss scale of the next step: unscale by float32(1 / scale), the
        reciprocal DynamicLossScaler.unscale multiplies float32 gradients by."""
        self.g.write_params(self.grads_op, amp_params(self.n, float(np.float32(1.0 / scale))))
