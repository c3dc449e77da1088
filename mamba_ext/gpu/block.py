"""One Mamba-1 block on the GPU, the mirror of mamba_ext/cpu/block.pyx (composition
of the steps) and of mamba_ext/block.py (public API).

``mamba1_forward(x, params)`` -> ``(out, cache)`` and
``mamba1_backward(dout, params, cache)`` -> ``(dx, grads)`` with NumPy arrays in
and out; float32 only. The cache is a :class:`GpuBlockCache` holding the GPU
buffers of the forward activations (they stay on the GPU); its plan goes back
to a pool for reuse once the cache is garbage collected.

A :class:`BlockLayer` owns the forward cache of one block (every activation the
backward needs, plus the scan's chunk states) and records, once, the
dispatches of its forward and backward; running a step is then only encoding
the recorded ops (no bind group or pipeline is created per step).

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, M = B*L, C = ceil(L / SCAN_CHUNK) scan chunks.
"""
from __future__ import annotations

import weakref

import numpy as np

from .._validate import (BLOCK_PARAM_NAMES, BlockDims, block_param_shapes, check_block_params,
                         check_discretization, check_eps, check_x)
from ..constants import DEFAULT_EPS
from . import scan as _scan
from .activations import gate_backward, gate_backward_f16, gate_forward, gate_forward_f16
from .conv1d import conv1d_backward, conv1d_forward
from . import linear_f16 as lf
from .device import arena_layout, gpu
from .linear import bias_fill, linear_backward, linear_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward

_POOL = {}          # plan key -> list of free plans
_POOL_MAX = 4       # free plans kept per key


def require_float32(name, arr):
    """float32 only on the GPU: anything else is a TypeError naming the dtype."""
    dt = getattr(arr, "dtype", None)
    if dt is not None and np.dtype(dt) != np.float32:
        raise TypeError(f"{name}: mamba_ext.gpu computes in float32 only, got dtype {np.dtype(dt)}; "
                        f"convert with .astype(np.float32) (or use the CPU API for float64)")


def validate_block(x, params):
    require_float32("x", x)
    for n in BLOCK_PARAM_NAMES:
        if isinstance(params, dict) and n in params:
            require_float32(n, params[n])
    xa = check_x("x", x, np.float32)
    arrays, dims = check_block_params(params, np.float32, d_model=xa.shape[2])
    return xa, arrays, dims


F16_WEIGHTS = ("wInProj", "wOutProj")    # the weights BlockLayer's f16 mode multiplies in f16
F16_TRANSPOSED = tuple(n + ".T" for n in F16_WEIGHTS)   # and their transposes (the forward's)
NARROW_F16_WEIGHTS = ("wXProj", "wDtProj")   # and those of x_proj and dt_proj, where they fit
NARROW_F16 = True       # False: x_proj and dt_proj stay f32 in the f16 mode (for comparison)


def narrow_f16_unsupported(P: int, R: int) -> str | None:
    """Why x_proj's and dt_proj's products (P = R + 2N outputs and R inputs) cannot run in
    f16, or None: their operands are padded to whole tiles, but the results are stored in
    whole result matrices, so P and R must be multiples of linear_f16.N_STEP (16)."""
    if P % lf.N_STEP or R % lf.N_STEP:
        return (f"dt_rank {R} and dt_rank + 2 d_state {P} must be multiples of {lf.N_STEP} "
                f"for x_proj's and dt_proj's f16 products")
    return None


