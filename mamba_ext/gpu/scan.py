"""The selective scan on the GPU (kernels/scan.wgsl), the mirror of mamba_ext/cpu/scan.pyx.

Size letters: B batch, L seqLen, D dInner, N dState, R dtRank, P = R + 2N, M = B*L,
C = ceil(L / SCAN_CHUNK) chunks, G channel groups.
"""
from __future__ import annotations

import math

from ..constants import A_LOG_MAX, A_LOG_MIN
from .device import column_sum, elementwise

# Chunk length of the chunked scan: 64, as on the CPU (kept for the backward
# kernel's checkpoints: at most CKMAX = 32 blocks of SCAN_TS_BACKWARD steps, so a
# shape may run with a shorter chunk, see ScanShape).
SCAN_CHUNK = 64
SCAN_CHUNK_MAX = 64
# Layout of the chunk kernels (kernels/scan.wgsl), tuned on an H200 at block d (the
# measurements: docs/performance.md, GPU tuning):
# invocations per workgroup (one per channel x state group of 16 states),
SCAN_WG = 64
# steps per staged block of Bs | Cs of the forward passes and scan_backward_chunk,
SCAN_TS_FORWARD = 8
# and of scan_backward_grads, whose block of recomputed states, exponentials and input
# factors stays in private arrays (3 x 16 floats per step; at most TSMAX = 8): blocks of 2
# fit NVIDIA's registers, blocks of 4 spill (docs/gpu.md, Kernels),
SCAN_TS_BACKWARD = 2
# steps per dBs/dCs reduction round of scan_backward_grads (divides SCAN_TS_BACKWARD;
# more steps per round take more workgroup memory, so fewer invocations are resident).
SCAN_RB = 1
# partial sums of dBs/dCs per workgroup of scan_backward_grads (override HS): 2 = every
# invocation of a 64-wide workgroup sums half of the channels of one column, where 1
# leaves half of them idle at each step's sums; dbc_part holds HS times more partials.
SCAN_SUM_PARTS = 2
# scan_backward_grads' dBs/dCs sums through subgroup shuffles (kernels/scan_sums_subgroup.wgsl)
# where subgroup_sums allows (an adapter that states its subgroup size: NVIDIA's, Apple's),
# else through workgroup memory (scan_sums_workgroup.wgsl; docs/gpu.md, Kernels).
SCAN_SUBGROUP_SUMS = True
SUBGROUP_SIZES = (8, 16, 32)     # the subgroup sizes scan_sums_subgroup.wgsl is written for
_TSMAX, _CKMAX, _RS, _BCMAX = 8, 32, 35, 32   # consts of kernels/scan.wgsl (RS: its sums')
# Workgroup memory the chunk kernels may use when the caller does not pass the
# device's limit: WebGPU's guaranteed minimum of max_compute_workgroup_storage_size.
WG_MEMORY_MIN = 16384


def layout_key():
    """The module settings a recorded plan depends on (part of the plan caches' keys)."""
    return (SCAN_CHUNK, SCAN_WG, SCAN_TS_FORWARD, SCAN_TS_BACKWARD, SCAN_RB, SCAN_SUM_PARTS,
            SCAN_SUBGROUP_SUMS)


def subgroup_sums(g, N) -> int:
    """The subgroup size SUB with which scan_backward_grads sums dBs/dCs through shuffles
    (kernels/scan_sums_subgroup.wgsl), or 0 for the sums through workgroup memory: where
    :data:`SCAN_SUBGROUP_SUMS`, the device has subgroups (``g.subgroup_directive``) of one
    size the adapter states (``g.subgroup_size``: NVIDIA's and Apple's 32; 0 where it may vary
    by kernel, as on AMD and Intel) in :data:`SUBGROUP_SIZES` that divides SCAN_WG, and
    N <= 16 (one state group per channel)."""
    sub = int(getattr(g, "subgroup_size", 0) or 0)
    ok = (SCAN_SUBGROUP_SUMS and getattr(g, "subgroup_directive", None) is not None
          and sub in SUBGROUP_SIZES and SCAN_WG % sub == 0 and N <= 16)
    return sub if ok else 0


def clamp_constants():
    """The override constants a_log_min, a_log_max of every kernel that computes A from
    A_log (scan.wgsl, recurrent.wgsl), from mamba_ext.constants, the one source."""
    return {"a_log_min": float(A_LOG_MIN), "a_log_max": float(A_LOG_MAX)}


def scan_constants(wg):
    """Override constants of kernels/scan.wgsl shared by every chunk entry: workgroup size
    and the A_log clamp bounds."""
    return {"WG": wg, **clamp_constants()}


