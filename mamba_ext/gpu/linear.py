"""Linear layers on the GPU (kernels/linear.wgsl), the mirror of mamba_ext/cpu/linear.pyx.

``Y = X @ W^T + b`` with X (M, I), W (O, I), Y (M, O): :func:`linear_forward`
(bias and residual fused into the GEMM's store), :func:`linear_backward`
(dX; dW with db fused). A product of few output tiles (the dW products, whose
contraction is B*L long; anything at batch 1) is split along k over more
workgroups, then summed in a fixed order (deterministic). Operands are addressed
by offset and strides, so column slices of a buffer (x_proj's dt_low | Bs | Cs,
in_proj's xc | z) and transposed operands need no copies.

Size letters: M = B*L rows, I inputs, O outputs of the layer; S split-K slices.
"""
from __future__ import annotations

import math
from typing import NamedTuple

GEMM_TILE = (128, 128)   # rows x columns of C per workgroup of kernels/linear.wgsl
GEMM_BK = 16             # contraction step of the tile loop
# Split-K: a product of fewer tiles than SPLIT_BELOW_TILES (one wave of resident
# workgroups on a large GPU: two per multiprocessor of an H200) gets S slices, enough
# for about SPLIT_TARGET_GROUPS workgroups (three waves, so the last partial wave
# costs little); each slice holds at least MIN_SPLIT_K of the contraction. Products of
# more tiles stay whole (splitting them gains nothing and costs a large partial buffer).
# Thinner slices, down to MIN_SPLIT_K_SHORT, are taken for contractions up to
# SPLIT_SHORT_K (the forward and dX products: K = Dm, D, 2D) where they fill the last wave
# of SPLIT_WAVE resident workgroups better: cost(S) = ceil(tiles * S / SPLIT_WAVE) waves
# times ceil(K / S) per workgroup, the smaller wins. E.g. block c's in_proj forward, 192
# tiles, K 768: 3 slices = 576 workgroups in 3 waves of 256 k, 4 slices = 768 in 3 waves of
# 192 k -> 4. The values and their measurements: docs/performance.md (GPU tuning).
SPLIT_BELOW_TILES = 528
SPLIT_TARGET_GROUPS = 792
SPLIT_WAVE = 264
MIN_SPLIT_K = 256
MIN_SPLIT_K_SHORT = 192
SPLIT_SHORT_K = 4096
# Which products may be split: True = every product of few tiles (batch 1, x_proj's
# and dt_proj's narrow outputs); False = only the dW products (batch 1 is then slow).
SPLIT_ALL = True
# Register prefetch of the next step's operands in the tile loop (override constant
# PREFETCH of kernels/linear.wgsl): None = only for products with no k-contiguous
# operand (the dW products, which it speeds up; it slows the others), True / False =
# for every product or none.
PREFETCH = None
# Layout of the tiles in workgroup memory (override ROT of kernels/linear.wgsl): rows of
# 40 vec4 with a k-contiguous operand's slots shifted by a constant per k, where the
# device has the 20 KiB it takes (faster than an XOR swizzle: no index arithmetic per
# read); else rows of 32, unshifted, with the k-contiguous loads assigned so that no
# stores conflict.
ROT_MEMORY = 2 * GEMM_BK * 40 * 16
ROT = None          # None = where the device has ROT_MEMORY; True / False = always / never


