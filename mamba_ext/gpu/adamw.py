"""AdamW over a flat parameter arena on the GPU (kernels/adamw.wgsl), the mirror of
mamba_ext/cpu/adamw.pyx: the global gradient norm (sum of squares and non-finite
count, fixed-order) and the per-element step.

Size letters: n elements of the arena, G workgroups of the partial sums.
"""
from __future__ import annotations

import math

from .device import elementwise

SUMSQ_ITEMS = 256 * 8    # elements per workgroup of adamw_sumsq_partial (256 x ITEMS)


class AdamWOps:
    """Buffers and ops of one AdamW step over ``n`` elements of the arenas
    ``w`` (weights), ``m``, ``v`` (moments) and ``gr`` (gradients)."""

    def __init__(self, g, n, w, m, v, gr, params):
        self.groups = math.ceil(n / SUMSQ_ITEMS)
        self.part = g.buffer(2 * self.groups, "sumsq_partials")   # (2G,)
        self.stat = g.buffer(4, "grad_stats")                     # (sumsq, nonfinite, -, -)
        self.ops = [
            g.op("adamw", "adamw_sumsq_partial", g.grid1d(self.groups, "adamw_sumsq_partial"),
                 [n, self.groups], [gr, self.part]),
            g.op("adamw", "adamw_sumsq_final", (1, 1, 1), [n, self.groups], [self.part, self.stat]),
            elementwise(g, "adamw", "adamw_step", n, params, [w, m, v, gr, self.stat]),
        ]

    @property
    def step_op(self):
        return self.ops[2]
