"""fp32 products on tensor cores: each f32 operand split into two f16 parts, the product
run as three f16 products of one contraction (kernels/linear_split.wgsl, then
kernels/linear_f16.wgsl with SCALED; cf. Ootomo & Yokota 2022, "Recovering single
precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
performance").

Design: ``A B = (A_hi B_hi + A_hi B_lo + A_lo B_hi) / (sA sB)`` with each operand scaled by
a power of two (its largest |x| into [2^14, 2^15)) and split into an f16 high part and the
f16 rounding of the rest: the operands keep ~22 of float32's 24 bits, the products of f16
parts are exact in the f32 accumulators, and the dropped A_lo B_lo is 2^-22 of the terms.
Each operand is packed once into two f16 planes (hi, lo) in the layout the subgroup-matrix
kernel reads fastest (A k-major, B n-major, transposed through workgroup memory where the
f32 operand is not), and the kernel runs one product of contraction 3K whose k steps walk
A's planes hi, hi, lo and B's hi, lo, hi (:class:`Segments`). The scales are found on the
device (each operand's largest |x|: linear_split_absmax, reduced in linear_split_pack),
so nothing is read back. The backward of a linear layer packs its output gradient dY once
for both of its products (dX = dY W reads it as A, dW^T = X^T dY as B: the same row-major
planes) and stores dW transposed (:func:`backward`).

:func:`mamba_ext.gpu.linear.gemm` and :func:`mamba_ext.gpu.linear.linear_backward` run
their products here where :func:`active` and the sizes fit (:func:`unsupported`), else on
the fp32 kernel (kernels/linear.wgsl). The scratch it takes: the planes, as many bytes as
the f32 operands (e.g. 201 MB for block d's in_proj output gradient), and the split-K
partials of the weight gradients, in device scratch buffers.

Size letters: M rows, N columns, K contraction of the product C (M, N) = A (M, K) B (K, N);
a linear layer's X (M, I), W (O, I), Y (M, O).
"""
from __future__ import annotations

import math
from typing import NamedTuple

ENABLED = None     # None: where the device has f16 subgroup matrices (the Dawn backend on
                   # NVIDIA, AMD RDNA3, Intel, Apple); False: never; True: wherever
                   # linear_f16 runs, its REFERENCE kernel included (the tests on lavapipe)
UNIT = 64          # the packing's tile: every size must be a multiple of it
SLOTS = 4          # operands whose scales one pass of products keeps at once
NP_MAX = 1024      # linear_split_absmax's workgroups (partial maxima) per operand, at most
ELEMS_PER_GROUP = 16 * 256   # source elements per linear_split_absmax workgroup, at least


class Segments(NamedTuple):
    """What linear_f16.product needs of a product of split operands: the scales buffer,
    the contraction of one segment (K), A's and B's lo planes after their hi planes (f16
    elements), and the scale slots of A and B (sc[2 slot] = s, sc[2 slot + 1] = 1/s)."""
    scales: object
    kseg: int
    plane_a: int
    plane_b: int
    sa: int
    sb: int


def active(g) -> bool:
    """Whether fp32 products of ``g`` run here (see :data:`ENABLED`)."""
    from . import linear_f16
    if ENABLED is False:
        return False
    if ENABLED is None and linear_f16.REFERENCE:
        return False
    return linear_f16.available(g)


def _contiguous(m) -> bool:
    return m.cs == 1 or m.rs == 1


