"""Mixed precision on the GPU (kernels/amp.wgsl), the mirror of mamba_ext/amp.py:
the fp16-rounded copy of the weights the forward/backward runs on, and the
gradients rounded to fp16 and unscaled. The scale itself (mamba_ext.amp.
DynamicLossScaler) lives on the host, as on the CPU, and, where its arithmetic is exact
in float32 (:func:`scale_on_gpu`), also on the GPU, advanced there by the same rule so
that steps need not wait for each other's read-back.

Size letters: n elements of the parameter arena.
"""
from __future__ import annotations

import math

import numpy as np

from .device import elementwise


def amp_params(n: int, inv_scale: float = 1.0, cols: int = 0, src_off: int = 0,
               src_rs: int = 0, dst_off: int = 0, rows: int = 0, dst_t_off: int = 0,
               dst_cols: int = 0, use_state: bool = False, per: int = 0, src_stride: int = 0,
               dst_stride: int = 0, dst_t_stride: int = 0) -> list:
    """The uniform Params of kernels/amp.wgsl, in its field order (each entry point reads
    the fields it needs); ``per`` (default ``n``): the words of one block of a pack of
    several, ``*_stride`` from one to the next."""
    return [int(n), float(inv_scale), int(cols), int(src_off), int(src_rs), int(dst_off),
            int(rows), int(dst_t_off), int(dst_cols), int(bool(use_state)),
            int(per or max(n, 1)), int(src_stride), int(dst_stride), int(dst_t_stride)]


def _power_of_two(x: float, lo_exp: int = -100, hi_exp: int = 100) -> bool:
    m, e = math.frexp(x)
    return x > 0 and m == 0.5 and lo_exp <= e - 1 <= hi_exp


def scale_on_gpu(scaler) -> bool:
    """Whether ``scaler`` (a mamba_ext.amp.DynamicLossScaler) can be advanced on the GPU
    (kernels/amp.wgsl, amp_update_scale) with the very values its own ``update`` computes:
    its type exactly (a subclass may change the rule), its scale, factors and bounds powers
    of two (so every product and reciprocal is exact in float32, on either side) and its
    growth interval an exact float32 count. The defaults qualify."""
    from ..amp import DynamicLossScaler
    return (type(scaler) is DynamicLossScaler
            and all(_power_of_two(v) for v in (scaler.scale, scaler.growth_factor,
                                               scaler.backoff_factor, scaler.min_scale,
                                               scaler.max_scale))
            and scaler.growth_interval < 1 << 24)


class AmpOps:
    """Recorded ops over the arenas: ``weights_op`` w16 (n) = round_f16(w (n));
    ``grads_op`` g (n) = round_f16(g) * (1 / scale); ``update_op`` the scaler's update on
    the GPU (after AdamW, whose statistics ``stat`` it reads). The scale is either given
    by the host (:meth:`set_scale`, ``on_gpu`` False) or kept on the GPU in ``state``
    (4,) = (scale, 1/scale, growth tracker, -), written by :meth:`set_scale` with
    ``on_gpu`` and advanced by ``update_op`` (see :func:`scale_on_gpu`)."""

    def __init__(self, g, n, w, w16, gr, stat=None):
        self.g, self.n = g, n
        self.state = g.buffer(4, "loss_scale")
        if stat is None:            # no AdamW: a statistics buffer of no overflow
            stat = g.buffer(4, "grad_stats")
        self.weights_op = elementwise(g, "amp", "amp_round_weights", n, amp_params(n), [w, w16])
        self.grads_op = elementwise(g, "amp", "amp_round_grads", n, amp_params(n),
                                    [None, gr, None, None, self.state])
        self.update_op = g.op("amp", "amp_update_scale", (1, 1, 1), [0.0] * 9,
                              [None, None, None, None, self.state, stat])

    def set_scale(self, scaler, on_gpu: bool = False) -> None:
        """The loss scale of the next step, from the host's ``scaler``: unscale by
        float32(1 / scale), the reciprocal DynamicLossScaler.unscale multiplies float32
        gradients by. ``on_gpu``: the scale and the scaler's state go to ``state``, which
        the step reads and ``update_op`` advances."""
        inv = float(np.float32(1.0 / scaler.scale))
        self.g.write_params(self.grads_op, amp_params(self.n, inv, use_state=on_gpu))
        if not on_gpu:      # (any object with a scale will do then)
            return
        f = lambda v: float(np.float32(v))
        self.g.write_params(self.update_op, [
            f(scaler.growth_factor), f(scaler.backoff_factor), f(1 / scaler.growth_factor),
            f(1 / scaler.backoff_factor), float(scaler.growth_interval), f(scaler.min_scale),
            f(scaler.max_scale), f(1 / scaler.min_scale), f(1 / scaler.max_scale)])
        self.g.write(self.state, np.array([scaler.scale, inv, scaler.growth_tracker, 0],
                                          np.float32))
