"""Causal depthwise conv1d + SiLU on the GPU (kernels/conv1d.wgsl), the mirror of
mamba_ext/cpu/conv1d.pyx.

Size letters: M = B*L rows, L seqLen, D dInner, K dConv.
"""
from __future__ import annotations

import math

MAX_DCONV = 24          # const KMAX of kernels/conv1d.wgsl: the taps held in registers
CONV_RPI_FORWARD = 8    # the forward's rows per invocation (override RPI, at most RPIMAX)
CONV_TILES = (32, 16, 8)   # the backward's rows per workgroup tile (override T), the largest that fits
# The backward's row blocks (one workgroup per 64 channels of a block): each at least
# CONV_BACKWARD_TILES tiles, at most CONV_BACKWARD_BLOCKS blocks (the partials the final
# pass sums per channel).
CONV_BACKWARD_TILES = 8
CONV_BACKWARD_BLOCKS = 64


def _check_dconv(K):
    if not 1 <= K <= MAX_DCONV:
        raise ValueError(f"mamba_ext.gpu: dConv must be in [1, {MAX_DCONV}] for the GPU conv "
                         f"kernels, got {K}")


def _tile(g, K):
    """The backward's rows per tile (override T) for dConv ``K``: the largest of
    :data:`CONV_TILES` whose staged rows (two tiles' T + 2 (K - 1), 256 bytes each) and 2 KB
    of lane sums fit the device's workgroup memory."""
    _check_dconv(K)
    for T in CONV_TILES:
        if 2 * (T + 2 * (K - 1)) * 256 + 2048 <= g.wg_memory:
            return T
    raise ValueError(f"mamba_ext.gpu: dConv {K} needs more workgroup memory than this "
                     f"device's {g.wg_memory} bytes")


def _params(M, L, D, K, o, rows_per=0, RB=0, bin_off=0):
    return [M, L, D, K, 2 * D, o["wConv"], o["bConv"], rows_per, RB, bin_off]


def conv1d_forward(g, M, L, D, K, Y, w, o, u, half=False, u16=None, u16_t=None):
    """Op: u (M, D) = SiLU(conv), conv from xc = Y[:, 0:D] (Y (M, 2D): f32, or f16 pairs
    with ``half``); weights at ``o["wConv"]``, ``o["bConv"]`` of the parameter arena ``w``;
    ``u16``: also u's f16 copy there (f16 pairs; D even); ``u16_t``: also its transpose
    (D, M) in f16 pairs (M a multiple of 8). conv is not kept: the backward recomputes it
    from Y."""
    _check_dconv(K)
    rpi = CONV_RPI_FORWARD if u16_t is None else 8       # the transpose: 8 rows a store
    if u16 is not None and D % 2:
        raise ValueError(f"mamba_ext.gpu.conv1d_forward: an f16 copy of u needs an even D, got {D}")
    if u16_t is not None and M % 8:
        raise ValueError(f"mamba_ext.gpu.conv1d_forward: u's f16 transpose needs M (rows) a "
                         f"multiple of 8, got {M}")
    groups = math.ceil(D / 64) * math.ceil(M / (8 * rpi))
    return g.op("conv1d", "conv1d_forward", g.grid1d(groups, "conv1d_forward"),
                _params(M, L, D, K, o),
                [Y, w, u, None, None, None, g.dummy(0) if u16 is None else u16,
                 g.dummy(1) if u16_t is None else u16_t],
                {"K": K, "RPI": rpi, "HALF": bool(half), "OUT16": u16 is not None,
                 "OUT16T": u16_t is not None})


def conv1d_backward(g, M, L, D, K, du, w, o, dY, Y, gr, half=False, out16=False):
    """Ops: dY[:, 0:D] = dxc (dconv = du * SiLU'(conv), conv recomputed from Y (f32, or
    f16 pairs with ``half``), held in registers); wConv, bConv gradients (at ``o`` of the
    gradient arena ``gr``) += their sums: per row block, then the blocks' fixed-order sum.
    ``out16`` (the f16 mode's backward, D even): dY (M, 2D) holds f16 pairs (in_proj's
    operand) and in_proj's bias gradient, at ``o["bInProj"]``, += the column sums of dxc
    (the f32 values), summed as dbConv is."""
    if out16 and D % 2:
        raise ValueError(f"mamba_ext.gpu.conv1d_backward: f16 pairs of dY need an even D, got {D}")
    T = _tile(g, K)
    # row blocks of rows_per rows, whole tiles (CONV_BACKWARD_TILES, CONV_BACKWARD_BLOCKS)
    step = T * CONV_BACKWARD_TILES
    rows_per = step * max(1, math.ceil(M / (step * CONV_BACKWARD_BLOCKS)))
    RB = max(1, math.ceil(M / rows_per))
    prm = _params(M, L, D, K, o, rows_per, RB, o["bInProj"] if out16 else 0)
    KS = K + (2 if out16 else 1)                      # sums per channel: taps, bias, (dxc)
    part = g.scratch("conv1d_weight", RB * KS * D)   # (RB, KS, D)
    consts = {"K": K, "T": T, "HALF": bool(half), "OUT16": bool(out16)}
    return [
        g.op("conv1d", "conv1d_backward", g.grid1d(math.ceil(D / 64) * RB, "conv1d_backward"),
             prm, [Y, w, du, dY, part, None], consts),
        g.op("conv1d", "conv1d_backward_weight_final",
             g.grid1d(math.ceil(KS * D / 256), "conv1d_backward_weight_final"), prm,
             [None, None, None, None, part, gr], consts),
    ]