def unsupported(g, M, N, K, A, B, C, *, bias=None, beta=0, res=None, dbias=None) -> str | None:
    """Why :func:`gemm` cannot take this product (a sentence), or None (the arguments as
    :func:`mamba_ext.gpu.linear.gemm`'s)."""
    from . import linear_f16
    if M % linear_f16.TILE[0] or N % linear_f16.TILE[1] or K % UNIT or K <= 0:
        return (f"M {M} and N {N} must be multiples of {linear_f16.TILE[0]}, K {K} of "
                f"{UNIT}")
    if not (_contiguous(A) and _contiguous(B)) or C.cs != 1:
        return "each operand contiguous along its rows or columns, C along its rows"
    if C.rs % 4 or C.off % 4:
        return "C's row stride and offset must be multiples of 4"
    if beta not in (0, 1) or beta and (bias is not None or res is not None):
        return "C = beta C + A B with beta 0 or 1, a bias or residual only with beta 0"
    if res is not None and bias is None:
        return "a residual only with a bias"
    if dbias is not None and A.rs != 1:
        return "a bias gradient only from the rows of A as columns of its buffer"
    if 4 * max(M * K, K * N) > g.max_binding or 2 * max(M * K, K * N) >= 2 ** 31:
        return "the f16 planes exceed the device's binding size"
    return None


