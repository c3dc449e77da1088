"""Causal depthwise conv1d + SiLU on the GPU (kernels/conv1d.wgsl), the mirror of
mamba_ext/cpu/conv1d.pyx.

Size letters: M = B*L rows, L seqLen, D dInner, K dConv.
"""
from __future__ import annotations

import math

from .device import elementwise


def _params(M, L, D, K, o):
    return [M, L, D, K, 2 * D, o["wConv"], o["bConv"]]


def conv1d_forward(g, M, L, D, K, Y, w, o, conv, u):
    """Op: conv (M, D) from xc = Y[:, 0:D] (Y (M, 2D)), u = SiLU(conv); weights at
    ``o["wConv"]``, ``o["bConv"]`` of the parameter arena ``w``."""
    return elementwise(g, "conv1d", "conv1d_forward", M * D, _params(M, L, D, K, o),
                       [Y, w, conv, u])


def conv1d_backward(g, M, L, D, K, du, conv, w, o, dconv, dY, Y, gr):
    """Ops: dconv (M, D) = du * SiLU'(conv), dY[:, 0:D] = dxc; wConv, bConv gradients
    (at ``o`` of the gradient arena ``gr``) += their sums."""
    return [
        elementwise(g, "conv1d", "conv1d_backward_input", M * D, _params(M, L, D, K, o),
                    [du, conv, w, dconv, dY]),
        g.op("conv1d", "conv1d_backward_weight", (math.ceil(D / 32), K + 1, 1),
             _params(M, L, D, K, o), [dconv, Y, gr]),
    ]
