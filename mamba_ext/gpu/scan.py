"""The selective scan on the GPU (kernels/scan.wgsl), the mirror of mamba_ext/cpu/scan.pyx.

Size letters: B batch, L seqLen, D dInner, N dState, R dtRank, P = R + 2N, M = B*L,
C = ceil(L / SCAN_CHUNK) chunks, G channel groups.
"""
from __future__ import annotations

import math

from ..constants import A_LOG_MAX, A_LOG_MIN
from .device import column_sum, elementwise

# Chunk length of the chunked scan: 64, as on the CPU (measured on an H200 at
# block d: chunk 16 / 32 / 64 -> scan kernels 11.4 / 10.7 / 10.5 ms,
# docs/gpu_h200.txt). At most 64: scan_backward_grads keeps the states of one
# chunk in a private array of TMAX = 64 floats (kernels/scan.wgsl).
SCAN_CHUNK = 64
SCAN_CHUNK_MAX = 64
# Steps per block of scan_backward_grads (4 arrays of TB x SROW floats in workgroup
# memory) and of scan_forward_output (1 array; None = as many as fit in 8 KiB).
# Small blocks measured fastest on an H200 (block d, chunk 32: backward TB 2 / 4
# with forward TB 4 -> scan kernels 10.7 / 13.8 ms; forward TB 4 / 8 / 15 ->
# 10.7 / 11.1 / 12.7 ms): less workgroup memory, more resident workgroups.
SCAN_TB_BACKWARD = 2
SCAN_TB_FORWARD = 4
# One workgroup walks all chunks of its channels (override SINGLE of
# kernels/scan.wgsl: 1 forward and 1 backward scan pass instead of 3 and 3, and no
# hchunk/gchunk/gcarry buffers) when B x D x N reaches SCAN_SINGLE_MIN
# invocations. None = never: on an H200 at block d (B x D x N = 196,608) its scan
# kernels measured 13.4 ms against 10.5 ms for the chunked layout (docs/gpu_h200.txt,
# run 4).
SCAN_SINGLE_MIN = None


def scan_constants(wg, tb):
    """Override constants of kernels/scan.wgsl: workgroup size, steps per block and
    the A_log clamp bounds (from mamba_ext.constants, the one source)."""
    return {"WG": wg, "TB": tb, "a_log_min": float(A_LOG_MIN), "a_log_max": float(A_LOG_MAX)}


