"""Causal depthwise conv1d + SiLU on the GPU (kernels/conv1d.wgsl), the mirror of
mamba_ext/cpu/conv1d.pyx.

Size letters: M = B*L rows, L seqLen, D dInner, K dConv.
"""
from __future__ import annotations

import math

from .device import COLUMN_SUM_BLOCKS, COLUMN_SUM_ROWS, elementwise


def _params(M, L, D, K, o, rows_per=0, RB=0):
    return [M, L, D, K, 2 * D, o["wConv"], o["bConv"], rows_per, RB]


def conv1d_forward(g, M, L, D, K, Y, w, o, u):
    """Op: u (M, D) = SiLU(conv), conv from xc = Y[:, 0:D] (Y (M, 2D)); weights at
    ``o["wConv"]``, ``o["bConv"]`` of the parameter arena ``w``. conv is not kept: the
    backward recomputes it from Y."""
    return elementwise(g, "conv1d", "conv1d_forward", M * D, _params(M, L, D, K, o), [Y, w, u])


def conv1d_backward(g, M, L, D, K, du, w, o, dconv, dY, Y, gr):
    """Ops: dconv (M, D) = du * SiLU'(conv) (conv recomputed from Y), dY[:, 0:D] = dxc;
    wConv, bConv gradients (at ``o`` of the gradient arena ``gr``) += their sums."""
    # weight sums in two passes (row blocks, then their fixed-order sum), as column sums
    RB = max(1, min(COLUMN_SUM_BLOCKS, math.ceil(M / COLUMN_SUM_ROWS)))
    prm = _params(M, L, D, K, o, math.ceil(max(M, 1) / RB), RB)
    bufs = [dconv, Y, g.scratch("conv1d_weight", RB * (K + 1) * D), gr]
    elem = _params(M, L, D, K, o)
    return [
        elementwise(g, "conv1d", "conv1d_backward_dconv", M * D, elem, [Y, w, du, dconv]),
        elementwise(g, "conv1d", "conv1d_backward_input", M * D, elem, [None, w, None, dconv, dY]),
        g.op("conv1d", "conv1d_backward_weight",
             g.check_grid((math.ceil(D / 32), K + 1, RB), "conv1d_backward_weight"), prm, bufs),
        g.op("conv1d", "conv1d_backward_weight_final",
             g.grid1d(math.ceil((K + 1) * D / 256), "conv1d_backward_weight_final"), prm, bufs),
    ]