def pack(g, src, R: int, C: int, slot: int):
    """Ops, planes: the (R, C) f32 block ``src`` (a :class:`mamba_ext.gpu.linear.Mat`,
    contiguous along its rows or columns; R, C multiples of :data:`UNIT`) split into its f16
    planes hi and lo, each (R, C) row-major, lo R*C f16 after hi, in the device scratch
    buffer of ``slot``, and its scale into scale slot ``slot``: linear_split_absmax, then
    linear_split_pack. Returns (ops, the planes' buffer, the scales' buffer)."""
    sc = g.scratch("linear_split_scales", 2 * SLOTS + SLOTS * NP_MAX)
    planes = g.scratch(f"linear_split_{slot}", R * C)        # 2 (R, C) f16
    cs1 = src.cs == 1
    run_len, stride = (C, src.rs) if cs1 else (R, src.cs)
    vec4 = run_len % 4 == 0 and stride % 4 == 0 and src.off % 4 == 0
    np_ = max(1, min(NP_MAX, math.ceil(R * C / ELEMS_PER_GROUP)))
    params = [R, C, src.off, src.rs, src.cs, 0, R * C // 2, slot, np_]
    consts = {"CS1": cs1, "VEC4": vec4, "SLOTS": SLOTS, "NP_MAX": NP_MAX}
    return [g.op("linear_split", "linear_split_absmax", (np_, 1, 1), params,
                 [src.buf, None, sc], consts),
            g.op("linear_split", "linear_split_pack",
                 g.check_grid((C // UNIT, R // UNIT, 1), "linear_split_pack"), params,
                 [src.buf, planes, sc], consts)], planes, sc


def product(g, c, M, N, K, a, sa, b, sb, sc, *, ldc, c_off=0, accumulate=False, bias=None,
            res=None, c_colmajor=False):
    """Ops: C (M, N) [+]= A B (+ bias) (+ res) from A's planes (M, K) in ``a`` and B's (K, N)
    in ``b`` (:func:`pack`, scale slots ``sa``, ``sb``); ``bias`` (buffer, offset), ``res``
    (a buffer at C's place, with a bias) not with ``accumulate``. A product that adds to C
    or a residual, or whose few tiles would leave the GPU idle, is made as S >= 1 partial
    products over K slices in a scratch buffer (linear_f16.dweight_splits), summed in slice
    order into C with the bias, residual or C (linear.split_sum): the kernel
    never starts from C (see kernels/linear_f16.wgsl, SCALED). ``c_colmajor``: C stored
    transposed, C[i, j] at c[c_off + j*ldc + i] (no bias or residual)."""
    from . import linear_f16
    from .linear import split_sum
    seg = Segments(sc, K, M * K, K * N, 2 * sa, 2 * sb)
    kw = dict(a_kmajor=True, b_kmajor=False, lda=K, ldb=N, split=seg)
    S = linear_f16.dweight_splits(3 * K, N, M)
    if S == 1 and not accumulate and res is None:
        return [linear_f16.product(g, c, a, b, M, N, 3 * K, ldc=ldc, c_off=c_off, bias=bias,
                                   c_colmajor=c_colmajor, **kw)]
    part = g.scratch("linear_f16_split", S * M * N)
    rows, cols = (N, M) if c_colmajor else (M, N)
    b_buf, b_off = bias if bias is not None else (None, 0)
    return [linear_f16.product(g, part, a, b, M, N, 3 * K, ldc=M if c_colmajor else N,
                               splits=S, c_colmajor=c_colmajor, **kw),
            *split_sum(g, rows, cols, part, S, c, c_off, ldc, accumulate=accumulate,
                       bias=b_buf, bias_off=b_off, res=res)]


def gemm(g, M, N, K, A, B, C, *, bias=None, bias_off=0, beta=0, res=None, dbias=None,
         db_off=0):
    """Ops for C (M, N) = beta*C + A (M, K) @ B (K, N) (+ bias[bias_off + j]) (+ res at C's
    place), and ``dbias[db_off + i]`` += the row sums of A: :func:`mamba_ext.gpu.linear.gemm`
    (its arguments' meanings), here as three f16 products (where :func:`unsupported` says
    None)."""
    from .device import column_sum
    why = unsupported(g, M, N, K, A, B, C, bias=bias, beta=beta, res=res, dbias=dbias)
    if why:
        raise ValueError(f"mamba_ext.gpu.linear_split: {why}")
    ops_a, a, sc = pack(g, A, M, K, 0)
    ops_b, b, _ = pack(g, B, K, N, 1)
    ops = ops_a + ops_b
    if dbias is not None:           # the row sums of A: the column sums of its buffer
        ops += column_sum(g, K, M, A.buf, A.off, A.cs, dbias, db_off)
    return ops + product(g, C.buf, M, N, K, a, 0, b, 1, sc, ldc=C.rs, c_off=C.off,
                         accumulate=bool(beta), bias=None if bias is None else (bias, bias_off),
                         res=res)


def backward_unsupported(g, M, I, O, dy, x, w, w_off, dx_off, dx_rs) -> str | None:
    """Why :func:`backward` cannot take this layer's backward, or None (the arguments of
    :func:`backward`)."""
    from .linear import Mat
    return (unsupported(g, M, I, O, dy, w, Mat(None, dx_off, dx_rs))
            or unsupported(g, I, O, M, Mat(x.buf, x.off, 1, x.rs), dy, Mat(None, w_off, I))
            or (None if dy.cs == 1 and x.cs == 1 and w.cs == 1 else "row-major operands"))


def backward(g, M, I, O, dy, x, w, gr, w_off, b_off, dx=None, dx_off=0, dx_rs=0, dx_beta=0):
    """Ops of :func:`mamba_ext.gpu.linear.linear_backward` (its meanings; ``dy``, ``x``,
    ``w`` row-major :class:`mamba_ext.gpu.linear.Mat`) with split products: dY packed once
    for both, dX (M, I) [+]= dY W, dW (O, I) += dY^T X computed as its transpose X^T dY and
    stored transposed (A = X^T k-major, B = dY n-major), db += the column sums of dY."""
    from .device import column_sum
    from .linear import Mat
    why = backward_unsupported(g, M, I, O, dy, x, w, w_off, dx_off, dx_rs or I)
    if why:
        raise ValueError(f"mamba_ext.gpu.linear_split: {why}")
    ops, pdy, sc = pack(g, dy, M, O, 0)                       # dY (M, O): slot 0
    if dx is not None:
        ops_w, pw, _ = pack(g, w, O, I, 1)                    # W (O, I): slot 1
        ops += ops_w + product(g, dx, M, I, O, pdy, 0, pw, 1, sc, ldc=dx_rs, c_off=dx_off,
                               accumulate=bool(dx_beta))
    ops_x, pxt, _ = pack(g, Mat(x.buf, x.off, 1, x.rs), I, M, 2)   # X^T (I, M): slot 2
    ops += ops_x + product(g, gr, I, O, M, pxt, 2, pdy, 0, sc, ldc=I, c_off=w_off,
                           accumulate=True, c_colmajor=True)
    return ops + column_sum(g, M, O, dy.buf, dy.off, dy.rs, gr, b_off)
