"""The linear layers' products on tensor cores (kernels/linear_f16.wgsl): f16 operands,
f32 accumulation and output, through WGSL subgroup matrices, for mixed precision.

``Y = X @ W^T`` with X (M, I), W (O, I), Y (M, O) as in :mod:`mamba_ext.gpu.linear`:
:func:`forward` (Y), :func:`dinput` (dX = dY @ W) and :func:`dweight` (dW = dY^T @ X),
each with f16 operand buffers and an f32 result that is written or, with
``accumulate``, added to; :func:`forward` also starts from a bias where it is given one
(linear.py's epilogue, moved before the product). They run where the device offers an
f16 x f16 -> f32 subgroup-matrix configuration (``Gpu.f16_matrices``: the Dawn backend on
NVIDIA, AMD RDNA3, Intel Xe and Apple GPUs); :func:`available` says whether it does, and
:func:`unsupported` why a product's sizes do not fit the kernel (then the fp32 kernels
of linear.py are the fallback). :func:`pack` makes the f16 operands (kernels/amp.wgsl's
rounding, as NumPy's ``astype(float16)``; the kernels that read the f16 mode's cache take
its values exactly, common.wgsl's act_value), and :class:`HalfWeights` makes the f16
copies of a parameter arena's weight matrices that mixed-precision training multiplies with.

``REFERENCE``: run kernels/linear_f16_ref.wgsl instead, a plain kernel of the same
product for devices without subgroup matrices (slow; the tests of the mixed-precision
data path on CI's lavapipe set it).

Size letters: M rows, N columns, K contraction of the product.
"""
from __future__ import annotations

import numpy as np

TILE = (128, 128)        # rows x columns of C per workgroup: the unit products are padded to
BK = 32                  # the contraction's unit (a multiple of every tile's step)
WORKGROUP = 256          # invocations per workgroup of the unit tile
# the kernel's workgroup tiles (rows BM, columns BN, contraction step BK, invocations), the
# preferred first: a product takes the first that divides its sizes and fits the device.
# Each divides every product of whole unit tiles. k steps of 16 halve the staged bytes (32 KB
# in all: Apple GPUs allow 32 KB of workgroup memory, the 32-step tile needs 48); on an H200
# they ran at 109-118 TFLOP/s against 145-195 (docs/gpu_h200.txt, session 22)
TILES = ((128, 128, 32, 256), (128, 128, 16, 256))
UNIT_TILE = (*TILE, BK, WORKGROUP)    # the unit tile as an entry of TILES (its first)
REFERENCE = False        # True: the portable reference kernel instead of subgroup matrices
SPLIT_TARGET = 512       # workgroups a weight gradient's product is split into K slices to
                         # reach (its few tiles alone leave most of a large GPU idle)
SPLIT_MIN_K = 512        # contraction of one slice, at least
N_STEP = 16              # a narrow product stores whole result matrices: its columns a
                         # multiple of the widest TN an adapter offers (16)


def available(g) -> bool:
    """Whether the products run on ``g``: kernels/linear_f16.wgsl where the device has an
    f16 -> f32 subgroup-matrix shape that tiles the kernel's subgroup blocks, a subgroup
    size that divides 256 and the workgroup memory of one of :data:`TILES`; anywhere with
    ``REFERENCE``."""
    return REFERENCE or any(plan(g, t) is not None for t in TILES)