class ScanShape:
    """Sizes and workgroup layout of one chunked scan (see kernels/scan.wgsl)."""

    def __init__(self, B, L, D, N, R, chunk, zoh, wg_memory=WG_MEMORY_MIN, sub=0):
        """``wg_memory``: bytes of workgroup memory the kernels may use (the device's
        max_compute_workgroup_storage_size); fewer steps per block where it is small.
        ``sub``: the subgroup size of scan_backward_grads' subgroup sums, 0 for its
        workgroup sums (:func:`subgroup_sums`)."""
        if not 1 <= chunk <= SCAN_CHUNK_MAX:
            raise ValueError(f"scan chunk length must be in [1, {SCAN_CHUNK_MAX}], got {chunk}")
        if sub and (sub not in SUBGROUP_SIZES or N > 16 or SCAN_WG % sub):
            raise ValueError(f"scan subgroup sums: subgroup size {sub} must be one of "
                             f"{SUBGROUP_SIZES} dividing SCAN_WG {SCAN_WG}, with dState {N} <= 16")
        self.sub = sub
        red = 0 if sub else _RS      # floats per invocation and step of the workgroup sums
        self.SG = math.ceil(N / 16)                     # state groups of 16 per channel
        self.NV = 4 if self.SG > 1 else math.ceil(N / 4)
        per_step = 32 * self.SG                         # floats of Bs | Cs staged per step
        # two staged blocks of Bs | Cs (+ extra floats) in the device's workgroup memory,
        # and a block within the BCMAX floats each invocation stages in registers
        fits = lambda ts, extra: (4 * (2 * ts * per_step + extra) <= wg_memory
                                  and ts * per_step <= _BCMAX * self.wg)
        self.cpw = max(1, SCAN_WG // self.SG)           # channels per workgroup: fewer where
        self.wg = self.cpw * self.SG                    # one step's sums would not fit
        while self.cpw > 1 and not fits(1, self.wg * red):
            self.cpw //= 2
            self.wg = self.cpw * self.SG
        # (at most TSMAX: scan_backward_chunk stages as many steps' inputs in private arrays)
        self.ts_f = max(1, min(SCAN_TS_FORWARD, _TSMAX))
        while self.ts_f > 1 and not fits(self.ts_f, self.ts_f * self.wg):
            self.ts_f //= 2
        self.ts_b = max(1, min(SCAN_TS_BACKWARD, _TSMAX))
        self.rb = max(1, min(SCAN_RB, self.ts_b))
        while not fits(self.ts_b, self.rb * self.wg * red):
            if self.rb > 1:
                self.rb //= 2
            elif self.ts_b > 1:
                self.ts_b //= 2
            else:
                raise ValueError(f"mamba_ext.gpu: dState {N} needs more than {wg_memory} bytes "
                                 f"of workgroup memory in the scan kernels")
        if self.ts_b % self.rb:
            self.rb = 1
        self.B, self.L, self.D, self.N, self.R, self.P = B, L, D, N, R, R + 2 * N
        self.M = B * L
        self.chunk = min(chunk, _CKMAX * self.ts_b)     # checkpoints of the backward kernel
        self.C = max(math.ceil(L / self.chunk), 1)
        self.zoh = 1 if zoh else 0
        self.G = math.ceil(D / self.cpw)
        # partials of dBs/dCs per workgroup: each sums cpw / hs channels (whole ones); one
        # per subgroup with the subgroup sums
        if sub:
            self.hs = self.wg // sub
        else:
            self.hs = SCAN_SUM_PARTS if self.cpw % SCAN_SUM_PARTS == 0 else 1
        self.parts = self.G * self.hs                   # dBs/dCs partials in dbc_part
        self.chunk_elems = B * self.C * D * N          # size of a (B, C, D, N) chunk tensor

    def params(self, alog_off, dvec_off):
        return [self.B, self.L, self.D, self.N, self.R, self.P, self.chunk, self.C, self.parts,
                self.zoh, alog_off, dvec_off]


# The buffers of kernels/scan.wgsl by binding, 1..17 (one name, one binding, in every
# entry point); an entry binds the ones it names.
_SLOTS = ("xproj", "u", "delta_pre", "w", "dy", "hchunk", "achunk", "hstate", "y", "gchunk",
          "gcarry", "da_part", "du", "ddelta_pre", "dbc_part", "dxproj", "grad")


def _bind(**named):
    return [named.get(k) for k in _SLOTS]


def _module(g, s):
    """(file, prelude) of the scan's kernels: kernels/scan.wgsl with scan_backward_grads'
    sums through subgroup shuffles (``s.sub``) or through workgroup memory, and the
    directive the backend's subgroup builtins need."""
    if not s.sub:
        return "scan_sums_workgroup", ""
    if getattr(g, "subgroup_directive", None) is None:
        raise ValueError("mamba_ext.gpu: scan subgroup sums on a device without subgroups")
    return "scan_sums_subgroup", g.subgroup_directive


def _chunk_op(g, s, entry, params, chunks=None, **named):
    """One workgroup per (channel group, chunk, batch row); ``chunks``: of the first
    ``chunks`` workgroups along y only (default all C)."""
    ts = s.ts_b if entry == "scan_backward_grads" else s.ts_f
    consts = {**scan_constants(s.wg), "SG": s.SG, "NV": s.NV, "TS": ts, "RB": s.rb}
    if entry == "scan_backward_grads":
        consts["HS"] = s.hs
        if s.sub:
            consts["SUB"] = s.sub
    file, prelude = _module(g, s)
    grid = (s.G, s.C if chunks is None else chunks, s.B)
    return g.op(file, entry, grid, params, _bind(**named), consts, prelude)


def _flat_op(g, s, entry, n, params, **named):
    file, prelude = _module(g, s)
    return elementwise(g, file, entry, n, params, _bind(**named), wg=128,
                       constants=clamp_constants(),
                       prelude=prelude)


def _columns_op(g, s, entry, n, params, **named):
    """32 of ``n`` columns per (32, 8) workgroup (scan_backward_sum_a_log)."""
    file, prelude = _module(g, s)
    return g.op(file, entry, g.grid1d(math.ceil(n / 32), f"{file}.{entry}"), params,
                _bind(**named), clamp_constants(), prelude)


def scan_forward(g, s, xproj, u, delta_pre, w, o, hchunk, achunk, hstate, y):
    """Ops: y (M, D) = scan of u with delta = softplus(delta_pre) (M, D), A (from A_log at
    ``o["A_log"]``), Bs, Cs (columns of xproj (M, P)) + D_vec u; hstate (B, C, D, N) = the state entering each
    chunk (kept for the backward); hchunk, achunk (B, C, D, N) are scratch (achunk is
    read by the backward). Every chunk from a zero state (its y, end state and decay
    product), the states entering the chunks, then y of chunks 1.. corrected by them
    (kernels/scan.wgsl). One chunk: the first pass alone."""
    prm = s.params(o["A_log"], o["D_vec"])
    ins = dict(xproj=xproj, u=u, delta_pre=delta_pre, w=w)
    first = _chunk_op(g, s, "scan_forward_chunk", prm, **ins, hchunk=hchunk, achunk=achunk, y=y)
    if s.C == 1:
        return [first]
    return [first,
            _flat_op(g, s, "scan_forward_carry", s.B * s.D * s.N, prm, hchunk=hchunk,
                     achunk=achunk, hstate=hstate),
            _chunk_op(g, s, "scan_forward_correct", prm, chunks=s.C - 1, **ins, hstate=hstate,
                      y=y)]


class ScanScratch:
    """Backward temporaries of one scan shape (shared by all layers of a model)."""

    def __init__(self, g, s: ScanShape):
        n = 1 if s.C == 1 else s.chunk_elems     # not used with one chunk
        self.gchunk = g.scratch("scan_chunk", n)     # (B, C, D, N), the forward's hchunk too
        self.gcarry = g.buffer(n, "scan_gcarry")      # (B, C, D, N)
        self.da_part = g.buffer(s.chunk_elems, "scan_da_part")    # (B, C, D, N)
        self.dbc_part = g.buffer(s.parts * s.M * 2 * s.N, "scan_dbc_part")   # (parts, M, 2N)


def scan_backward(g, s, sc: ScanScratch, xproj, u, delta_pre, w, o, dy, hstate, achunk,
                  du, ddelta_pre, dxproj, gr):
    """Ops: du (M, D) = scan part of dLoss/du + D_vec dy; ddelta_pre (M, D) (softplus
    backward fused); dxproj[:, R:P] = dBs | dCs; gradient arena ``gr`` += dA_log, dD_vec."""
    prm = s.params(o["A_log"], o["D_vec"])
    carry = [] if s.C == 1 else [
        _chunk_op(g, s, "scan_backward_chunk", prm, xproj=xproj, delta_pre=delta_pre, w=w, dy=dy,
                  gchunk=sc.gchunk),
        _flat_op(g, s, "scan_backward_carry", s.B * s.D * s.N, prm, gchunk=sc.gchunk,
                 achunk=achunk, gcarry=sc.gcarry),
    ]
    return [
        # dD_vec = colsum(dy * u)
        *column_sum(g, s.M, s.D, dy, 0, s.D, gr, o["D_vec"], b=u, b_rs=s.D),
        *carry,
        _chunk_op(g, s, "scan_backward_grads", prm, xproj=xproj, u=u, delta_pre=delta_pre, w=w,
                  dy=dy, hstate=hstate, gcarry=sc.gcarry, da_part=sc.da_part, du=du,
                  ddelta_pre=ddelta_pre, dbc_part=sc.dbc_part),
        _flat_op(g, s, "scan_backward_sum_bc", s.M * 2 * s.N, prm, dbc_part=sc.dbc_part,
                 dxproj=dxproj),
        _columns_op(g, s, "scan_backward_sum_a_log", s.D * s.N, prm, da_part=sc.da_part, w=w,
                    grad=gr),
    ]
