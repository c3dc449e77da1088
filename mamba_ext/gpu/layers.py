"""Dispatch plans of one Mamba-1 block on the GPU: buffers and recorded ops.

A :class:`BlockLayer` owns the forward cache of one block (every activation the
backward needs, plus the scan's chunk checkpoints) and records, once, the
dispatches of its forward and backward; running a step is then only encoding
the recorded ops (no bind group or pipeline is created per step).

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, M = B*L, nC = ceil(L / T) scan chunks of T steps, G scan
channel groups.
"""
from __future__ import annotations

import math
import os

from .._validate import BlockDims, block_param_shapes

# Scan chunk length T (<= 64, the private history array of scan_bwd_grads).
SCAN_CHUNK = int(os.environ.get("MAMBA_EXT_GPU_CHUNK", "32"))
GEMM_TILE = (64, 64)   # rows x columns of C per workgroup of kernels/linear.wgsl
SCAN_TB_BWD = int(os.environ.get("MAMBA_EXT_GPU_SCAN_TB_BWD", "4"))
EW_WG = 256        # elementwise kernels' workgroup size (override constant WG)


def gemm(g, M, N, K, a, a_off, a_rs, a_cs, b, b_off, b_rs, b_cs, c, c_off, c_rs,
         bias=None, bias_off=0, beta=0):
    """Op for C = beta*C + A @ B (+ bias); see kernels/linear.wgsl for the strides."""
    grid = (math.ceil(N / GEMM_TILE[1]), math.ceil(M / GEMM_TILE[0]), 1)
    return g.op("linear", "linear_gemm", grid,
                [M, N, K, a_off, a_rs, a_cs, b_off, b_rs, b_cs, c_off, c_rs, bias_off,
                 0 if bias is None else 1, beta],
                [a, b, a if bias is None else bias, c])


def elementwise(g, file, entry, n, params, buffers, wg=EW_WG):
    """Op with one invocation per element of an ``n``-element problem."""
    return g.op(file, entry, g.grid1d(math.ceil(n / wg), f"{file}.{entry}"), params, buffers,
                {"WG": wg})


def reduce_cols(g, M, C, a, a_off, a_rs, out, o_off, b=None, b_off=0, b_rs=0):
    """Op for out[o_off + j] += sum_r a[a_off + r*a_rs + j] (* b[b_off + r*b_rs + j])."""
    return g.op("reduce", "reduce_cols", g.grid1d(math.ceil(C / 32), "reduce_cols"),
                [M, C, a_off, a_rs, b_off, b_rs, o_off, 0 if b is None else 1],
                [a, a if b is None else b, out])


def copy_op(g, src, dst, n):
    return elementwise(g, "activations", "copy_f32", n, [n, 0, 0], [src, dst])


def arena_layout(names_shapes):
    """Offsets of tensors packed one after the other: ({name: offset}, total)."""
    offs, total = {}, 0
    for name, shape in names_shapes:
        offs[name] = total
        total += math.prod(shape)
    return offs, total