def plan(g, tile=UNIT_TILE):
    """(shape {"m","n","k"}, WM, WN) of workgroup tile ``tile`` (BM, BN, BK, invocations,
    :data:`TILES`) on ``g``, or None: the subgroups of a workgroup in a WM x WN grid (as
    square as it goes, WN >= WM: of 8 subgroups' blocks of 128 x 128, 64 x 32 ran 1% faster
    than 32 x 64 on an H200, docs/gpu_h200.txt session 22), the largest shape whose tiles
    divide a subgroup's block. None also where the device does not allow the tile's
    invocations or workgroup memory."""
    bm, bn, bk, wgs = tile
    sg = getattr(g, "subgroup_size", 0)
    if not sg or wgs % sg or not getattr(g, "f16_matrices", None):
        return None
    if wgs > getattr(g, "max_invocations", WORKGROUP) or _staged_bytes(tile) > getattr(
            g, "wg_memory", _staged_bytes(UNIT_TILE)):
        return None
    n_sub = wgs // sg
    wm = 1
    while 4 * wm * wm <= n_sub:
        wm *= 2
    wn = n_sub // wm
    fits = [c for c in g.f16_matrices
            if (bm // wm) % c["m"] == 0 and (bn // wn) % c["n"] == 0 and bk % c["k"] == 0]
    if not fits:
        return None
    return max(fits, key=lambda c: (c["m"] * c["n"] * c["k"], c["k"])), wm, wn


def _staged_bytes(tile) -> int:
    """Workgroup memory of the kernel with ``tile``: two staging buffers of each operand
    (rows padded by 8 f16, the larger of its two layouts) and the bias rows (16 x BN f32)."""
    bm, bn, bk, _ = tile
    stage = lambda n: max(n * (bk + 8), bk * (n + 8)) * 2     # noqa: E731
    return 2 * (stage(bm) + stage(bn)) + 16 * bn * 4


def tile_for(g, M: int, N: int, K: int):
    """The first of :data:`TILES` whose BM, BN and BK divide M, N and K and that
    :func:`plan` lays out on ``g`` (one does wherever :func:`available` and
    :func:`unsupported` allow the product)."""
    for tile in TILES:
        if M % tile[0] == 0 and N % tile[1] == 0 and K % tile[2] == 0 and plan(g, tile):
            return tile
    raise ValueError(f"mamba_ext.gpu.linear_f16: no workgroup tile of {TILES} fits M {M}, "
                     f"N {N}, K {K} on this device")


def prelude(g, a_kmajor: bool, b_kmajor: bool, accumulate: bool, K: int, lda: int, ldb: int,
            ldc: int, cslice: int = 0, init_bias: bool = False, n_valid: int = 0,
            c_colmajor: bool = False, tile=UNIT_TILE, split=None) -> str:
    """The WGSL put before kernels/linear_f16.wgsl: its ``enable`` directives and its
    constants (the subgroup layout, the operand layouts, and the product's contraction
    length and strides, which as uniforms made the kernel 4x slower; ``K`` and ``cslice``
    per K slice of a split product; ``n_valid`` the columns of C stored; ``tile`` the
    workgroup tile, :data:`TILES`; ``split``: the segments and scales of a product of
    split operands, :class:`mamba_ext.gpu.linear_split.Segments`). The stores of a
    narrow product's last tile depend on the subgroup (its columns), which WGSL's
    uniformity analysis, at workgroup scope, cannot prove subgroup-uniform: the directive
    turns that diagnostic off (every subgroup matrix call stays subgroup-uniform). With
    ``REFERENCE``: the constants kernels/linear_f16_ref.wgsl uses."""
    b = lambda v: "true" if v else "false"
    head = ""
    if not REFERENCE:
        cfg, wm, wn = plan(g, tile)
        bm, bn, bk, wgs = tile
        head = ("enable f16;\nenable chromium_experimental_subgroup_matrix;\n"
                "diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);\n"
                f"const BM : u32 = {bm}u;\nconst BN : u32 = {bn}u;\nconst BK : u32 = {bk}u;\n"
                f"const WGS : u32 = {wgs}u;\n"
                f"const TM : u32 = {cfg['m']}u;\nconst TN : u32 = {cfg['n']}u;\n"
                f"const TK : u32 = {cfg['k']}u;\nconst SG : u32 = {g.subgroup_size}u;\n"
                f"const WM : u32 = {wm}u;\nconst WN : u32 = {wn}u;\n")
    return (head +
            f"const A_KMAJOR : bool = {b(a_kmajor)};\nconst B_KMAJOR : bool = {b(b_kmajor)};\n"
            f"const ACCUMULATE : bool = {b(accumulate)};\n"
            f"const INIT_BIAS : bool = {b(init_bias)};\n"
            f"const C_COLMAJOR : bool = {b(c_colmajor)};\n"
            f"const SCALED : bool = {b(split is not None)};\n"
            f"const KSEG : u32 = {split.kseg if split else BK}u;\n"
            f"const PLANE_A : u32 = {split.plane_a // 8 if split else 0}u;\n"
            f"const PLANE_B : u32 = {split.plane_b // 8 if split else 0}u;\n"
            f"const SA : u32 = {split.sa if split else 0}u;\n"
            f"const SB : u32 = {split.sb if split else 0}u;\n"
            f"const NVALID : u32 = {int(n_valid)}u;\n"
            f"const CSLICE : u32 = {int(cslice)}u;\n"
            f"const KLEN : u32 = {int(K)}u;\nconst LDA : u32 = {int(lda)}u;\n"
            f"const LDB : u32 = {int(ldb)}u;\nconst LDC : u32 = {int(ldc)}u;\n")


def unsupported(M: int, N: int, K: int, lda: int, ldb: int, ldc: int,
                a_off: int = 0, b_off: int = 0, c_off: int = 0, n_valid: int | None = None) -> str | None:
    """Why the kernel cannot take this product (a sentence), or None when it can.
    ``n_valid``: the columns of C stored (default N), a multiple of :data:`N_STEP`."""
    if M <= 0 or N <= 0 or K <= 0:
        return f"empty product (M {M}, N {N}, K {K})"
    if M % TILE[0] or N % TILE[1] or K % BK:
        return (f"M {M} and N {N} must be multiples of {TILE[0]} and {TILE[1]}, K {K} of {BK} "
                f"(whole tiles only)")
    if n_valid is not None and not (0 < n_valid <= N and n_valid % N_STEP == 0):
        return (f"the stored columns ({n_valid}) must be a positive multiple of {N_STEP} and "
                f"at most N {N}")
    if lda % 8 or ldb % 8 or a_off % 8 or b_off % 8:
        return "operand strides and offsets must be multiples of 8 f16 (16-byte loads)"
    if ldc % 4 or c_off % 4:
        return "the result's row stride and offset must be multiples of 4"
    return None


def f16_buffer(g, data, name: str):
    """A storage buffer holding ``data`` rounded to float16 (two per 4-byte word)."""
    h = np.ascontiguousarray(data, dtype=np.float16).ravel()
    return g.buffer((h.size + 1) // 2, name, h)


def product(g, c, a, b, M: int, N: int, K: int, *, a_kmajor: bool, b_kmajor: bool,
            lda: int, ldb: int, ldc: int, a_off: int = 0, b_off: int = 0, c_off: int = 0,
            accumulate: bool = False, splits: int = 1, bias=None, n_valid: int | None = None,
            c_colmajor: bool = False, split=None):
    """The op C (M, N) [+]= A (M, K) B (K, N) (layouts in kernels/linear_f16.wgsl's
    legend; offsets and strides in elements: f16 for a and b, f32 for c). ``splits`` S > 1:
    S partial products over K slices instead, slice z's (M, N) at c_off + z*M*ldc (sum
    them with linear.split_sum). ``bias`` (buffer, offset): C starts from bias (N,) instead
    of 0 (not with ``accumulate`` or ``splits``). ``n_valid``: only C's first n_valid
    columns exist (a narrow product on operands zero-padded to N; default N).
    ``c_colmajor``: C[i, j] at c[c_off + j*ldc + i] (a transposed result; a split slice is
    then N*ldc long). ``split``: the operands are the f16 planes of scaled f32 operands
    (:class:`mamba_ext.gpu.linear_split.Segments`: K = 3 segments of kseg, each reading a
    plane; the scales in its buffer), and C (M, N) = (A B) / (sA sB), the bias start value
    scaled by sA sB before the products (not with ``accumulate``)."""
    if not available(g):
        raise RuntimeError("mamba_ext.gpu.linear_f16: this device offers no f16 subgroup "
                           "matrices (they need MAMBA_EXT_GPU_BACKEND=dawn on a GPU that has "
                           "them); use the fp32 products of mamba_ext.gpu.linear")
    why = unsupported(M, N, K, lda, ldb, ldc, a_off, b_off, c_off, n_valid)
    if why:
        raise ValueError(f"mamba_ext.gpu.linear_f16: {why}")
    if splits < 1 or K % (splits * BK):
        raise ValueError(f"mamba_ext.gpu.linear_f16: K {K} does not split into {splits} "
                         f"slices of a multiple of {BK}")
    if bias is not None and (accumulate or splits > 1):
        raise ValueError("mamba_ext.gpu.linear_f16: a bias start value goes with neither "
                         "accumulate nor splits")
    if split is not None and (K != 3 * split.kseg or split.kseg % BK or accumulate
                              or split.plane_a % 8 or split.plane_b % 8):
        raise ValueError(f"mamba_ext.gpu.linear_f16: K {K} must be 3 segments of a multiple of "
                         f"{BK} (got {split.kseg}), the planes 8 f16 apart, and a split "
                         f"product not accumulate")
    nv = N if n_valid is None else n_valid
    if REFERENCE:     # (its prelude takes no tile)
        tile, file, grid = UNIT_TILE, "linear_f16_ref", (N // 16, M // 16, splits)
    else:
        tile = tile_for(g, M, N, K // splits)
        file, grid = "linear_f16", (N // tile[1], M // tile[0], splits)
    bias_buf, bias_off = bias if bias is not None else (g.dummy(0), 0)
    cslice = (nv * ldc if c_colmajor else M * ldc) if splits > 1 else 0
    return g.op(file, "linear_f16_product", g.check_grid(grid, "linear_f16_product"),
                [a_off, b_off, c_off, bias_off],
                [a, b, c, bias_buf, g.dummy(0) if split is None else split.scales],
                prelude=prelude(g, a_kmajor, b_kmajor, accumulate, K // splits, lda, ldb, ldc,
                                cslice, bias is not None, nv, c_colmajor, tile, split))


def forward(g, y, x, wt, M: int, I: int, O: int, accumulate: bool = False, wt_off: int = 0,
            bias=None):
    """Ops: Y (M, O) f32 [+]= X (M, I) @ W (O, I)^T, X f16 and W given as its f16
    transpose W^T (I, O) (from ``wt_off``: :class:`HalfWeights`' ``transposed``), so that B
    is n-major, dX's layout (from W itself, k-major: 173 against 186 TFLOP/s on an H200,
    docs/gpu_h200.txt session 23); ``bias`` (buffer, offset): Y starts from b (O,) f32 (not
    with ``accumulate``)."""
    return [product(g, y, x, wt, M, O, I, a_kmajor=True, b_kmajor=False, lda=I, ldb=O, ldc=O,
                    b_off=wt_off, accumulate=accumulate, bias=bias)]


def dinput(g, dx, dy, w, M: int, I: int, O: int, accumulate: bool = True, w_off: int = 0):
    """Ops: dX (M, I) f32 [+]= dY (M, O) @ W (O, I), dY and W f16 (W from ``w_off``)."""
    return [product(g, dx, dy, w, M, I, O, a_kmajor=True, b_kmajor=False, lda=O, ldb=I, ldc=I,
                    b_off=w_off, accumulate=accumulate)]


def dweight_splits(M: int, I: int, O: int) -> int:
    """K slices of a weight gradient's product (O x I outputs, each rounded up to whole
    tiles, contraction M): doubled while the tiles stay under :data:`SPLIT_TARGET`
    workgroups and each slice keeps at least :data:`SPLIT_MIN_K` of the contraction in
    whole steps of :data:`BK`."""
    tiles, s = -(-O // TILE[0]) * -(-I // TILE[1]), 1
    while tiles * s < SPLIT_TARGET and M % (2 * s * BK) == 0 and M // (2 * s) >= SPLIT_MIN_K:
        s *= 2
    return s


def weight_product(g, dw, dw_off: int, rows: int, cols: int, K: int, a, b, *, b_kmajor: bool,
                   ldb: int, n_valid: int | None = None, c_colmajor: bool = False,
                   accumulate: bool = True):
    """Ops: the weight gradient C (rows, n_valid) [+]= A (rows, K) B (K, cols), A k-major
    (its rows K apart: a transposed activation, :func:`pack_pair`), into ``dw`` from
    ``dw_off`` with rows ``n_valid`` (default cols) apart, or, ``c_colmajor``, C's transpose
    with rows ``rows`` apart. Split over K (:func:`dweight_splits`) into partial products in
    a device scratch buffer, summed in slice order into dW (linear.split_sum)."""
    from .linear import split_sum
    nv = cols if n_valid is None else n_valid
    ldc = rows if c_colmajor else nv
    S = dweight_splits(K, cols, rows)
    kw = dict(a_kmajor=True, b_kmajor=b_kmajor, lda=K, ldb=ldb, ldc=ldc,
              n_valid=None if n_valid is None else nv, c_colmajor=c_colmajor)
    if S == 1:
        return [product(g, dw, a, b, rows, cols, K, c_off=dw_off, accumulate=accumulate, **kw)]
    part = g.scratch("linear_f16_split", S * rows * nv)
    out_rows, out_cols = (nv, rows) if c_colmajor else (rows, nv)
    return [product(g, part, a, b, rows, cols, K, splits=S, **kw),
            *split_sum(g, out_rows, out_cols, part, S, dw, dw_off, out_cols, accumulate)]


def dweight(g, dw, x_t, dy, M: int, I: int, O: int, accumulate: bool = True,
            dw_off: int = 0):
    """Ops: dW (O, I) f32 [+]= dY (M, O)^T @ X (M, I), computed as its transpose X^T dY from
    X^T (I, M) (k-major, :func:`pack_pair`) and dY (M, O) (n-major: the row-major f16 copy
    dX's product reads) and stored transposed: the kernel's fast layout (dY^T X from both
    transposes ran at 145-156 against 159-175 TFLOP/s on an H200, docs/gpu_h200.txt session
    23); into ``dw`` from ``dw_off``, e.g. a gradient arena (:func:`weight_product`: split
    over K)."""
    return weight_product(g, dw, dw_off, I, O, M, x_t, dy, b_kmajor=False, ldb=O,
                          c_colmajor=True, accumulate=accumulate)


def narrow_forward(g, y, x, x16, w16, M: int, I: int, O: int, *, w_off: int, bias):
    """Ops of a layer whose O outputs are not whole tiles (x_proj's 80, the tied head's
    vocabulary), Y (M, O) f32 = X (M, I) @ W (O, I)^T + b: X rounded to f16 into ``x16``
    (M, I) (``x`` None: ``x16`` holds it already), then the product from W's f16 copy
    (``w16`` from ``w_off``, rows zero-padded to padded(O): :class:`HalfWeights`) storing
    only Y's O columns (a multiple of :data:`N_STEP`), started from ``bias`` (buffer,
    offset)."""
    return [*([] if x is None else [pack(g, x16, x, M, I)]),
            product(g, y, x16, w16, M, padded(O), I, a_kmajor=True, b_kmajor=True, lda=I,
                    ldb=I, ldc=O, b_off=w_off, bias=bias, n_valid=O)]


def narrow_backward(g, dx, dy, x, w16, gr, M: int, I: int, O: int, *, w_off: int,
                    dw_off: int, db_off: int, dy16, x16_t, accumulate_dx: bool,
                    x16_t_written: bool = False):
    """Ops of :func:`narrow_forward`'s backward: dX (M, I) [+]= dY @ W; dW (O, I) in the
    gradient arena ``gr`` from ``dw_off`` += dY^T X, computed as its transpose X^T dY (so
    that A is k-major) and stored transposed; db (O,) from ``db_off`` += the column sums of
    the f32 dY. dY (M, O) f32 goes to f16 into ``dy16`` (M, padded(O)), its rows padded
    with zeros; X (M, I) transposed to f16 into ``x16_t`` (I, M), unless
    ``x16_t_written`` (an op before wrote it there: the f16 mode's restoring conv)."""
    from .device import column_sum
    Op = padded(O)
    return [pack(g, dy16, dy, M, O, dst_cols=Op),
            product(g, dx, dy16, w16, M, I, -(-O // BK) * BK, a_kmajor=True, b_kmajor=False,
                    lda=Op, ldb=I, ldc=I, b_off=w_off, accumulate=accumulate_dx),
            *([] if x16_t_written else [pack_pair(g, None, x16_t, x, M, I)]),
            *weight_product(g, gr, dw_off, I, Op, M, x16_t, dy16, b_kmajor=False, ldb=Op,
                            n_valid=O, c_colmajor=True),
            *column_sum(g, M, O, dy, 0, O, gr, db_off)]


def layer_unsupported(M: int, I: int, O: int, w_off: int = 0, dw_off: int = 0,
                      wt_off: int = 0) -> str | None:
    """Why the three products of a linear layer X (M, I) -> Y (M, O) cannot all run in
    f16 (f16 weights at ``w_off``, their transpose at ``wt_off``, their f32 gradient at
    ``dw_off``), or None."""
    return (unsupported(M, O, I, I, O, O, 0, wt_off)                 # Y = X (W^T)
            or unsupported(M, I, O, O, I, I, 0, w_off)               # dX = dY W
            or unsupported(I, O, M, M, O, I, c_off=dw_off))          # dW^T = (X^T) dY


def pack(g, dst, src, rows: int, cols: int, src_off: int = 0, src_rs: int | None = None,
         dst_off: int = 0, dst_cols: int | None = None, count: int = 1, src_stride: int = 0,
         dst_stride: int = 0):
    """Op: ``dst`` from f16 element ``dst_off`` (even) = the (rows, cols) f32 block of
    ``src`` at ``src_off`` (row stride ``src_rs``, default cols) rounded to f16, in rows of
    ``dst_cols`` (default cols) whose columns past ``cols`` are written zero (an operand
    padded to whole tiles); ``cols`` and ``dst_cols`` even. ``count`` blocks of that shape
    at once, the m-th from ``src_off + m src_stride`` to ``dst_off + m dst_stride``
    (``dst_stride`` even, at least the block's rows x dst_cols): e.g. one matrix of every
    layer of a model in one dispatch."""
    from .amp import amp_params
    from .device import elementwise
    dc = cols if dst_cols is None else dst_cols
    if cols % 2 or dc % 2 or dst_off % 2 or dc < cols:
        raise ValueError(f"linear_f16.pack: cols {cols}, dst_cols {dc} and dst_off {dst_off} "
                         f"must be even, dst_cols >= cols")
    per = rows * dc // 2
    if count < 1 or (count > 1 and (dst_stride % 2 or dst_stride < 2 * per)):
        raise ValueError(f"linear_f16.pack: count {count} must be >= 1 and dst_stride "
                         f"{dst_stride} even and at least {2 * per} (one block)")
    n = per * count
    return elementwise(g, "amp", "amp_pack_f16", n,
                       amp_params(n, cols=cols, src_off=src_off,
                                  src_rs=cols if src_rs is None else src_rs,
                                  dst_off=dst_off // 2, rows=rows, dst_cols=dc, per=per,
                                  src_stride=src_stride, dst_stride=dst_stride // 2),
                       [src, None, dst])


def pack_pair(g, dst, dst_t, src, rows: int, cols: int, src_off: int = 0,
              src_rs: int | None = None, part=None, dst_off: int = 0, dst_t_off: int = 0,
              count: int = 1, src_stride: int = 0, dst_stride: int = 0, dst_t_stride: int = 0):
    """Op: the (rows, cols) f32 block of ``src`` (as :func:`pack`; ``src_off`` and
    ``src_rs`` even) rounded to f16 into ``dst`` row-major, (rows, cols) from f16 element
    ``dst_off``, and into ``dst_t`` transposed, (cols, rows) from ``dst_t_off`` (either
    skipped when None): e.g. an operand of a weight gradient and its k-major transpose
    (:func:`dweight`), read once. ``part``: also the column sums of each 64-row tile into
    it, (rows / 64, cols) f32 (:func:`pack_pair_bias`). ``rows`` and ``cols`` multiples of
    64, the offsets even. ``count`` blocks at once (as :func:`pack`; the strides even,
    ``part`` None)."""
    from .amp import amp_params
    if rows % 64 or cols % 64:
        raise ValueError(f"linear_f16.pack_pair: rows {rows} and cols {cols} must be "
                         f"multiples of 64")
    rs = cols if src_rs is None else src_rs
    if src_off % 2 or rs % 2 or dst_off % 2 or dst_t_off % 2:
        raise ValueError(f"linear_f16.pack_pair: src_off {src_off}, src_rs {rs}, dst_off "
                         f"{dst_off} and dst_t_off {dst_t_off} must be even (f32 and f16 pairs)")
    if dst is None and dst_t is None and part is None:
        raise ValueError("linear_f16.pack_pair: nothing to write (dst, dst_t and part None)")
    # several blocks: no part (its sums would collide); the strides even, and those of the
    # copies written at least a block apart
    written = [st for st, buf in ((dst_stride, dst), (dst_t_stride, dst_t)) if buf is not None]
    if count < 1 or (count > 1 and (part is not None or (src_stride | dst_stride | dst_t_stride) % 2
                                    or min(written) < rows * cols)):
        raise ValueError(f"linear_f16.pack_pair: count {count} must be >= 1, and with more "
                         f"than one block no part and even strides of at least a block")
    return g.op("amp", "amp_pack_f16_pair",
                g.check_grid((cols // 64, rows // 64, count), "pack_pair"),
                amp_params(rows * cols // 2, cols=cols, src_off=src_off, src_rs=rs, rows=rows,
                           dst_off=dst_off // 2, dst_t_off=dst_t_off // 2,
                           src_stride=src_stride, dst_stride=dst_stride // 2,
                           dst_t_stride=dst_t_stride // 2),
                [src, None, g.dummy(0) if dst is None else dst,
                 g.dummy(1) if dst_t is None else dst_t, None, None,
                 g.dummy(2) if part is None else part],
                {"ROW": dst is not None, "TRANS": dst_t is not None, "SUM": part is not None})


def pack_pair_bias(g, dst, dst_t, src, rows: int, cols: int, grad, db_off: int):
    """Ops: :func:`pack_pair` of a layer's f32 output gradient dY (rows, cols) (its
    transpose skipped when ``dst_t`` is None), and its bias gradient
    grad[db_off:db_off + cols] += the column sums of dY, from the same read (the sums of its
    64-row tiles, added in a fixed order: device.column_sum_final)."""
    from .device import column_sum_final, column_sum_part
    part = column_sum_part(g, rows // 64, cols)
    return [pack_pair(g, dst, dst_t, src, rows, cols, part=part),
            column_sum_final(g, cols, rows // 64, part, grad, db_off, src)]


def padded(n: int) -> int:
    """``n`` rounded up to whole tiles (:data:`TILE`): the rows and columns of the f16
    copies of the weights, and the row length of a narrow product's padded operands."""
    return -(-n // TILE[0]) * TILE[0]


def _strided_runs(tensors, offs, suffix=""):
    """``tensors`` [(name, arena offset, rows, cols)] cut into runs that one pack can take:
    the same last name part (e.g. every layer's wInProj) and shape, their arena offsets and
    their f16 offsets (``offs[name + suffix]``) at constant positive strides, in order (a
    tensor that breaks a run starts the next). Returns [(the run's first tensor, its
    length, (arena stride, f16 stride))], the strides (0, 0) for a run of one."""
    groups = {}
    for t in tensors:
        groups.setdefault((t[0].rsplit(".", 1)[-1], t[2], t[3]), []).append(t)
    runs = []
    for members in groups.values():
        first, n, step = members[0], 1, (0, 0)
        for prev, t in zip(members, members[1:]):
            s = (t[1] - prev[1], offs[t[0] + suffix] - offs[prev[0] + suffix])
            if s[0] > 0 and s[1] > 0 and (n == 1 or s == step):
                n, step = n + 1, s
            else:
                runs.append((first, n, step))
                first, n, step = t, 1, (0, 0)
        runs.append((first, n, step))
    return runs


class HalfWeights:
    """f16 copies of some matrices of a float32 parameter arena, for the products:
    ``buf`` holds each at an f16 offset ``offs[name]`` (a multiple of 8, the kernel's
    16-byte loads), padded with zeros to whole tiles, (padded(rows), padded(cols)) with
    rows ``ld[name]`` = padded(cols) apart, so that a narrow layer's products (x_proj's 80
    outputs, dt_proj's 48 inputs) read whole tiles; the matrices named in ``transposed``
    (whole tiles already: rows and cols multiples of :data:`TILE`) also as their transpose
    (cols, rows), ``offs[name + ".T"]``, rows ``ld[name + ".T"]`` = rows apart (the B
    operand of :func:`forward`, :func:`pack_pair`). ``ops`` make
    them from the arena (run them whenever the arena changed, e.g. once per training
    step). ``tensors``: [(name, arena offset, rows, cols)]."""

    def __init__(self, g, arena, tensors, transposed=()):
        self.offs, self.ld, at = {}, {}, 0
        for name, _, rows, cols in tensors:
            copies = [(name, padded(rows), padded(cols))]
            if name in transposed:
                if padded(rows) != rows or padded(cols) != cols:
                    raise ValueError(f"linear_f16.HalfWeights: {name} ({rows}, {cols}) is not "
                                     f"whole tiles of {TILE}, so not kept transposed")
                copies.append((name + ".T", cols, rows))
            for key, r, c in copies:
                self.offs[key] = at
                self.ld[key] = c
                at += r * c
        self.buf = g.buffer(at // 2, "params_f16")
        self.ops = []
        for (name, off, rows, cols), n, (ss, ds) in _strided_runs(tensors, self.offs):
            self.ops.append(pack(g, self.buf, arena, rows, cols, src_off=off,
                                 dst_off=self.offs[name], dst_cols=self.ld[name], count=n,
                                 src_stride=ss, dst_stride=ds))
        # (a second read of the weight: one pack_pair would bind buf to two writable bindings)
        for (name, off, rows, cols), n, (ss, ds) in _strided_runs(
                [t for t in tensors if t[0] in transposed], self.offs, ".T"):
            self.ops.append(pack_pair(g, None, self.buf, arena, rows, cols, src_off=off,
                                      dst_t_off=self.offs[name + ".T"], count=n,
                                      src_stride=ss, dst_t_stride=ds))