def half_weights(g, arena, offs, shapes):
    """linear_f16.HalfWeights of the :data:`F16_WEIGHTS` of every block in a parameter
    arena, of its :data:`NARROW_F16_WEIGHTS` where :func:`narrow_f16_unsupported`
    allows, and of a model's ``embedding`` (the tied head) where its vocabulary is a
    multiple of linear_f16.N_STEP: ``offs`` {name: offset}, ``shapes`` {name: shape},
    block names bare (one block) or as ``layer{i}.<name>`` (a model)."""
    def wanted(k):
        base = k.rsplit(".", 1)[-1]
        if base in F16_WEIGHTS:
            return True
        if k == "embedding":        # the tied head's (model.head_forward): whole result matrices
            return shapes[k][0] % lf.N_STEP == 0
        if base in NARROW_F16_WEIGHTS and NARROW_F16:
            pre = k[:len(k) - len(base)]
            return narrow_f16_unsupported(shapes[pre + "wXProj"][0],
                                          shapes[pre + "wDtProj"][1]) is None
        return False
    return lf.HalfWeights(g, arena, [(k, offs[k], *shapes[k]) for k in offs if wanted(k)],
                          transposed=[k for k in offs if k.rsplit(".", 1)[-1] in F16_WEIGHTS])


def f16_unsupported(d: BlockDims, M, offs, half_offs) -> str | None:
    """Why in_proj's and out_proj's products of a block with M rows cannot run in f16
    (gradients at ``offs`` of the f32 arena, f16 weights at ``half_offs``), or None."""
    t = lf.TILE[0]
    if d.Dm % t or d.D % t or M % t:
        return (f"d_model {d.Dm}, d_inner {d.D} and batch x seq_len {M} must be multiples of "
                f"{t} (the f16 kernel's whole tiles)")
    return (lf.layer_unsupported(M, d.Dm, 2 * d.D, half_offs["wInProj"], offs["wInProj"],
                                 half_offs["wInProj.T"])
            or lf.layer_unsupported(M, d.D, d.Dm, half_offs["wOutProj"], offs["wOutProj"],
                                    half_offs["wOutProj.T"]))


def block_arena(d: BlockDims, prefix=""):
    """Arena layout of one block's 13 parameters: ({name: offset}, total)."""
    return arena_layout([(prefix + n, s) for n, s in block_param_shapes(d).items()])