def split_count(g, M, N, K):
    """Split-K slices S for a (M x N, contraction K) product: 1 unless few tiles."""
    tiles = math.ceil(M / GEMM_TILE[0]) * math.ceil(N / GEMM_TILE[1])
    if tiles >= SPLIT_BELOW_TILES:
        return 1
    want = math.ceil(SPLIT_TARGET_GROUPS / tiles)
    s = min(want, max(1, K // MIN_SPLIT_K))
    if K <= SPLIT_SHORT_K:
        thin = min(want, max(1, K // MIN_SPLIT_K_SHORT))
        cost = lambda n: math.ceil(tiles * n / SPLIT_WAVE) * math.ceil(K / n)
        if cost(thin) < cost(s):
            s = thin
    return max(1, min(s, g.max_groups))


def split_scratch_len(M, N, S):
    """Floats of the split-K scratch: S partial products (M, N) and S row sums (M,)."""
    return S * M * N + S * M


class Mat(NamedTuple):
    """An f32 matrix inside a buffer: element (i, j) at ``buf[off + i*rs + j*cs]`` (so a
    column slice or a transpose of a stored matrix needs no copy)."""
    buf: object
    off: int
    rs: int
    cs: int = 1


def gemm(g, entry, M, N, K, A: Mat, B: Mat, C: Mat, *, bias=None, bias_off=0, beta=0,
         res=None, dbias=None, db_off=0, part=None):
    """Ops for C (M, N) = beta*C + A (M, K) @ B (K, N) (+ bias[bias_off + j]) (+ res, at C's
    place with C's row stride), see kernels/linear.wgsl; C's columns are contiguous
    (``C.cs`` 1), each of A and B contiguous along k or along its rows/columns.
    ``dbias``: a buffer whose [db_off, db_off + M) gets += the row sums of A. A product of
    few tiles runs as S split-K slices into a scratch buffer, then one fixed-order sum
    that applies the same epilogue. The scratch is ``part`` when given and large
    enough for all S slices (a buffer that is free while these ops run, e.g. a dead
    backward temporary, so the partials cost no memory of their own), else the
    device's scratch buffer. Where the device has f16 subgroup matrices, a product that
    fits them runs as three f16 products of split operands instead
    (:mod:`mamba_ext.gpu.linear_split`)."""
    from . import linear_split
    if linear_split.active(g) and linear_split.unsupported(
            g, M, N, K, A, B, C, bias=bias, beta=beta, res=res, dbias=dbias) is None:
        return linear_split.gemm(g, M, N, K, A, B, C, bias=bias, bias_off=bias_off, beta=beta,
                                 res=res, dbias=dbias, db_off=db_off)
    a, a_off, a_rs, a_cs = A
    b, b_off, b_rs, b_cs = B
    c, c_off, c_rs, c_cs = C
    if c_cs != 1:
        raise ValueError("linear gemm: C's columns must be contiguous (cs 1)")
    a_kfast = a_cs == 1
    b_kfast = b_rs == 1
    if not a_kfast and a_rs != 1 or not b_kfast and b_cs != 1:
        raise ValueError("linear gemm: each operand must be contiguous along k or along "
                         "its rows/columns")
    aligned = lambda *v: all(int(x) % 4 == 0 for x in v)      # vec4 loads
    a_vec = aligned(a_off, a_rs) if a_kfast else aligned(a_off, a_cs)
    b_vec = aligned(b_off, b_cs) if b_kfast else aligned(b_off, b_rs)
    S = split_count(g, M, N, K) if SPLIT_ALL or dbias is not None else 1
    kc = math.ceil(math.ceil(K / S) / GEMM_BK) * GEMM_BK if S > 1 else max(K, 1)
    S = math.ceil(K / kc) if S > 1 else 1
    if S == 1:
        part = g.dummy(0)
    elif part is None or part.size < 4 * split_scratch_len(M, N, S):
        # (a given buffer too small for every slice is not used: fewer slices cost more
        # than the scratch)
        part = g.scratch("linear_split_k", split_scratch_len(M, N, S))
    # dW and db in one buffer (a gradient arena): db written through c's binding
    db_in_c = dbias is not None and dbias is c
    consts = {"A_KFAST": a_kfast, "B_KFAST": b_kfast, "A_VEC": a_vec, "B_VEC": b_vec,
              "BIAS_GRAD": dbias is not None, "DBIAS_IN_C": db_in_c,
              "SPLIT": S > 1,
              "PREFETCH": not (a_kfast or b_kfast) if PREFETCH is None else PREFETCH,
              "ROT": g.wg_memory >= ROT_MEMORY if ROT is None else ROT}
    params = [M, N, K, a_off, a_rs, a_cs, b_off, b_rs, b_cs, c_off, c_rs, bias_off,
              0 if bias is None else 1, beta, 0 if res is None else 1, db_off, kc]
    buffers = [a, a, b, b, a if bias is None else bias, a if res is None else res, c,
               part, g.dummy(1) if dbias is None or db_in_c else dbias]
    grid = (math.ceil(N / GEMM_TILE[1]), math.ceil(M / GEMM_TILE[0]), S)
    ops = [g.op("linear", entry, g.check_grid(grid, f"linear {entry}"), params, buffers, consts)]
    if S > 1:
        from .device import EW_WG
        n = M * N + (M if dbias is not None else 0)
        sum_params = list(params)
        sum_params[-1] = S                          # kc holds S in linear_split_sum
        ops.append(g.op("linear", "linear_split_sum",
                        g.grid1d(math.ceil(n / EW_WG), "linear_split_sum"), sum_params,
                        buffers, {"WG": EW_WG, "BIAS_GRAD": dbias is not None,
                                  "DBIAS_IN_C": db_in_c}))
    return ops


def linear_forward(g, M, I, O, x, x_off, x_rs, w, w_off, b_off, y, y_off, y_rs, res=None,
                   part=None):
    """Ops: y[:, y_off:y_off+O] (row stride y_rs) = x (M, I; row stride x_rs) @ W^T + b
    (+ res (M, O), e.g. the block's residual input); W (O, I) at ``w_off`` and b (O,) at
    ``b_off`` of the parameter arena ``w`` (split-K partials in ``part`` when given: a
    buffer none of these ops touches)."""
    return gemm(g, "linear_forward", M, O, I, Mat(x, x_off, x_rs), Mat(w, w_off, 1, I),
                Mat(y, y_off, y_rs), bias=w, bias_off=b_off, res=res, part=part)


def _sum_op(g, M, N, c, c_off, c_rs, part, S, *, bias=None, bias_off=0, beta=0, res=None,
            label="linear_split_sum"):
    """kernels/linear.wgsl's linear_split_sum alone: c[:, c_off:c_off+N] (M rows c_rs
    apart) = (c if ``beta``) + the S partial products (M, N) dense in ``part`` summed in
    slice order (+ bias[bias_off + j]) (+ res at c's place); one invocation per element."""
    from .device import EW_WG
    params = [M, N, 0, 0, 1, 1, 0, 1, 1, c_off, c_rs, bias_off, 0 if bias is None else 1,
              beta, 0 if res is None else 1, 0, S]
    rd = g.dummy(2) if bias is None else bias       # bindings read only with their flags
    buffers = [rd, rd, rd, rd, rd, rd if res is None else res, c, part, g.dummy(1)]
    return g.op("linear", "linear_split_sum", g.grid1d(math.ceil(M * N / EW_WG), label),
                params, buffers, {"WG": EW_WG})


def bias_fill(g, M, O, w, b_off, y, y_off, y_rs, res=None):
    """Ops: y[:, y_off:y_off+O] (row stride y_rs) = b (+ res (M, O), the same row stride):
    the epilogue of :func:`linear_forward` alone, for products accumulated on top of it
    (mamba_ext.gpu.linear_f16): linear_bias_fill, linear_split_sum's sum over zero slices
    (the same bits), one column of 4 rows per invocation (75 -> 58 us at block d's out_proj:
    docs/gpu_h200.txt, session 32)."""
    params = [M, O, 0, 0, 1, 1, 0, 1, 1, y_off, y_rs, b_off, 1, 0, 0 if res is None else 1, 0, 0]
    groups = math.ceil(O / 256) * math.ceil(M / 4)
    return [g.op("linear", "linear_bias_fill", g.grid1d(groups, "bias_fill"), params,
                 [None, None, None, None, w, g.dummy(2) if res is None else res, y, None, None])]


def split_sum(g, M, N, part, S, c, c_off, c_rs, accumulate=False, bias=None, bias_off=0,
              res=None):
    """Ops: c[:, c_off:c_off+N] (M rows c_rs apart) (+)= the sum of S partial products
    (M, N), dense one after the other in ``part``, in slice order (+ bias[bias_off + j])
    (+ res at c's place) (linear_split_sum; e.g. linear_f16.dweight's split-K slices,
    linear_split's products)."""
    return [_sum_op(g, M, N, c, c_off, c_rs, part, S, bias=bias, bias_off=bias_off,
                    beta=1 if accumulate else 0, res=res, label="split_sum")]


def linear_backward(g, M, I, O, dy, dy_off, dy_rs, x, x_off, x_rs, w, w_off, b_off, gr,
                    dx=None, dx_off=0, dx_rs=0, dx_beta=0, part=None):
    """Ops of the backward of :func:`linear_forward`: dx (M, I) = dy @ W (``+=`` when
    ``dx_beta``; skipped when ``dx`` is None); dW (at ``w_off`` of the gradient arena
    ``gr``) += dy^T @ x and db (at ``b_off``) += column sums of dy, in one product
    (split-K partials of both products in ``part`` when given: a buffer none of these ops
    touches). Where the device has f16 subgroup matrices and the layer's sizes fit them,
    both products run as split f16 products from one split of dy
    (:func:`mamba_ext.gpu.linear_split.backward`)."""
    from . import linear_split
    if linear_split.active(g):
        mats = (Mat(dy, dy_off, dy_rs), Mat(x, x_off, x_rs), Mat(w, w_off, I))
        if linear_split.backward_unsupported(g, M, I, O, *mats, w_off, dx_off,
                                             dx_rs or I) is None:
            return linear_split.backward(g, M, I, O, *mats, gr, w_off, b_off, dx=dx,
                                         dx_off=dx_off, dx_rs=dx_rs or I, dx_beta=dx_beta)
    ops = []
    if dx is not None:
        # dx (M, I) = dy (M, O) @ W (O, I)
        ops += gemm(g, "linear_backward", M, I, O, Mat(dy, dy_off, dy_rs), Mat(w, w_off, I),
                    Mat(dx, dx_off, dx_rs), beta=dx_beta, part=part)
    # dW (O, I) += dy^T (O, M) @ x (M, I); db += the row sums of dy^T
    ops += gemm(g, "linear_backward", O, I, M, Mat(dy, dy_off, 1, dy_rs), Mat(x, x_off, x_rs),
                Mat(gr, w_off, I), beta=1, dbias=gr, db_off=b_off, part=part)
    return ops
