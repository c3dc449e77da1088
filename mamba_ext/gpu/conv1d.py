"""Causal depthwise conv1d + SiLU on the GPU (kernels/conv1d.wgsl), the mirror of
mamba_ext/cpu/conv1d.pyx.

Size letters: M = B*L rows, L seqLen, D dInner, K dConv, T rows per tile.
"""
from __future__ import annotations

import math

# Rows per invocation's tile (override T of kernels/conv1d.wgsl): each tile loads K - 1
# rows of xc before it (and the backward 2 (K - 1) more after it) besides its own.
CONV_TILE = 32
_WMAX = 48            # const WMAX of kernels/conv1d.wgsl: T + 2 (K - 1) rows in registers
MAX_DCONV = (_WMAX - 1) // 2 + 1        # the largest K with a tile of one row: 24
# Tiles per invocation in the backward, at least (see conv1d_backward's row blocks).
_BACKWARD_TILES = 4


def _tile(K):
    if not 1 <= K <= MAX_DCONV:
        raise ValueError(f"mamba_ext.gpu: dConv must be in [1, {MAX_DCONV}] for the GPU conv "
                         f"kernels, got {K}")
    return min(CONV_TILE, _WMAX - 2 * (K - 1))


def _params(M, L, D, K, o, rows_per=0, RB=0):
    return [M, L, D, K, 2 * D, o["wConv"], o["bConv"], rows_per, RB]


def conv1d_forward(g, M, L, D, K, Y, w, o, u, half=False):
    """Op: u (M, D) = SiLU(conv), conv from xc = Y[:, 0:D] (Y (M, 2D): f32, or f16 pairs
    with ``half``); weights at ``o["wConv"]``, ``o["bConv"]`` of the parameter arena ``w``.
    conv is not kept: the backward recomputes it from Y."""
    T = _tile(K)
    groups = math.ceil(D / 64) * math.ceil(math.ceil(M / T) / 4)
    return g.op("conv1d", "conv1d_forward", g.grid1d(groups, "conv1d_forward"),
                _params(M, L, D, K, o), [Y, w, u], {"K": K, "T": T, "HALF": bool(half)})


def conv1d_backward(g, M, L, D, K, du, w, o, dY, Y, gr, half=False):
    """Ops: dY[:, 0:D] = dxc (dconv = du * SiLU'(conv), conv recomputed from Y (f32, or
    f16 pairs with ``half``), held in registers); wConv, bConv gradients (at ``o`` of the
    gradient arena ``gr``) += their sums: per row block, then the blocks' fixed-order sum."""
    T = _tile(K)
    # row blocks of rows_per rows, a multiple of the 4 T rows that a block's four
    # invocations per channel take at a time: each invocation at least _BACKWARD_TILES
    # tiles, at most 64 blocks (the partials the final pass sums)
    step = 4 * T * _BACKWARD_TILES
    rows_per = step * max(1, math.ceil(M / (step * 64)))
    RB = max(1, math.ceil(M / rows_per))
    prm = _params(M, L, D, K, o, rows_per, RB)
    part = g.scratch("conv1d_weight", RB * (K + 1) * D)      # (RB, K+1, D)
    consts = {"K": K, "T": T, "HALF": bool(half)}
    return [
        g.op("conv1d", "conv1d_backward", g.grid1d(math.ceil(D / 64) * RB, "conv1d_backward"),
             prm, [Y, w, du, dY, part, None], consts),
        g.op("conv1d", "conv1d_backward_weight_final",
             g.grid1d(math.ceil((K + 1) * D / 256), "conv1d_backward_weight_final"), prm,
             [None, None, None, None, part, gr], consts),
    ]