class BlockScratch:
    """Backward temporaries of one block shape, shared by all layers of a model; ``f16``,
    ``narrow16``: those of BlockLayer's f16 mode, and of its x_proj and dt_proj in f16."""

    def __init__(self, g, d: BlockDims, s: _scan.ScanShape, f16=False, narrow16=False):
        M, D, P, Dm = s.M, d.D, d.P, d.Dm
        mk = g.buffer
        if f16:     # the f16 operands of the products (BlockLayer's f16 mode), 2 per word
            self.dout16 = mk(M * Dm // 2, "dout_f16")    # (M, Dm) f16: out_proj's dY
            # (M, 2D) f16: in_proj's dY, written by the gate's and the conv's backward (the
            # f16 mode has no f32 dY)
            self.dY16 = mk(M * D, "dY_f16")
        if f16 and narrow16:    # x_proj and dt_proj in f16 too (BlockLayer.narrow16)
            # (M, D) and (D, M) f16: ddelta_pre's copies, dt_proj's operands; (D, M) f16: u's
            # transpose, x_proj's weight-gradient operand, written by the restoring conv
            # (_narrow_backward_ops)
            self.narrow16 = mk(M * D // 2, "narrow_f16")
            self.narrow16_t = mk(M * D // 2, "narrow_f16_t")
            self.u16_t = mk(M * D // 2, "u_f16_t")
        # Buffers whose lifetimes within backward_ops do not overlap share one (the
        # steps: 1 out_proj, 2 gate, 3 scan, 4 dt_proj, 5 x_proj, 6 conv1d, 7 in_proj,
        # 8 RMSNorm): dgated [1, 2] / ddelta_pre [3, 4] / dxn [7, 8], and
        # dy [2, 3] / gw [8]. The split-K partials of the dW products (see linear.gemm)
        # live in a buffer dead at their step: dy's at steps 1, 4 and 5, du's at step 7.
        W = max(D, Dm)                               # the widest tenant of a shared buffer
        self.dgated = mk(M * W, "dgated")            # (M, D)
        self.ddelta_pre = self.dgated                # (M, D)
        self.dxn = self.dgated                       # (M, Dm)
        self.dy = mk(M * W, "dy")                    # (M, D)
        self.gw = self.dy                            # (M, Dm) per-row gain-gradient terms
        self.du = mk(M * D, "du")                    # (M, D)
        if not f16:
            self.dY = mk(M * 2 * D, "dY")            # (M, 2D) = [dxc | dz]
        self.dxproj = mk(M * P, "dxproj")            # (M, P) = [ddt_low | dBs | dCs]
        self.scan = _scan.ScanScratch(g, s)


class BlockLayer:
    """Forward cache and recorded ops of one block.

    ``w``/``gr``: parameter / gradient arenas, ``o``: block name -> offset in
    them. ``x``/``out``: (M, Dm) input and output buffers. ``cache_of``: another
    layer whose forward cache buffers this one shares (activation checkpointing).
    ``f16``: (buffer, {"wInProj": offset, "wOutProj": offset[, "wXProj": offset,
    "wDtProj": offset]}) of f16 copies of the two large weights (and of x_proj's and
    dt_proj's, which then run in f16 too: ``narrow16``, :meth:`_narrow_forward_ops`)
    (linear_f16.HalfWeights): in_proj's and out_proj's six products then
    run on tensor cores (mamba_ext.gpu.linear_f16) with f16 operands, and the cache keeps
    their f16 inputs, transposed (xn16_t, gated16_t: the weight gradients' k-major
    operands, linear_f16.dweight), instead of the f32 ones; in_proj's product starts from
    its bias, out_proj's accumulates onto its bias and the residual (linear.bias_fill), the
    bias gradients are column sums of the f32 gradients. The f16 mode's cache is small
    (mixed precision's memory): Y and y are kept in f16 (rounded as the products' operands
    are) and u and delta_pre not at all; the backward first restores u and delta_pre into
    f32 buffers shared by all layers (recomputed as the forward made them, u by the conv
    from the f16 Y), and the kernels that read Y or y (the gate's and the conv's backward)
    read their f16 copies, the same values as f32 copies of them would hold.
    """

    # the forward cache: what the backward reads (buffers() lists them)
    CACHE = ("xn", "rstd", "Y", "u", "xproj", "delta_pre", "hchunk", "achunk", "hstate", "y",
             "gated")
    # the f16 mode's cache, and its f32 buffers that one device scratch serves for all layers
    CACHE_F16 = ("xn16_t", "rstd", "Y16", "xproj", "hchunk", "achunk", "hstate", "y16",
                 "gated16_t")
    SHARED_F16 = ("xn", "xn16", "gated16", "Y", "u", "delta_pre", "y")

    def __init__(self, g, d: BlockDims, B, L, w, gr, offs, x, out, eps=DEFAULT_EPS,
                 discretization="zoh", chunk=None, cache_of=None, f16=None):
        self.g, self.d, self.B, self.L = g, d, B, L
        self.f16 = f16
        # x_proj and dt_proj in f16 too: where the f16 weights include theirs (half_weights)
        self.narrow16 = f16 is not None and all(k in f16[1] for k in NARROW_F16_WEIGHTS)
        if f16 is not None:
            why = f16_unsupported(d, B * L, offs, f16[1])
            if self.narrow16:
                why = why or narrow_f16_unsupported(d.P, d.R)
            if why:
                raise ValueError(f"mamba_ext.gpu: f16 products: {why}")
            self.CACHE = self.CACHE_F16
        self.w, self.gr, self.o, self.x, self.out = w, gr, offs, x, out
        self.eps = check_eps(eps)
        zoh = check_discretization(discretization) == 0
        self.s = _scan.ScanShape(B, L, d.D, d.N, d.R, int(chunk or _scan.SCAN_CHUNK), zoh,
                                 wg_memory=g.wg_memory, sub=_scan.subgroup_sums(g, d.N))
        M, D, P, Dm = B * L, d.D, d.P, d.Dm
        self.M = M
        self._fwd = None
        if cache_of is not None:
            # activation checkpointing: the forward cache buffers of another layer of the
            # same shape (the model recomputes this layer's forward before its backward)
            for name in self.CACHE + (self.SHARED_F16 if f16 is not None else ()):
                setattr(self, name, getattr(cache_of, name))
            return
        mk = g.buffer
        if f16 is not None:
            # f32 xn and the row-major f16 copies of xn and gated live only until the
            # forward's products have read them, the f32 Y, u, delta_pre and y until the
            # layer's forward (or, restored, its backward) is done: one buffer each for
            # every layer. The cache holds the transposed f16 copies of xn and gated, which
            # the backward's dW products read, and f16 copies of Y and y. gated itself is
            # never f32 (gate_forward_f16 writes its f16 copies).
            sc = g.scratch
            self.xn = sc("amp_xn", M * Dm)               # (M, Dm) RMSNorm output
            self.xn16 = sc("amp_xn_f16", M * Dm // 2)    # (M, Dm) f16, 2 per word
            self.gated16 = sc("amp_gated_f16", M * D // 2)   # (M, D) f16
            self.Y = sc("amp_Y", M * 2 * D)              # (M, 2D)
            self.u = sc("amp_u", M * D)                  # (M, D)
            self.delta_pre = sc("amp_delta_pre", M * D)  # (M, D)
            self.y = sc("amp_y", M * D)                  # (M, D)
            self.xn16_t = mk(M * Dm // 2, "xn_f16_t")    # (Dm, M) f16
            self.gated16_t = mk(M * D // 2, "gated_f16_t")   # (D, M) f16
            self.Y16 = mk(M * D, "Y_f16")                # (M, 2D) f16
            self.y16 = mk(M * D // 2, "y_f16")           # (M, D) f16
        else:
            self.xn = mk(M * Dm, "xn")                   # (M, Dm) RMSNorm output
            self.gated = mk(M * D, "gated")              # (M, D)
            self.Y = mk(M * 2 * D, "Y")                  # (M, 2D) in_proj output [xc | z]
            self.u = mk(M * D, "u")                      # (M, D) SiLU(conv), the scan input
            self.delta_pre = mk(M * D, "delta_pre")      # (M, D) dt_proj output + bias
            self.y = mk(M * D, "y")                      # (M, D) scan output before the gate
        self.rstd = mk(M, "rstd")                    # (M,)
        self.xproj = mk(M * P, "xproj")              # (M, P) [dt_low | Bs | Cs]
        n = 1 if self.s.C == 1 else self.s.chunk_elems     # one chunk: none is used
        # (B, C, D, N) chunk end states from zero: used within the forward only, so one
        # device scratch serves every layer (and the backward's gchunk)
        self.hchunk = g.scratch("scan_chunk", n)
        self.achunk = mk(n, "scan_achunk")           # (B, C, D, N) chunk decay products
        self.hstate = mk(n, "scan_hstate")           # (B, C, D, N) state entering each chunk

    def forward_ops(self):
        """Ops of the forward: the cache, then out = x + out_proj(gated)."""
        return self.cache_ops() + self._out_ops

    def cache_ops(self):
        """The forward's ops up to the gate: everything the backward reads (run again
        before the backward under activation checkpointing), not ``out``."""
        if self._fwd is None:
            g, d, o, M, L, w = self.g, self.d, self.o, self.M, self.L, self.w
            D, P, R, Dm = d.D, d.P, d.R, d.Dm
            if self.f16 is None:
                # in_proj: Y (M, 2D) = xn @ wInProj^T + bInProj
                in_proj = linear_forward(g, M, Dm, 2 * D, self.xn, 0, Dm, w, o["wInProj"],
                                         o["bInProj"], self.Y, 0, 2 * D)
            else:
                wh, ho = self.f16
                in_proj = [lf.pack_pair(g, self.xn16, self.xn16_t, self.xn, M, Dm),
                           *lf.forward(g, self.Y, self.xn16, wh, M, Dm, 2 * D,
                                       wt_off=ho["wInProj.T"], bias=(w, o["bInProj"]))]
            # u = SiLU(conv(xc)); dt_proj: delta_pre (M, D) = dt_low @ wDtProj^T + bDtProj
            # (the scan kernels take delta = softplus(delta_pre) where they read it). dt_proj's
            # ops are kept: the f16 mode's backward runs them again, and the conv from the
            # f16 Y, to restore delta_pre and u
            if self.narrow16:
                x_proj, self._dt_proj_ops = self._narrow_forward_ops()
            else:
                self._dt_proj_ops = linear_forward(g, M, R, D, self.xproj, 0, P, w, o["wDtProj"],
                                                   o["bDtProj"], self.delta_pre, 0, D)
                # x_proj: xproj (M, P) = u @ wXProj^T + bXProj (split-K partials in y,
                # which the scan writes later)
                x_proj = linear_forward(g, M, D, P, self.u, 0, D, w, o["wXProj"], o["bXProj"],
                                        self.xproj, 0, P, part=self.y)
            self._fwd = [
                rmsnorm_forward(g, M, Dm, self.x, w, o["normWeight"], self.xn, self.rstd, self.eps),
                *in_proj,
                conv1d_forward(g, M, L, D, d.K, self.Y, w, o, self.u,
                               u16=self.gated16 if self.narrow16 else None),
                *x_proj,
                *self._dt_proj_ops,
                *_scan.scan_forward(g, self.s, self.xproj, self.u, self.delta_pre, w, o,
                                    self.hchunk, self.achunk, self.hstate, self.y),
            ]
            if self.f16 is None:
                self._fwd.append(gate_forward(g, M, D, self.y, self.Y, self.gated))
                # out = x + gated @ wOutProj^T + bOutProj (residual added in the store)
                self._out_ops = linear_forward(g, M, D, Dm, self.gated, 0, D, w, o["wOutProj"],
                                               o["bOutProj"], self.out, 0, Dm, res=self.x)
            else:
                wh, ho = self.f16
                # the gate, its f16 copies (out_proj's operands) and the f16 cache of y and
                # Y, in one pass
                self._fwd.append(gate_forward_f16(g, M, D, self.y, self.Y, self.y16, self.Y16,
                                                  self.gated16, self.gated16_t))
                # (out = bias + x filled first: the products cannot start from two terms)
                self._out_ops = [*bias_fill(g, M, Dm, w, o["bOutProj"], self.out, 0, Dm, res=self.x),
                                 *lf.forward(g, self.out, self.gated16, wh, M, D, Dm,
                                             accumulate=True, wt_off=ho["wOutProj.T"])]
        return self._fwd

    def _narrow_forward_ops(self):
        """x_proj's and dt_proj's forward on tensor cores (f16 mode, narrow16): ([ops of
        x_proj], [ops of dt_proj]). Their operands are padded to whole tiles with zeros:
        x_proj's 80 (P) outputs to 128 (its f16 weight's rows), dt_proj's 48 (R) inputs to
        64 (dt_low's f16 copy, rows padded(R) apart, and its weight's columns)."""
        g, d, o, M, w = self.g, self.d, self.o, self.M, self.w
        D, P, R = d.D, d.P, d.R
        wh, ho = self.f16
        Rp = lf.padded(R)
        # u (M, D) in f16: the gated16 scratch, free until this layer's gate, written by
        # the conv (cache_ops)
        x_proj = lf.narrow_forward(g, self.xproj, None, self.gated16, wh, M, D, P,
                                   w_off=ho["wXProj"], bias=(w, o["bXProj"]))
        # dt_low (M, R) in f16, rows Rp apart; the contraction R rounded up to BK
        xlow16 = g.scratch("amp_xlow_f16", M * Rp // 2)
        dt_proj = [lf.pack(g, xlow16, self.xproj, M, R, src_rs=P, dst_cols=Rp),
                   lf.product(g, self.delta_pre, xlow16, wh, M, D, -(-R // lf.BK) * lf.BK,
                              a_kmajor=True, b_kmajor=True, lda=Rp, ldb=Rp, ldc=D,
                              b_off=ho["wDtProj"], bias=(w, o["bDtProj"]))]
        self._xlow16 = xlow16
        return x_proj, dt_proj

    def _narrow_backward_ops(self, sc):
        """dt_proj's and x_proj's backward on tensor cores (f16 mode, narrow16), after the
        scan's: dxproj[:, 0:R] = ddelta_pre @ wDtProj, dW and db of dt_proj; du +=
        dxproj @ wXProj, dW and db of x_proj. The scratch narrow16 and narrow16_t hold
        ddelta_pre's f16 copies; u16_t holds u's transpose (x_proj's weight-gradient
        operand), written by the restoring conv of backward_ops."""
        g, d, o, M, gr = self.g, self.d, self.o, self.M, self.gr
        D, P, R = d.D, d.P, d.R
        wh, ho = self.f16
        Rp = lf.padded(R)
        dxproj16 = g.scratch("amp_dxproj_f16", M * lf.padded(P) // 2)   # (M, padded(P)) f16
        return [
            *lf.pack_pair_bias(g, sc.narrow16, sc.narrow16_t, sc.ddelta_pre, M, D, gr,
                               o["bDtProj"]),
            lf.product(g, sc.dxproj, sc.narrow16, wh, M, Rp, D, a_kmajor=True, b_kmajor=False,
                       lda=D, ldb=Rp, ldc=P, b_off=ho["wDtProj"], n_valid=R),
            *lf.weight_product(g, gr, o["wDtProj"], D, Rp, M, sc.narrow16_t, self._xlow16,
                               b_kmajor=False, ldb=Rp, n_valid=R),
            *lf.narrow_backward(g, sc.du, sc.dxproj, self.u, wh, gr, M, D, P,
                                w_off=ho["wXProj"], dw_off=o["wXProj"], db_off=o["bXProj"],
                                dy16=dxproj16, x16_t=sc.u16_t, x16_t_written=True,
                                accumulate_dx=True),
        ]

    def backward_ops(self, dout, dx, sc: BlockScratch):
        """Ops for dx = dLoss/dx and gradient arena += dLoss/dparams, from dout."""
        g, d, o, M, L, w, gr = self.g, self.d, self.o, self.M, self.L, self.w, self.gr
        D, P, R, Dm = d.D, d.P, d.R, d.Dm
        restore = []
        # the gate's and the conv's backward read Y and y: f32, or the f16 mode's cache
        half = self.f16 is not None
        y, Y = (self.y16, self.Y16) if half else (self.y, self.Y)
        if self.f16 is None:
            # out_proj: dgated = dout @ wOutProj; dW += dout^T gated; db += colsum(dout)
            out_proj = linear_backward(g, M, D, Dm, dout, 0, Dm, self.gated, 0, D, w,
                                       o["wOutProj"], o["bOutProj"], gr, dx=sc.dgated, dx_rs=D,
                                       part=sc.dy)
            # in_proj: dxn = dY @ wInProj; dW += dY^T xn; db += colsum(dY)
            in_proj = linear_backward(g, M, Dm, 2 * D, sc.dY, 0, 2 * D, self.xn, 0, Dm, w,
                                      o["wInProj"], o["bInProj"], gr, dx=sc.dxn, dx_rs=Dm,
                                      part=sc.du)
        else:       # the same with f16 operands; out_proj's bias gradient from the f32 dout
            # (read once, by the pack), in_proj's from the gate's and the conv's backward,
            # which write its dY in f16 (dY16) and sum the f32 values per column
            wh, ho = self.f16
            out_proj = [*lf.pack_pair_bias(g, sc.dout16, None, dout, M, Dm, gr, o["bOutProj"]),
                        *lf.dinput(g, sc.dgated, sc.dout16, wh, M, D, Dm, accumulate=False,
                                   w_off=ho["wOutProj"]),
                        *lf.dweight(g, gr, self.gated16_t, sc.dout16, M, D, Dm,
                                    dw_off=o["wOutProj"])]
            in_proj = [*lf.dinput(g, sc.dxn, sc.dY16, wh, M, Dm, 2 * D, accumulate=False,
                                  w_off=ho["wInProj"]),
                       *lf.dweight(g, gr, self.xn16_t, sc.dY16, M, Dm, 2 * D,
                                   dw_off=o["wInProj"])]
            # u and delta_pre, which the cache does not hold: the conv again from the f16 Y,
            # dt_proj's ops again
            self.cache_ops()
            restore = [conv1d_forward(g, M, L, D, d.K, self.Y16, w, o, self.u, half=True,
                                      u16_t=sc.u16_t if self.narrow16 else None),
                       *self._dt_proj_ops]
        if self.narrow16:
            narrow = self._narrow_backward_ops(sc)
        else:
            narrow = [
                # dt_proj: dxproj[:, 0:R] = ddelta_pre @ wDtProj; dW += ddelta_pre^T dt_low; db
                *linear_backward(g, M, R, D, sc.ddelta_pre, 0, D, self.xproj, 0, P, w,
                                 o["wDtProj"], o["bDtProj"], gr, dx=sc.dxproj, dx_rs=P,
                                 part=sc.dy),
                # x_proj: du += dxproj @ wXProj; dW += dxproj^T u; db += colsum(dxproj)
                *linear_backward(g, M, D, P, sc.dxproj, 0, P, self.u, 0, D, w, o["wXProj"],
                                 o["bXProj"], gr, dx=sc.du, dx_rs=D, dx_beta=1, part=sc.dy),
            ]
        return [
            *out_proj,
            *restore,
            *([gate_backward(g, M, D, sc.dgated, y, Y, sc.dy, sc.dY)] if not half else
              gate_backward_f16(g, M, D, sc.dgated, y, Y, sc.dy, sc.dY16, gr, o["bInProj"])),
            *_scan.scan_backward(g, self.s, sc.scan, self.xproj, self.u, self.delta_pre, w, o,
                                 sc.dy, self.hstate, self.achunk, sc.du, sc.ddelta_pre,
                                 sc.dxproj, gr),
            *narrow,
            # conv + SiLU: dY[:, 0:D]; dwConv, dbConv
            *conv1d_backward(g, M, L, D, d.K, sc.du, w, o, sc.dY16 if half else sc.dY, Y, gr,
                             half=half, out16=half),
            *in_proj,
            # RMSNorm + residual: dx = dout + norm backward; dnormWeight = colsum(gw)
            *rmsnorm_backward(g, M, Dm, self.x, w, o["normWeight"], sc.dxn, self.rstd, dx, sc.gw,
                              gr, self.eps, dres=dout),
        ]

    def buffers(self):
        """The forward cache buffers (for memory accounting)."""
        return [getattr(self, name) for name in self.CACHE]


class BlockPlan:
    """Buffers and recorded ops of one block for one (dims, B, L, eps, disc, scan
    layout_key()). ``f16``: the linear layers on tensor cores (x_proj and dt_proj where
    they fit, block.narrow_f16_unsupported), from f16 copies of their weights made at the
    start of the forward (BlockLayer's f16 mode; the bench's mixed-precision block)."""

    def __init__(self, dims, B, L, eps, discretization, layout, f16=False):
        g = gpu()
        self.key = (dims, B, L, eps, discretization, layout)
        chunk = layout[0]
        self.offs, n = block_arena(dims)
        M = B * L
        self.w = g.buffer(n, "params")
        half = half_weights(g, self.w, self.offs, block_param_shapes(dims)) if f16 else None
        self.gr = g.buffer(n, "grads")
        self.x = g.buffer(M * dims.Dm, "x")          # (M, Dm)
        self.out = g.buffer(M * dims.Dm, "out")      # (M, Dm)
        self.dout = g.buffer(M * dims.Dm, "dout")    # (M, Dm)
        self.dx = g.buffer(M * dims.Dm, "dx")        # (M, Dm)
        self.layer = BlockLayer(g, dims, B, L, self.w, self.gr, self.offs, self.x, self.out,
                                eps, discretization, chunk,
                                f16=None if half is None else (half.buf, half.offs))
        self.scratch = BlockScratch(g, dims, self.layer.s, f16=f16, narrow16=self.layer.narrow16)
        self.fwd = ([] if half is None else half.ops) + self.layer.forward_ops()
        self.bwd = self.layer.backward_ops(self.dout, self.dx, self.scratch)
        self.n = n

    def upload_params(self, arrays):
        gpu().write(self.w, np.concatenate([arrays[k].ravel() for k in BLOCK_PARAM_NAMES]))


def _acquire(key):
    free = _POOL.get(key)
    if free:
        return free.pop()
    return BlockPlan(*key)


def _release(plan):
    free = _POOL.setdefault(plan.key, [])
    if len(free) < _POOL_MAX:
        free.append(plan)


class GpuBlockCache:
    """What the GPU forward keeps for the backward: the plan whose buffers hold
    this forward's activations (on the GPU), the shape of ``x``, eps,
    discretization and the fingerprint of the parameters (the CPU cache's rule:
    the backward refuses other parameter values). Read-only: no attribute can be set."""

    def __init__(self, plan, shape, dims, eps, discretization, fingerprint):
        init = super().__setattr__
        init("plan", plan)
        init("shape", tuple(shape))
        init("dims", dims)
        init("eps", eps)
        init("discretization", discretization)
        init("fingerprint", fingerprint)
        init("_finalizer", None if plan is None else weakref.finalize(self, _release, plan))

    def __setattr__(self, name, value):
        raise AttributeError(f"GpuBlockCache is read-only: {name!r} cannot be set (run "
                             f"mamba1_forward again for another cache)")

    @property
    def nbytes(self):
        return 0 if self.plan is None else sum(b.size for b in self.plan.layer.buffers())


def mamba1_forward(x, params, *, eps=DEFAULT_EPS, discretization="zoh"):
    """Block forward on the GPU: ``out`` (B, L, Dm) float32 and a GPU cache."""
    from ..block import fingerprint
    check_discretization(discretization)
    eps = check_eps(eps)
    xa, arrays, dims = validate_block(x, params)
    B, L, _ = xa.shape
    fp = fingerprint(arrays)
    if B * L == 0:
        return xa.copy(), GpuBlockCache(None, xa.shape, dims, eps, discretization, fp)
    plan = _acquire((dims, B, L, eps, discretization, _scan.layout_key()))
    g = gpu()
    plan.upload_params(arrays)
    g.write(plan.x, xa)
    g.submit(plan.fwd)
    out = g.read(plan.out, xa.size).reshape(xa.shape)
    return out, GpuBlockCache(plan, xa.shape, dims, eps, discretization, fp)


def mamba1_backward(dout, params, cache):
    """Block backward on the GPU: ``(dx, grads)``; grads keyed like ``params``.
    ``params`` must be the values the forward used (ValueError otherwise)."""
    from ..block import fingerprint
    if not isinstance(cache, GpuBlockCache):
        raise TypeError(f"cache: expected the cache returned by mamba_ext.gpu.mamba1_forward, "
                        f"got {type(cache).__name__}")
    da, arrays, dims = validate_block(dout, params)
    if da.shape != cache.shape:
        raise ValueError(f"dout: expected shape {cache.shape} (the forward's x), got {da.shape}")
    if dims != cache.dims:
        raise ValueError(f"params: sizes {dims} differ from those of the forward that made "
                         f"the cache {cache.dims}")
    fp = fingerprint(arrays)
    if fp != cache.fingerprint:
        changed = [n for n, a, b in zip(BLOCK_PARAM_NAMES, fp, cache.fingerprint) if a != b]
        raise ValueError(f"params: values of {changed} differ from those the forward used; "
                         f"the cache is only valid with the same params")
    if cache.plan is None:
        return da.copy(), {k: np.zeros(s, np.float32) for k, s in block_param_shapes(dims).items()}
    plan = cache.plan
    g = gpu()
    plan.upload_params(arrays)
    g.write(plan.dout, da)
    g.submit(plan.bwd, clears=[plan.gr])
    dx = g.read(plan.dx, da.size).reshape(da.shape)
    flat = g.read(plan.gr, plan.n)
    shapes = block_param_shapes(dims)
    grads = {k: flat[plan.offs[k]:plan.offs[k] + a.size].reshape(shapes[k]).copy()
             for k, a in arrays.items()}
    return dx, grads