class Scratch:
    """Backward temporaries of one block shape, shared by all layers of a model."""

    def __init__(self, g, d: BlockDims, B, L, chunk):
        M, D, N, P = B * L, d.D, d.N, d.P
        nC = max(math.ceil(L / chunk), 1)
        self.wg_scan = max(128, N)
        self.G = math.ceil(D / (self.wg_scan // N))
        mk = lambda n, name: g.buffer(n, name)
        self.dgated, self.dy, self.du, self.dc, self.ddpre = (mk(M * D, s) for s in
                                                            ("dgated", "dy", "du", "dc", "ddpre"))
        self.dY = mk(M * 2 * D, "dY")
        self.dQ = mk(M * P, "dQ")
        self.wl = mk(B * nC * D * N, "scan_wl")
        self.kc = mk(B * nC * D * N, "scan_kc")
        self.pbc = mk(self.G * M * 2 * N, "scan_pbc")
        self.pa = mk(B * nC * D * N, "scan_pa")
        self.dxn = mk(M * d.Dm, "dxn")
        self.gw = mk(M * d.Dm, "rms_gw")


class BlockLayer:
    """Forward cache and recorded ops of one block.

    ``w``/``gr``: parameter / gradient arenas, ``offs``: block name -> offset in
    them. ``x``/``out``: (M, Dm) input and output buffers.
    """

    def __init__(self, g, d: BlockDims, B, L, w, gr, offs, x, out, scratch: Scratch,
                 eps=1e-6, discretization="zoh", chunk=None):
        self.g, self.d, self.B, self.L = g, d, B, L
        self.w, self.gr, self.o, self.x, self.out, self.s = w, gr, offs, x, out, scratch
        self.eps = float(eps)
        self.zoh = 1 if discretization == "zoh" else 0
        self.T = int(chunk or SCAN_CHUNK)
        if not 1 <= self.T <= 64:
            raise ValueError(f"scan chunk length must be in [1, 64], got {self.T}")
        M, D, N, P = B * L, d.D, d.N, d.P
        if N > 1024:
            raise ValueError(f"mamba_ext.gpu: dState {N} > 1024 (max_compute_invocations_per_"
                             f"workgroup of the scan kernels)")
        self.M, self.nC = M, max(math.ceil(L / self.T), 1)
        mk = lambda n, name: g.buffer(n, name)
        self.xn = mk(M * d.Dm, "xn")
        self.inv = mk(M, "inv")
        self.Y = mk(M * 2 * D, "Y")
        self.c = mk(M * D, "c")
        self.u = mk(M * D, "u")
        self.Q = mk(M * P, "Q")
        self.dpre = mk(M * D, "dpre")
        self.delta = mk(M * D, "delta")
        cn = B * self.nC * D * N
        self.hloc = mk(cn, "scan_hloc")
        self.pc = mk(cn, "scan_pc")
        self.hck = mk(cn, "scan_hck")
        self.y = mk(M * D, "y")
        self.gated = mk(M * D, "gated")
        self._fwd = None

    # ----------------------------------------------------------------- scan
    def _scan_params(self):
        d = self.d
        return [self.B, self.L, d.D, d.N, d.R, d.P, self.T, self.nC, self.s.G, self.zoh,
                self.o["A_log"], self.o["D_vec"]]

    def _scan_chunk_op(self, entry, buffers):
        grid = (self.s.G, self.nC, self.B)
        wg = self.s.wg_scan
        # TB steps per block: scan_fwd_out keeps one (TB, WG) array (2048
        # floats), scan_bwd_grads four, and is kept small there because
        # workgroup memory limits how many workgroups an SM holds (the scan
        # is latency-bound); measured on an H200, see the README.
        # 4 arrays of TB*(WG+1) floats stay within 32 KiB.
        tb = SCAN_TB_BWD if entry == "scan_bwd_grads" else 2048 // wg
        return self.g.op("scan", entry, grid, self._scan_params(), buffers,
                         {"WG": wg, "TB": max(1, min(tb, 2048 // (wg + 1)))})

    def _scan_flat_op(self, entry, n, buffers):
        return elementwise(self.g, "scan", entry, n, self._scan_params(), buffers, wg=128)

    # -------------------------------------------------------------- forward
    def forward_ops(self):
        if self._fwd is None:
            g, d, o, M = self.g, self.d, self.o, self.M
            D, P, R, Dm = d.D, d.P, d.R, d.Dm
            w = self.w
            self._fwd = [
                g.op("rmsnorm", "rmsnorm_forward", g.grid1d(M, "rmsnorm rows"),
                     [M, Dm, o["normWeight"], self.eps], [self.x, w, self.xn, self.inv]),
                # in_proj: Y (M, 2D) = xn @ wInProj^T + bInProj
                gemm(g, M, 2 * D, Dm, self.xn, 0, Dm, 1, w, o["wInProj"], 1, Dm,
                     self.Y, 0, 2 * D, bias=w, bias_off=o["bInProj"]),
                elementwise(g, "conv1d", "conv1d_forward", M * D,
                            [M, self.L, D, d.K, 2 * D, o["wConv"], o["bConv"]],
                            [self.Y, w, self.c, self.u]),
                # x_proj: Q (M, P) = u @ wXProj^T + bXProj
                gemm(g, M, P, D, self.u, 0, D, 1, w, o["wXProj"], 1, D,
                     self.Q, 0, P, bias=w, bias_off=o["bXProj"]),
                # dt_proj: dpre (M, D) = Q[:, 0:R] @ wDtProj^T + bDtProj
                gemm(g, M, D, R, self.Q, 0, P, 1, w, o["wDtProj"], 1, R,
                     self.dpre, 0, D, bias=w, bias_off=o["bDtProj"]),
                elementwise(g, "activations", "softplus_forward", M * D, [M * D, D, 0],
                            [self.dpre, self.delta]),
                self._scan_chunk_op("scan_fwd_local", [self.Q, self.u, self.delta, w,
                                                       self.hloc, self.pc]),
                self._scan_flat_op("scan_fwd_carry", self.B * D * d.N, [self.hloc, self.pc,
                                                                        self.hck]),
                self._scan_chunk_op("scan_fwd_out", [self.Q, self.u, self.delta, w, self.hck,
                                                     self.y]),
                elementwise(g, "activations", "gate_forward", M * D, [M * D, D, 2 * D],
                            [self.y, self.Y, self.gated]),
                # out = x + gated @ wOutProj^T + bOutProj (residual copied first)
                copy_op(g, self.x, self.out, M * Dm),
                gemm(g, M, Dm, D, self.gated, 0, D, 1, w, o["wOutProj"], 1, D,
                     self.out, 0, Dm, bias=w, bias_off=o["bOutProj"], beta=1),
            ]
        return self._fwd

    # ------------------------------------------------------------- backward
    def backward_ops(self, dout, dx):
        """Ops for dx = dLoss/dx and gradient arena += dLoss/dparams, from dout."""
        g, d, o, M, s, w, gr = self.g, self.d, self.o, self.M, self.s, self.w, self.gr
        D, P, R, Dm, N = d.D, d.P, d.R, d.Dm, d.N
        return [
            # out_proj: dgated = dout @ wOutProj; dW += dout^T gated; db += colsum(dout)
            gemm(g, M, D, Dm, dout, 0, Dm, 1, w, o["wOutProj"], D, 1, s.dgated, 0, D),
            gemm(g, Dm, D, M, dout, 0, 1, Dm, self.gated, 0, D, 1, gr, o["wOutProj"], D, beta=1),
            reduce_cols(g, M, Dm, dout, 0, Dm, gr, o["bOutProj"]),
            elementwise(g, "activations", "gate_backward", M * D, [M * D, D, 2 * D],
                        [s.dgated, self.y, self.Y, s.dy, s.dY]),
            # dD_vec = colsum(dy * u)
            reduce_cols(g, M, D, s.dy, 0, D, gr, o["D_vec"], b=self.u, b_rs=D),
            self._scan_chunk_op("scan_bwd_local", [self.Q, self.delta, w, s.dy, s.wl]),
            self._scan_flat_op("scan_bwd_carry", self.B * D * N, [s.wl, self.pc, s.kc]),
            self._scan_chunk_op("scan_bwd_grads", [self.Q, self.u, self.delta, self.dpre, w, s.dy,
                                                   self.hck, s.kc, s.du, s.ddpre, s.pbc, s.pa]),
            self._scan_flat_op("scan_reduce_bc", M * 2 * N, [s.pbc, s.dQ]),
            self._scan_flat_op("scan_reduce_da", D * N, [s.pa, w, gr]),
            # dt_proj: dQ[:, 0:R] = ddpre @ wDtProj; dW += ddpre^T Q[:, 0:R]; db += colsum
            gemm(g, M, R, D, s.ddpre, 0, D, 1, w, o["wDtProj"], R, 1, s.dQ, 0, P),
            gemm(g, D, R, M, s.ddpre, 0, 1, D, self.Q, 0, P, 1, gr, o["wDtProj"], R, beta=1),
            reduce_cols(g, M, D, s.ddpre, 0, D, gr, o["bDtProj"]),
            # x_proj: du += dQ @ wXProj; dW += dQ^T u; db += colsum(dQ)
            gemm(g, M, D, P, s.dQ, 0, P, 1, w, o["wXProj"], D, 1, s.du, 0, D, beta=1),
            gemm(g, P, D, M, s.dQ, 0, 1, P, self.u, 0, D, 1, gr, o["wXProj"], D, beta=1),
            reduce_cols(g, M, P, s.dQ, 0, P, gr, o["bXProj"]),
            # conv + SiLU: dc, dY[:, 0:D]; dwConv, dbConv
            elementwise(g, "conv1d", "conv1d_backward_input", M * D,
                        [M, self.L, D, d.K, 2 * D, o["wConv"], o["bConv"]],
                        [s.du, self.c, w, s.dc, s.dY]),
            g.op("conv1d", "conv1d_backward_weight", (math.ceil(D / 32), d.K + 1, 1),
                 [M, self.L, D, d.K, 2 * D, o["wConv"], o["bConv"]], [s.dc, self.Y, gr]),
            # in_proj: dxn = dY @ wInProj; dW += dY^T xn; db += colsum(dY)
            gemm(g, M, Dm, 2 * D, s.dY, 0, 2 * D, 1, w, o["wInProj"], Dm, 1, s.dxn, 0, Dm),
            gemm(g, 2 * D, Dm, M, s.dY, 0, 1, 2 * D, self.xn, 0, Dm, 1, gr, o["wInProj"], Dm, beta=1),
            reduce_cols(g, M, 2 * D, s.dY, 0, 2 * D, gr, o["bInProj"]),
            # RMSNorm + residual: dx = dout + norm backward; dnormWeight = colsum(gw)
            copy_op(g, dout, dx, M * Dm),
            g.op("rmsnorm", "rmsnorm_backward", g.grid1d(M, "rmsnorm rows"),
                 [M, Dm, o["normWeight"], self.eps], [self.x, w, s.dxn, self.inv, dx, s.gw]),
            reduce_cols(g, M, Dm, s.gw, 0, Dm, gr, o["normWeight"]),
        ]

    def buffers(self):
        """The forward cache buffers (for memory accounting)."""
        return [self.xn, self.inv, self.Y, self.c, self.u, self.Q, self.dpre, self.delta,
                self.hloc, self.pc, self.hck, self.y, self.gated]


def block_arena(d: BlockDims, prefix=""):
    """Arena layout of one block's 13 parameters: ({name: offset}, total)."""
    return arena_layout([(prefix + n, s) for n, s in block_param_shapes(d).items()])