class ScanShape:
    """Sizes and workgroup layout of one chunked scan."""

    def __init__(self, B, L, D, N, R, chunk, zoh):
        if not 1 <= chunk <= SCAN_CHUNK_MAX:
            raise ValueError(f"scan chunk length must be in [1, {SCAN_CHUNK_MAX}], got {chunk}")
        if N > 1024:
            raise ValueError(f"mamba_ext.gpu: dState {N} > 1024 (max_compute_invocations_per_"
                             f"workgroup of the scan kernels)")
        self.B, self.L, self.D, self.N, self.R, self.P = B, L, D, N, R, R + 2 * N
        self.M = B * L
        self.chunk = chunk
        self.C = max(math.ceil(L / chunk), 1)
        self.zoh = 1 if zoh else 0
        self.wg = max(128, N)                          # WG invocations = WG/N channels x N states
        self.G = math.ceil(D / (self.wg // N))
        self.chunk_elems = B * self.C * D * N          # size of a (B, C, D, N) chunk tensor
        self.single = SCAN_SINGLE_MIN is not None and B * D * N >= SCAN_SINGLE_MIN

    def params(self, alog_off, dvec_off):
        return [self.B, self.L, self.D, self.N, self.R, self.P, self.chunk, self.C, self.G,
                self.zoh, alog_off, dvec_off]


def _chunk_op(g, s, entry, params, buffers, single=False):
    """One workgroup per (channel group, chunk, batch row), or per (channel group,
    batch row) walking all chunks when ``single``."""
    # TB steps per block; every (TB, SROW) array of workgroup memory stays within
    # 2048 floats (8 KiB): more memory per workgroup means fewer resident
    # workgroups, and the scan is latency-bound.
    srow = (s.wg // s.N) * (s.N + 1)
    tb = SCAN_TB_BACKWARD if entry == "scan_backward_grads" else SCAN_TB_FORWARD
    tb = max(1, min(tb or 2048, 2048 // srow))
    consts = {**scan_constants(s.wg, tb), "SROW": srow}
    if entry in ("scan_forward_output", "scan_backward_grads"):
        consts["SINGLE"] = single
    return g.op("scan", entry, (s.G, 1 if single else s.C, s.B), params, buffers, consts)


def _flat_op(g, s, entry, n, params, buffers):
    return elementwise(g, "scan", entry, n, params, buffers, wg=128,
                       constants={"a_log_min": float(A_LOG_MIN), "a_log_max": float(A_LOG_MAX)})


def scan_forward(g, s, xproj, u, delta, w, o, hchunk, achunk, hstate, y):
    """Ops: y (M, D) = scan of u with delta, A (from A_log at ``o["A_log"]``), Bs, Cs
    (columns of xproj (M, P)) + D_vec u; hstate (B, C, D, N) = the state entering each
    chunk (kept for the backward); hchunk, achunk (B, C, D, N) are scratch."""
    prm = s.params(o["A_log"], o["D_vec"])
    out = _chunk_op(g, s, "scan_forward_output", prm, [xproj, u, delta, w, hstate, y, achunk],
                    single=s.single)
    if s.single:
        return [out]
    return [
        _chunk_op(g, s, "scan_forward_chunk", prm, [xproj, u, delta, w, hchunk, achunk]),
        _flat_op(g, s, "scan_forward_carry", s.B * s.D * s.N, prm, [hchunk, achunk, hstate]),
        out,
    ]


class ScanScratch:
    """Backward temporaries of one scan shape (shared by all layers of a model)."""

    def __init__(self, g, s: ScanShape):
        n = 1 if s.single else s.chunk_elems    # not used by the single-pass scan
        self.gchunk = g.buffer(n, "scan_gchunk")      # (B, C, D, N)
        self.gcarry = g.buffer(n, "scan_gcarry")      # (B, C, D, N)
        self.da_part = g.buffer(s.chunk_elems, "scan_da_part")    # (B, C, D, N)
        self.dbc_part = g.buffer(s.G * s.M * 2 * s.N, "scan_dbc_part")   # (G, M, 2N)


def scan_backward(g, s, sc: ScanScratch, xproj, u, delta, delta_pre, w, o, dy, hstate, achunk,
                  du, ddelta_pre, dxproj, gr):
    """Ops: du (M, D) = scan part of dLoss/du + D_vec dy; ddelta_pre (M, D) (softplus
    backward fused); dxproj[:, R:P] = dBs | dCs; gradient arena ``gr`` += dA_log, dD_vec."""
    prm = s.params(o["A_log"], o["D_vec"])
    carry = [] if s.single else [
        _chunk_op(g, s, "scan_backward_chunk", prm, [xproj, delta, w, dy, sc.gchunk]),
        _flat_op(g, s, "scan_backward_carry", s.B * s.D * s.N, prm, [sc.gchunk, achunk, sc.gcarry]),
    ]
    return [
        # dD_vec = colsum(dy * u)
        *column_sum(g, s.M, s.D, dy, 0, s.D, gr, o["D_vec"], b=u, b_rs=s.D),
        *carry,
        _chunk_op(g, s, "scan_backward_grads", prm,
                  [xproj, u, delta, delta_pre, w, dy, hstate, sc.gcarry, du, ddelta_pre,
                   sc.dbc_part, sc.da_part], single=s.single),
        _flat_op(g, s, "scan_backward_sum_bc", s.M * 2 * s.N, prm, [sc.dbc_part, dxproj]),
        _flat_op(g, s, "scan_backward_sum_a_log", s.D * s.N, prm, [sc.da_part, w, gr]),
    ]
