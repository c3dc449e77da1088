"""AdamW over a flat parameter arena on the GPU (kernels/adamw.wgsl), the mirror of
mamba_ext/cpu/adamw.pyx: the global gradient norm (sum of squares and non-finite
count, fixed-order) and the per-element step.

Size letters: n elements of the arena, G workgroups of the partial sums.
"""
from __future__ import annotations

import math

import numpy as np

from .device import elementwise

SUMSQ_ITEMS = 256 * 8    # elements per workgroup of adamw_sumsq_partial (256 x ITEMS)
COUNT_MOD = 1 << 20      # the GPU's count of steps taken is kept mod this (kernels/adamw.wgsl)


def bias_corrections(lr, betas, t):
    """(lr / bc1, sqrt(bc2)) of step number ``t`` (1-based), in float64 as mamba_ext.AdamW
    computes them; the kernel gets them rounded to float32 once."""
    b1, b2 = betas
    return lr / (1.0 - b1 ** t), math.sqrt(1.0 - b2 ** t)


class AdamWOps:
    """Buffers and ops of one AdamW step over ``n`` elements of the arenas
    ``w`` (weights), ``m``, ``v`` (moments) and ``gr`` (gradients)."""

    def __init__(self, g, n, w, m, v, gr, params):
        self.groups = math.ceil(n / SUMSQ_ITEMS)
        self.part = g.buffer(2 * self.groups, "sumsq_partials")   # (2G,)
        # (sumsq, nonfinite, steps taken mod COUNT_MOD, -): stat[2] persists across steps
        self.stat = g.buffer(4, "grad_stats")
        self.ops = [
            g.op("adamw", "adamw_sumsq_partial", g.grid1d(self.groups, "adamw_sumsq_partial"),
                 [n, self.groups], [gr, self.part]),
            g.op("adamw", "adamw_sumsq_final", (1, 1, 1), [n, self.groups], [self.part, self.stat]),
            elementwise(g, "adamw", "adamw_step", n, params, [w, m, v, gr, self.stat]),
        ]

        self._g = g

    @property
    def step_op(self):
        return self.ops[2]

    def set_count(self, t):
        """The GPU's count of steps taken (stat[2]) := ``t`` mod COUNT_MOD (a new or loaded
        optimizer state; queued like any write, so it lands between submitted steps)."""
        self._g.write(self.stat, np.array([t % COUNT_MOD], np.float32), offset_bytes=8)
