# cython: language_level=3
"""One Mamba-1 block, forward and backward on raw pointers (contract: block.pxd).

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
P = R + 2N, M = B*L rows, T = SCAN_CHUNK, C = ceil(L / T) scan chunks.

Design: the block is a composition of the step kernels (rmsnorm, linear = BLAS,
conv1d, the elementwise steps of csrc/mx_activations.h, scan), each called once over
all M rows; this file only lays out the cache and the scratch and chains the steps.
The forward keeps what the backward cannot cheaply recompute (the cache below; never a
(B, L, D, N) tensor); the backward recomputes the rest from it, step by step in reverse.

Forward (docs/semantics.md):
  xn = RMSNorm(x) ; xz = xn @ wInProj^T + b = [xc | z] ; conv = conv1d(xc) ; u = silu(conv)
  xproj = u @ wXProj^T + b = [dt_low | Bs | Cs] ; delta_pre = dt_low @ wDtProj^T + b
  delta = softplus(delta_pre) ; y = scan(u, delta, A, Bs, Cs) + D_vec*u
  gated = y * silu(z) ; out = gated @ wOutProj^T + b + x

Cache layout (`floating` elements, in this order; block_cache_len is the total):
  x      (M, Dm)          block input (the backward gets no x)
  rstd   (M,)             RMSNorm 1/sqrt(mean(x^2) + eps)
  xz     (M, 2D)          in_proj output [xc | z]
  xproj  (M, P)           x_proj output [dt_low | Bs | Cs]
  delta  (M, D)           softplus(delta_pre); softplus' = -expm1(-delta) is recovered from it
  y      (M, D)           scan output incl. the D_vec skip, before the gate
  hstate (B, C, D, N)     scan state entering each chunk of T steps
  total = M*(Dm + 1 + 4D + P) + B*C*D*N
Recomputed in the backward: xn (from x, rstd), conv and u (conv1d of xc), the gate,
and the scan states inside each chunk.
State passing (block_forward_state / block_backward_state): h0 enters the scan (and is
the cache's hstate of chunk 0); conv_state (B, D, K-1) is xc of the K-1 steps before x,
added to the first K-1 conv outputs (conv_history_*); conv_tail copies xc of the last
K-1 steps. The caller keeps conv_state for the backward (the cache layout is unchanged).
Scratch (forward M*(Dm + D + R), backward M*(7D + P + 2R + 2Dm) values) is kept by
each calling thread and reused by its next call (mx_workspace, csrc/mx_threads.h).
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from cython.parallel cimport prange
cimport numpy as cnp
from cpython.ref cimport Py_INCREF
import numpy as np

from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu cimport constants
from mamba_ext.cpu.activations cimport (
    mx_silu_forward_f, mx_silu_forward_d, mx_softplus_forward_f, mx_softplus_forward_d,
    mx_gate_forward_f, mx_gate_forward_d, mx_gate_backward_f, mx_gate_backward_d,
    mx_silu_backward_f, mx_silu_backward_d, mx_softplus_backward_f, mx_softplus_backward_d,
    mx_add_f, mx_add_d)
from mamba_ext.cpu.linear cimport linear_forward, linear_backward, linear_backward_set
from mamba_ext.cpu.rmsnorm cimport rmsnorm_forward, rmsnorm_backward
from mamba_ext.cpu.conv1d cimport conv1d_forward, conv1d_backward_set
from mamba_ext.cpu.scan cimport scan_forward_state, scan_backward_state_set, scan_nchunks
from mamba_ext.cpu.threads cimport mx_aligned_alloc, mx_aligned_free, mx_threads, mx_team, mx_workspace

cnp.import_array()

cdef extern from "csrc/mx_hash.h" nogil:
    uint64_t mx_hash64(const void* p, size_t n, uint64_t seed) noexcept

# The constants of the maths (single definition: csrc/mx_constants.h).
A_LOG_MIN = constants.A_LOG_MIN
A_LOG_MAX = constants.A_LOG_MAX
DEFAULT_EPS = constants.DEFAULT_EPS
SCAN_CHUNK = constants.SCAN_CHUNK

cdef enum:
    # bytes per block of hash_bytes
    HASH_BLOCK = 1 << 20
    # elements of an elementwise step per thread (mx_team): 2^15 take ~5-10 us on one core
    MIN_ELEMENTS_PER_THREAD = 1 << 15
    # values per piece of flat_op (a multiple of 16: pieces start on 64-byte boundaries)
    FLAT_PIECE = 1 << 14

# bytes of backward scratch per window (window_rows); tests lower it (_set_window_bytes)
cdef size_t window_bytes = 256 << 20


def _set_window_bytes(size_t n):
    """Testing hook: the window's scratch budget in bytes (0: the default); returns the
    previous value. Not thread-safe: for tests only."""
    global window_bytes
    cdef size_t old = window_bytes
    window_bytes = n if n > 0 else (256 << 20)
    return old


ctypedef struct cache_layout:
    idx_t x, rstd, xz, xproj, delta, y, hstate, total


cdef inline cache_layout layout(const mamba_dims* d) noexcept nogil:
    cdef cache_layout c
    cdef idx_t M = d.B * d.L, P = d.R + 2 * d.N
    c.x = 0
    c.rstd = c.x + M * d.Dm
    c.xz = c.rstd + M
    c.xproj = c.xz + M * 2 * d.D
    c.delta = c.xproj + M * P
    c.y = c.delta + M * d.D
    c.hstate = c.y + M * d.D
    c.total = c.hstate + d.B * scan_nchunks(d.L) * d.D * d.N
    return c


cdef idx_t block_cache_len(const mamba_dims* d) noexcept nogil:
    return layout(d).total


cdef idx_t block_param_len(const mamba_dims* d, int j) noexcept nogil:
    cdef idx_t D = d.D, P = d.R + 2 * d.N
    if j == P_wInProj:
        return 2 * D * d.Dm
    if j == P_bInProj:
        return 2 * D
    if j == P_wConv:
        return D * d.K
    if j == P_wXProj:
        return P * D
    if j == P_bXProj:
        return P
    if j == P_wDtProj:
        return D * d.R
    if j == P_A_log:
        return D * d.N
    if j == P_wOutProj:
        return d.Dm * D
    if j == P_bOutProj or j == P_normWeight:
        return d.Dm
    return D                   # P_bConv, P_bDtProj, P_D_vec


# Elementwise steps, parallel over rows; each row is one call of a vectorised C
# kernel of csrc/mx_activations.h (runtime-dispatched AVX-512/AVX2 clones where built).
# op: 0 silu(a) -> out; 1 softplus in place; 2 gate out = y * silu(z);
#     3 out *= silu'(a); 4 out *= softplus'(from softplus output a)
# a, out (M, D) rows D apart, except z: rows lda apart (the z half of xz (M, 2D)).
cdef void rows_elementwise(int op, floating* out, const floating* a, idx_t lda,
                           const floating* y, idx_t M, idx_t D, int nt) noexcept nogil:
    cdef idx_t r
    nt = mx_team(nt, M * D, MIN_ELEMENTS_PER_THREAD, M)
    for r in prange(M, schedule='static', num_threads=nt):
        if floating is float:
            if op == 0:
                mx_silu_forward_f(out + r * D, a + r * lda, D)
            elif op == 1:
                mx_softplus_forward_f(out + r * D, D)
            elif op == 2:
                mx_gate_forward_f(out + r * D, y + r * D, a + r * lda, D)
            elif op == 3:
                mx_silu_backward_f(out + r * D, a + r * lda, D)
            else:
                mx_softplus_backward_f(out + r * D, a + r * lda, D)
        else:
            if op == 0:
                mx_silu_forward_d(out + r * D, a + r * lda, D)
            elif op == 1:
                mx_softplus_forward_d(out + r * D, D)
            elif op == 2:
                mx_gate_forward_d(out + r * D, y + r * D, a + r * lda, D)
            elif op == 3:
                mx_silu_backward_d(out + r * D, a + r * lda, D)
            else:
                mx_softplus_backward_d(out + r * D, a + r * lda, D)


cdef void gate_backward(floating* dy, floating* dz, idx_t ldz, const floating* dg,
                        const floating* y, const floating* z, idx_t M, idx_t D,
                        int nt) noexcept nogil:
    # dy (M, D) = dg * silu(z); dz (rows ldz apart) = dg * y * silu'(z); z rows ldz apart
    cdef idx_t r
    nt = mx_team(nt, M * D, MIN_ELEMENTS_PER_THREAD, M)
    for r in prange(M, schedule='static', num_threads=nt):
        if floating is float:
            mx_gate_backward_f(dy + r * D, dz + r * ldz, dg + r * D, y + r * D, z + r * ldz, D)
        else:
            mx_gate_backward_d(dy + r * D, dz + r * ldz, dg + r * D, y + r * D, z + r * ldz, D)


cdef void flat_op(int op, floating* out, const floating* a, idx_t n, int nt) noexcept nogil:
    # out (n,) = 0 (op FLAT_ZERO), = a (FLAT_COPY) or += a (FLAT_ADD), in parallel pieces:
    # the zeroing, copies and residual adds between the block's steps, which one thread
    # alone would do while the others wait
    cdef idx_t c, lo, npiece = (n + FLAT_PIECE - 1) // FLAT_PIECE
    nt = mx_team(nt, n, 4 * MIN_ELEMENTS_PER_THREAD, npiece)
    for c in prange(npiece, schedule='static', num_threads=nt):
        lo = c * FLAT_PIECE
        if op == FLAT_ZERO:
            memset(out + lo, 0, min(<idx_t>FLAT_PIECE, n - lo) * sizeof(floating))
        elif op == FLAT_COPY:
            memcpy(out + lo, a + lo, min(<idx_t>FLAT_PIECE, n - lo) * sizeof(floating))
        elif floating is float:
            mx_add_f(out + lo, a + lo, min(<idx_t>FLAT_PIECE, n - lo))
        else:
            mx_add_d(out + lo, a + lo, min(<idx_t>FLAT_PIECE, n - lo))


cdef void copy_cols(floating* dst, const floating* src, idx_t M, idx_t ncol,
                    idx_t ld_src, int nt) noexcept nogil:
    # dst (M, ncol) = src[:, 0:ncol] of rows ld_src apart
    cdef idx_t r
    nt = mx_team(nt, M * ncol, MIN_ELEMENTS_PER_THREAD, M)
    for r in prange(M, schedule='static', num_threads=nt):
        memcpy(dst + r * ncol, src + r * ld_src, ncol * sizeof(floating))


# Conv history (state passing): the K-1 steps before x, cs (B, D, K-1) oldest first,
# i.e. cs[b, d, K-1+s] is xc of step s < 0. Only the first K-1 outputs see it; the work
# is B*D*K^2/2 multiply-adds, so plain loops.
cdef void conv_history_forward(floating* c, const floating* w, const floating* cs,
                               idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # c (B, L, D) += w[d, k] * xc[t-k] for the taps k > t that reach before step 0
    cdef idx_t b, t, k, j
    for b in range(B):
        for t in range(min(K - 1, L)):
            for k in range(t + 1, K):
                for j in range(D):
                    c[(b * L + t) * D + j] += w[j * K + k] * cs[(b * D + j) * (K - 1) + K - 1 + t - k]


cdef void conv_history_backward(floating* dcs, floating* dw, const floating* dc,
                                const floating* w, const floating* cs,
                                idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # VJP of conv_history_forward: dcs (B, D, K-1) += dc w (dcs NULL: not wanted),
    # dw (D, K) += dc cs (cs NULL: zero history, nothing to add); dc (B, L, D)
    cdef idx_t b, t, k, j, i
    for b in range(B):
        for t in range(min(K - 1, L)):
            for k in range(t + 1, K):
                for j in range(D):
                    i = (b * D + j) * (K - 1) + K - 1 + t - k
                    if dcs != NULL:
                        dcs[i] += dc[(b * L + t) * D + j] * w[j * K + k]
                    if cs != NULL:
                        dw[j * K + k] += dc[(b * L + t) * D + j] * cs[i]


cdef void conv_tail_io(floating* tail, floating* xz, floating* cs, idx_t B, idx_t L,
                       idx_t D, idx_t K, bint backward) noexcept nogil:
    # tail (B, D, K-1): xc of steps L-K+1 .. L-1, oldest first; steps < 0 come from cs
    # (B, D, K-1) (NULL: zeros); xc = the first D columns of xz (M, 2D).
    # forward: tail = those values (read-only xz, cs); backward (tail = dtail, xz = dxz,
    # cs = dconv_state, may be NULL): dxz, dconv_state += dtail.
    cdef idx_t b, j, i, s
    for b in range(B):
        for j in range(D):
            for i in range(K - 1):
                s = L - (K - 1) + i
                if backward:
                    if s >= 0:
                        xz[(b * L + s) * 2 * D + j] += tail[(b * D + j) * (K - 1) + i]
                    elif cs != NULL:
                        cs[(b * D + j) * (K - 1) + L + i] += tail[(b * D + j) * (K - 1) + i]
                elif s >= 0:
                    tail[(b * D + j) * (K - 1) + i] = xz[(b * L + s) * 2 * D + j]
                else:
                    tail[(b * D + j) * (K - 1) + i] = cs[(b * D + j) * (K - 1) + L + i] if cs != NULL else 0


cdef int block_forward(floating* out, floating* cache,
                       const floating* x, const floating** params,
                       const mamba_dims* d, int n_threads) noexcept nogil:
    return block_forward_state(out, cache, <floating*>NULL, <floating*>NULL, x, params,
                               <floating*>NULL, <floating*>NULL, d, n_threads)


cdef int forward_window(floating* out, floating* cache, const cache_layout* w,
                        floating* h_last, floating* conv_tail,
                        const floating* x, const floating** params,
                        const floating* h0, const floating* conv_state,
                        const mamba_dims* d, int n_threads) noexcept nogil:
    # block_forward_state over one window: d holds the window's B and L, w the offsets of
    # the window's rows and chunks in the whole call's cache, out and x its rows
    cdef idx_t B = d.B, L = d.L, Dm = d.Dm, D = d.D, N = d.N, K = d.K, R = d.R
    cdef idx_t M = B * L, P = R + 2 * N, i
    cdef int nt = mx_threads(n_threads), rc
    cdef cache_layout cl = w[0]
    cdef floating* xz = cache + cl.xz
    cdef floating* xproj = cache + cl.xproj
    cdef floating* delta = cache + cl.delta
    cdef floating* xn
    cdef floating* u
    cdef floating* dt_low
    if M == 0:
        return 0
    # scratch: xn (M, Dm), u (M, D) (later the gated y), dt_low (M, R)
    xn = <floating*>mx_workspace(M * (Dm + D + R) * sizeof(floating))
    if xn == NULL:
        return -1
    u = xn + M * Dm
    dt_low = u + M * D

    flat_op(FLAT_COPY, cache + cl.x, x, M * Dm, nt)
    rmsnorm_forward(xn, cache + cl.rstd, x, params[P_normWeight], M, Dm, d.eps, nt)
    linear_forward(xz, xn, params[P_wInProj], params[P_bInProj], M, Dm, 2 * D, nt)
    conv1d_forward(u, xz, 2 * D, params[P_wConv], params[P_bConv], B, L, D, K, nt)
    if conv_state != NULL:
        conv_history_forward(u, params[P_wConv], conv_state, B, L, D, K)
    if conv_tail != NULL:
        conv_tail_io(conv_tail, xz, <floating*>conv_state, B, L, D, K, False)
    rows_elementwise(0, u, u, D, <floating*>NULL, M, D, nt)          # u = silu(conv) in place
    linear_forward(xproj, u, params[P_wXProj], params[P_bXProj], M, D, P, nt)
    copy_cols(dt_low, xproj, M, R, P, nt)
    linear_forward(delta, dt_low, params[P_wDtProj], params[P_bDtProj], M, R, D, nt)
    rows_elementwise(1, delta, delta, D, <floating*>NULL, M, D, nt)  # delta_pre -> delta
    # Bs, Cs: columns R .. R+N-1 and R+N .. R+2N-1 of xproj (rows P apart)
    rc = scan_forward_state(cache + cl.y, cache + cl.hstate, h_last, u, delta,
                            xproj + R, xproj + R + N, P, params[P_A_log], 0, params[P_D_vec], h0,
                            B, L, D, N, d.discretization, n_threads)
    if rc == 0:
        rows_elementwise(2, u, xz + D, 2 * D, cache + cl.y, M, D, nt)  # gated = y * silu(z), into u
        linear_forward(out, u, params[P_wOutProj], params[P_bOutProj], M, D, Dm, nt)
        flat_op(FLAT_ADD, out, x, M * Dm, nt)                       # the residual
    return rc


cdef int block_backward(floating* dx, floating** grads,
                        const floating* dout, const floating* cache,
                        const floating** params,
                        const mamba_dims* d, int n_threads) noexcept nogil:
    return block_backward_state(dx, grads, <floating*>NULL, <floating*>NULL, dout,
                                <floating*>NULL, <floating*>NULL, cache, params,
                                <floating*>NULL, d, n_threads)


cdef int backward_window(floating* dx, floating** grads,
                         floating* dh0, floating* dconv_state,
                         const floating* dout, const floating* dh_last,
                         const floating* dconv_tail, const floating* cache,
                         const cache_layout* w, const floating** params,
                         const floating* conv_state,
                         const mamba_dims* d, int n_threads) noexcept nogil:
    # block_backward_state over one window (see forward_window)
    cdef idx_t B = d.B, L = d.L, Dm = d.Dm, D = d.D, N = d.N, K = d.K, R = d.R
    cdef idx_t M = B * L, P = R + 2 * N, r, j
    cdef int nt = mx_threads(n_threads), nt_rows, rc
    cdef cache_layout cl = w[0]
    cdef const floating* x = cache + cl.x
    cdef const floating* rstd = cache + cl.rstd
    cdef const floating* xz = cache + cl.xz
    cdef const floating* xproj = cache + cl.xproj
    cdef const floating* delta = cache + cl.delta
    cdef const floating* yb = cache + cl.y
    cdef const floating* normW = params[P_normWeight]
    cdef floating* buf
    cdef floating* s1
    cdef floating* s2
    cdef floating* s3
    cdef floating* du
    cdef floating* ddelta
    cdef floating* dxz
    cdef floating* dxproj
    cdef floating* dt_low
    cdef floating* ddt_low
    cdef floating* xn
    cdef floating* dxn
    if M == 0:
        return 0
    # scratch, each buffer written before it is read (none zeroed):
    # s1 (gated, then dy), s2 (dgated, then conv), s3 (u), du, ddelta (M, D); dt_low (M, R);
    # xn (M, Dm); dxz (M, 2D): its z half written by gate_backward, its first D columns by
    # the conv's backward; dxproj (M, P): the dBs | dCs columns written by the scan, the
    # dt_low ones copied from ddt_low (M, R); dxn (M, Dm). The products write their dx
    # (linear_backward_set), the scan its rows and the conv its dxc (_set).
    buf = <floating*>mx_workspace(M * (7 * D + P + 2 * R + 2 * Dm) * sizeof(floating))
    if buf == NULL:
        return -1
    s1 = buf
    s3 = s1 + M * D
    dt_low = s3 + M * D
    xn = dt_low + M * R
    s2 = xn + M * Dm
    du = s2 + M * D
    ddelta = du + M * D
    dxz = ddelta + M * D
    dxproj = dxz + M * 2 * D
    ddt_low = dxproj + M * P
    dxn = ddt_low + M * R

    # residual and out_proj: s1 = gated (M, D), s2 = dgated
    flat_op(FLAT_ADD, dx, dout, M * Dm, nt)
    rows_elementwise(2, s1, xz + D, 2 * D, yb, M, D, nt)
    if linear_backward_set(s2, grads[P_wOutProj], grads[P_bOutProj], dout, s1,
                       params[P_wOutProj], M, D, Dm, nt) != 0:
        return -1
    # gate: s1 = dy = dgated * silu(z); dz = dgated * y * silu'(z) into dxz[:, D:2D]
    gate_backward(s1, dxz + D, 2 * D, s2, yb, xz + D, M, D, nt)
    # recompute conv (s2) and u (s3)
    conv1d_forward(s2, xz, 2 * D, params[P_wConv], params[P_bConv], B, L, D, K, nt)
    if conv_state != NULL:
        conv_history_forward(s2, params[P_wConv], conv_state, B, L, D, K)
    rows_elementwise(0, s3, s2, D, <floating*>NULL, M, D, nt)
    rc = scan_backward_state_set(du, ddelta, dxproj + R, dxproj + R + N, grads[P_A_log],
                             grads[P_D_vec], dh0, s1, dh_last, cache + cl.hstate, s3, delta,
                             xproj + R, xproj + R + N, P, params[P_A_log], 0, params[P_D_vec],
                             B, L, D, N, d.discretization, n_threads)
    if rc != 0:
        return rc
    # softplus: ddelta_pre = ddelta * sigmoid(delta_pre), in place
    rows_elementwise(4, ddelta, delta, D, <floating*>NULL, M, D, nt)
    # dt_proj on the dt_low columns of xproj
    copy_cols(dt_low, xproj, M, R, P, nt)
    if linear_backward_set(ddt_low, grads[P_wDtProj], grads[P_bDtProj], ddelta, dt_low,
                       params[P_wDtProj], M, R, D, nt) != 0:
        return -1
    nt_rows = mx_team(nt, M * (R + Dm), MIN_ELEMENTS_PER_THREAD, M)
    for r in prange(M, schedule='static', num_threads=nt_rows):
        for j in range(R):
            dxproj[r * P + j] = ddt_low[r * R + j]
    # x_proj, then silu: dconv = du * silu'(conv), in place
    if linear_backward(du, grads[P_wXProj], grads[P_bXProj], dxproj, s3, params[P_wXProj], M, D, P,
                       nt) != 0:
        return -1
    rows_elementwise(3, du, s2, D, <floating*>NULL, M, D, nt)
    if conv1d_backward_set(dxz, 2 * D, grads[P_wConv], grads[P_bConv], du, xz, 2 * D,
                       params[P_wConv], B, L, D, K, nt) != 0:
        return -1
    conv_history_backward(dconv_state, grads[P_wConv], du, params[P_wConv], conv_state,
                          B, L, D, K)
    if dconv_tail != NULL:
        conv_tail_io(<floating*>dconv_tail, dxz, dconv_state, B, L, D, K, True)
    # in_proj on xn = x * rstd * normWeight (recomputed), then RMSNorm
    for r in prange(M, schedule='static', num_threads=nt_rows):
        for j in range(Dm):
            xn[r * Dm + j] = x[r * Dm + j] * rstd[r] * normW[j]
    if linear_backward_set(dxn, grads[P_wInProj], grads[P_bInProj], dxz, xn, params[P_wInProj],
                       M, Dm, 2 * D, nt) != 0:
        return -1
    rmsnorm_backward(dx, grads[P_normWeight], dxn, x, normW, rstd, M, Dm, nt)
    return 0


# Windows: a call of more rows than one window runs window by window, so that the scratch
# (forward M*(Dm + D + R), backward M*(7D + P + 2R + 2Dm) values) is sized by the window,
# not by the call. A window is a group of whole sequences when a sequence fits, else a
# range of time steps of one sequence; the state crosses a time boundary as state
# passing does (h_last -> h0 forward, dh0 -> dh_last backward, the K-1 steps of xc
# before the window from the cache). Group windows give the results of one window
# bitwise in the forward (each row's arithmetic is unchanged); time windows add the
# first K-1 conv taps of a window in another order, and the backward sums the weight
# gradients window by window: equal to float rounding.

cdef idx_t window_rows(const mamba_dims* d, size_t itemsize) noexcept nogil:
    # rows of one window: window_bytes of backward scratch, a multiple of SCAN_CHUNK
    # (time windows start at a chunk of the cache's hstate), at least K steps
    cdef idx_t per_row = 7 * d.D + d.R + 2 * d.N + 2 * d.R + 2 * d.Dm
    cdef idx_t T = constants.SCAN_CHUNK
    cdef idx_t w = <idx_t>(window_bytes // (max(per_row, <idx_t>1) * itemsize))
    w = max(w // T * T, T)
    return max(w, (d.K + T - 1) // T * T)


cdef inline cache_layout shifted(cache_layout c, const mamba_dims* d, idx_t r0,
                                 idx_t c0) noexcept nogil:
    # the layout of a window starting at row r0 and scan chunk c0 of the whole cache
    cdef idx_t P = d.R + 2 * d.N
    c.x += r0 * d.Dm
    c.rstd += r0
    c.xz += r0 * 2 * d.D
    c.xproj += r0 * P
    c.delta += r0 * d.D
    c.y += r0 * d.D
    c.hstate += c0 * d.D * d.N
    return c


cdef void xc_history(floating* cs, const floating* xz, idx_t t0, idx_t D, idx_t K) noexcept nogil:
    # cs (1, D, K-1) = xc of steps t0-K+1 .. t0-1 of one sequence, oldest first;
    # xz (its L rows, 2D); t0 >= K-1
    cdef idx_t j, i
    for j in range(D):
        for i in range(K - 1):
            cs[j * (K - 1) + i] = xz[(t0 - (K - 1) + i) * 2 * D + j]


cdef inline const floating* row_of(const floating* a, idx_t b, idx_t n) noexcept nogil:
    # sequence b of an optional (B, n) state array
    return NULL if a == NULL else a + b * n


cdef int block_forward_state(floating* out, floating* cache,
                             floating* h_last, floating* conv_tail,
                             const floating* x, const floating** params,
                             const floating* h0, const floating* conv_state,
                             const mamba_dims* d, int n_threads) noexcept nogil:
    cdef idx_t B = d.B, L = d.L, Dm = d.Dm, DN = d.D * d.N, DK = d.D * (d.K - 1)
    cdef idx_t C = scan_nchunks(L), W = window_rows(d, sizeof(floating)), G, b, t0
    cdef cache_layout whole = layout(d), w
    cdef mamba_dims dw = d[0]
    cdef floating* carry
    cdef floating* h_in
    cdef floating* h_out
    cdef floating* cs
    cdef bint first, last
    cdef int rc = 0
    if B * L <= W or L <= W:
        # groups of G whole sequences (one group: the whole call)
        G = max(<idx_t>1, W // max(L, <idx_t>1))
        b = 0
        while b < B and rc == 0:
            dw.B = min(G, B - b)
            w = shifted(whole, d, b * L, b * C)
            rc = forward_window(out + b * L * Dm, cache, &w,
                                <floating*>row_of(h_last, b, DN),
                                <floating*>row_of(conv_tail, b, DK), x + b * L * Dm, params,
                                row_of(h0, b, DN), row_of(conv_state, b, DK), &dw, n_threads)
            b += G
        return rc
    # time windows of W steps of one sequence; carry: the state between two windows
    # (h_in, h_out (D, N)) and the conv history of a window (cs (D, K-1))
    carry = <floating*>malloc((2 * DN + DK + 1) * sizeof(floating))
    if carry == NULL:
        return -1
    h_in, h_out, cs = carry, carry + DN, carry + 2 * DN
    dw.B = 1
    for b in range(B):
        t0 = 0
        while t0 < L and rc == 0:
            dw.L = min(W, L - t0)
            first, last = t0 == 0, t0 + dw.L == L
            w = shifted(whole, d, b * L + t0, b * C + t0 // constants.SCAN_CHUNK)
            if not first:
                xc_history(cs, cache + whole.xz + b * L * 2 * d.D, t0, d.D, d.K)
            rc = forward_window(out + (b * L + t0) * Dm, cache, &w,
                                <floating*>row_of(h_last, b, DN) if last else h_out,
                                <floating*>row_of(conv_tail, b, DK) if last else NULL,
                                x + (b * L + t0) * Dm, params,
                                row_of(h0, b, DN) if first else h_in,
                                row_of(conv_state, b, DK) if first else cs, &dw, n_threads)
            h_in, h_out = h_out, h_in
            t0 += dw.L
    free(carry)
    return rc


cdef int block_backward_state(floating* dx, floating** grads,
                              floating* dh0, floating* dconv_state,
                              const floating* dout, const floating* dh_last,
                              const floating* dconv_tail, const floating* cache,
                              const floating** params, const floating* conv_state,
                              const mamba_dims* d, int n_threads) noexcept nogil:
    cdef idx_t B = d.B, L = d.L, Dm = d.Dm, DN = d.D * d.N, DK = d.D * (d.K - 1)
    cdef idx_t C = scan_nchunks(L), W = window_rows(d, sizeof(floating)), G, b, t0, nw
    cdef cache_layout whole = layout(d), w
    cdef mamba_dims dw = d[0]
    cdef floating* carry
    cdef floating* dh_in
    cdef floating* dh_out
    cdef floating* dc_in
    cdef floating* dc_out
    cdef floating* cs
    cdef bint first, last
    cdef int rc = 0
    if B * L <= W or L <= W:
        G = max(<idx_t>1, W // max(L, <idx_t>1))
        b = 0
        while b < B and rc == 0:
            dw.B = min(G, B - b)
            w = shifted(whole, d, b * L, b * C)
            rc = backward_window(dx + b * L * Dm, grads, <floating*>row_of(dh0, b, DN),
                                 <floating*>row_of(dconv_state, b, DK), dout + b * L * Dm,
                                 row_of(dh_last, b, DN), row_of(dconv_tail, b, DK), cache, &w,
                                 params, row_of(conv_state, b, DK), &dw, n_threads)
            b += G
        return rc
    # time windows, last first; carry: d(state) between windows (dh_in, dh_out (D, N)),
    # d(conv history) (dc_in, dc_out (D, K-1)), the conv history of a window (cs)
    carry = <floating*>malloc((2 * DN + 3 * DK + 1) * sizeof(floating))
    if carry == NULL:
        return -1
    dh_in, dh_out = carry, carry + DN
    dc_in, dc_out, cs = carry + 2 * DN, carry + 2 * DN + DK, carry + 2 * DN + 2 * DK
    dw.B = 1
    nw = (L + W - 1) // W
    for b in range(B):
        t0 = (nw - 1) * W
        while t0 >= 0 and rc == 0:
            dw.L = min(W, L - t0)
            first, last = t0 == 0, t0 + dw.L == L
            w = shifted(whole, d, b * L + t0, b * C + t0 // constants.SCAN_CHUNK)
            if not first:
                xc_history(cs, cache + whole.xz + b * L * 2 * d.D, t0, d.D, d.K)
                memset(dh_out, 0, DN * sizeof(floating))
                memset(dc_out, 0, DK * sizeof(floating))
            rc = backward_window(dx + (b * L + t0) * Dm, grads,
                                 <floating*>row_of(dh0, b, DN) if first else dh_out,
                                 <floating*>row_of(dconv_state, b, DK) if first else dc_out,
                                 dout + (b * L + t0) * Dm,
                                 row_of(dh_last, b, DN) if last else dh_in,
                                 row_of(dconv_tail, b, DK) if last else dc_in, cache, &w,
                                 params, row_of(conv_state, b, DK) if first else cs, &dw,
                                 n_threads)
            dh_in, dh_out = dh_out, dh_in
            dc_in, dc_out = dc_out, dc_in
            t0 -= W
    free(carry)
    return rc


# ----------------------------------------------------------------------------
# Python entry points used by mamba_ext.block (arrays already validated there:
# C-contiguous, one float dtype, shapes consistent with the sizes).

cdef mamba_dims make_dims(tuple sizes, double eps, int discretization):
    cdef mamba_dims d
    d.B, d.L, d.Dm, d.D, d.N, d.K, d.R = sizes
    d.eps = eps
    d.discretization = discretization
    return d


def window_len(tuple sizes, int itemsize):
    """Rows of one window of a call of sizes (B, L, Dm, D, N, K, R) (see "Windows")."""
    cdef mamba_dims d = make_dims(sizes, 0.0, 0)
    return window_rows(&d, itemsize)


# The cache pool: sealed buffers of at least POOL_MIN_BYTES that their arrays no longer
# need are kept, up to pool_limit bytes in all, and handed to the next sealed_empty that
# fits one (a cache is written whole by its forward before anything reads it). Why: a
# fresh malloc of more than glibc's largest mmap threshold (32 MiB) is a fresh mmap
# whose pages fault in one by one, on every call: size c at L 2048 (a 57 MB cache) took
# 160.9 ms a forward + backward against 146.5 ms with its memory reused
# (docs/performance.md, session 45). The same as glibc's own reuse below that threshold,
# for larger buffers; GIL-held state (vaults are made and freed with the GIL).
cdef enum:
    POOL_SLOTS = 64
cdef size_t POOL_MIN_BYTES = 1 << 20
cdef size_t pool_limit = 256 << 20
cdef void* pool_p[POOL_SLOTS]
cdef size_t pool_cap[POOL_SLOTS]
cdef int pool_used = 0
cdef size_t pool_bytes = 0


cdef void* pool_remove(int i, size_t* cap) noexcept:
    # slot i's buffer (its size in cap) out of the pool, the last slot moved into its place
    global pool_used, pool_bytes
    cdef void* p = pool_p[i]
    cap[0] = pool_cap[i]
    pool_bytes -= pool_cap[i]
    pool_used -= 1
    pool_p[i] = pool_p[pool_used]
    pool_cap[i] = pool_cap[pool_used]
    return p


cdef void pool_drop(int i) noexcept:
    # slot i's buffer out of the pool and freed
    cdef size_t cap
    mx_aligned_free(pool_remove(i, &cap))


cdef void* pool_take(size_t nbytes, size_t* cap) noexcept:
    # the smallest pooled buffer of nbytes to 2*nbytes (it leaves the pool), or NULL
    cdef int i, best = -1
    if nbytes < POOL_MIN_BYTES:
        return NULL
    for i in range(pool_used):
        if nbytes <= pool_cap[i] <= 2 * nbytes and (best < 0 or pool_cap[i] < pool_cap[best]):
            best = i
    return pool_remove(best, cap) if best >= 0 else NULL


cdef void pool_give(void* p, size_t cap) noexcept:
    # p (cap bytes) kept, pooled buffers freed to make room, or p freed itself (too small
    # for the pool's purpose, or larger than its limit)
    global pool_used, pool_bytes
    if p == NULL:
        return
    if cap < POOL_MIN_BYTES or cap > pool_limit:
        mx_aligned_free(p)
        return
    while pool_used > 0 and (pool_used == POOL_SLOTS or pool_bytes + cap > pool_limit):
        pool_drop(0)
    pool_p[pool_used] = p
    pool_cap[pool_used] = cap
    pool_used += 1
    pool_bytes += cap


def cache_pool(limit=None):
    """(bytes held, limit) of the cache pool (see "The cache pool"); ``limit`` (an int
    >= 0) sets the most it may hold first, freeing buffers down to it (0: none kept)."""
    global pool_limit
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: expected an int >= 0 (bytes), got {limit!r}")
        pool_limit = <size_t>min(<object>limit, <object>(1 << 62))
        while pool_used > 0 and pool_bytes > pool_limit:
            pool_drop(0)
    return int(pool_bytes), int(pool_limit)


cdef class _Vault:
    """Owner of a sealed array's memory (sealed): it exposes no buffer interface, so NumPy
    can never make an array over that memory writeable again. Its memory goes back to the
    cache pool."""
    cdef void* p
    cdef size_t cap

    def __dealloc__(self):
        pool_give(self.p, self.cap)


cdef object _sealed_array(int nd, cnp.npy_intp* shape, int typenum, size_t nbytes,
                          const void* src):
    # a read-only array of nbytes in a _Vault (src: copied in; NULL: left undefined, its
    # memory possibly a pooled buffer's)
    cdef _Vault v = _Vault()
    cdef size_t cap = nbytes if nbytes > 0 else 1
    v.p = pool_take(cap, &cap) if src == NULL else NULL
    if v.p == NULL:
        v.p = mx_aligned_alloc(cap)
    if v.p == NULL:
        raise MemoryError(f"out of memory for a sealed array of {nbytes} bytes")
    v.cap = cap
    if src != NULL:
        memcpy(v.p, src, nbytes)
    out = cnp.PyArray_SimpleNewFromData(nd, shape, typenum, v.p)
    Py_INCREF(v)                         # PyArray_SetBaseObject steals a reference
    cnp.PyArray_SetBaseObject(<cnp.ndarray>out, v)
    cnp.PyArray_CLEARFLAGS(<cnp.ndarray>out, cnp.NPY_ARRAY_WRITEABLE)
    return out


def sealed(cnp.ndarray a):
    """A read-only copy of the C-contiguous array ``a`` that cannot be made writeable
    (``flags.writeable = True`` raises for it, its views and its base): the block cache's
    conv_state."""
    if not a.flags.c_contiguous:
        raise ValueError("sealed: expected a C-contiguous array")
    return _sealed_array(a.ndim, a.shape, cnp.PyArray_TYPE(a), <size_t>a.nbytes,
                         cnp.PyArray_DATA(a))


def sealed_empty(Py_ssize_t n, dtype):
    """A 1-D read-only array of ``n`` elements of ``dtype`` that cannot be made writeable,
    contents undefined: the block cache's buffer, which the compiled forward writes
    through its pointer before anyone reads it."""
    cdef cnp.npy_intp shape[1]
    dt = np.dtype(dtype)
    if n < 0:
        raise ValueError(f"sealed_empty: n must be >= 0, got {n}")
    shape[0] = n
    return _sealed_array(1, shape, dt.num, <size_t>n * dt.itemsize, NULL)


def hash_bytes(cnp.ndarray a):
    """64-bit order-dependent hash of the bytes of a C-contiguous array (csrc/mx_hash.h),
    computed without the GIL: the parameter fingerprint of the block cache. Arrays of more
    than one HASH_BLOCK are hashed block by block in parallel and the block hashes hashed
    in order (the same value for any thread count)."""
    cdef const unsigned char* p = <const unsigned char*>cnp.PyArray_DATA(a)
    cdef size_t n = <size_t>a.nbytes, nb = (n + HASH_BLOCK - 1) // HASH_BLOCK, j
    cdef uint64_t h
    cdef uint64_t[::1] parts
    cdef int nt
    if not a.flags.c_contiguous:
        raise ValueError("hash_bytes: expected a C-contiguous array")
    if nb <= 1:
        with nogil:
            h = mx_hash64(p, n, 0)
        return h
    parts = np.empty(nb, np.uint64)
    nt = mx_team(0, <long long>n, HASH_BLOCK, <long long>nb)
    with nogil:
        for j in prange(nb, schedule='static', num_threads=nt):
            parts[j] = mx_hash64(p + j * HASH_BLOCK, min(<size_t>HASH_BLOCK, n - j * HASH_BLOCK), j)
        h = mx_hash64(&parts[0], nb * sizeof(uint64_t), n)
    return h


def cache_len(tuple sizes):
    """Elements of the forward cache for sizes (B, L, Dm, D, N, K, R)."""
    cdef mamba_dims d = make_dims(sizes, 0.0, 0)
    return block_cache_len(&d)


cdef inline void* ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef inline void* optr(object a):
    # data pointer of an optional array (None: NULL)
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray>a)


def forward(cnp.ndarray x, list params, cnp.ndarray out, cnp.ndarray cache,
            tuple sizes, double eps, int discretization, int n_threads,
            h0=None, conv_state=None, h_last=None, conv_tail=None):
    """out, cache written from x and the 13 params (BLOCK_PARAM_NAMES order).
    Optional (None: zeros / not wanted), C-contiguous of x's dtype: h0, h_last (B, D, N),
    conv_state, conv_tail (B, D, K-1) (see block_forward_state in block.pxd)."""
    cdef mamba_dims d = make_dims(sizes, eps, discretization)
    cdef const void* p[MAMBA_NPARAMS]
    cdef int i, rc
    cdef bint single = x.dtype == np.float32
    cdef void* xo = ptr(x)
    cdef void* oo = ptr(out)
    cdef void* co = ptr(cache)
    cdef void* h0o = optr(h0)
    cdef void* cso = optr(conv_state)
    cdef void* hlo = optr(h_last)
    cdef void* cto = optr(conv_tail)
    for i in range(MAMBA_NPARAMS):
        p[i] = ptr(params[i])
    with nogil:
        if single:
            rc = block_forward_state(<float*>oo, <float*>co, <float*>hlo, <float*>cto,
                                     <const float*>xo, <const float**>p, <const float*>h0o,
                                     <const float*>cso, &d, n_threads)
        else:
            rc = block_forward_state(<double*>oo, <double*>co, <double*>hlo, <double*>cto,
                                     <const double*>xo, <const double**>p, <const double*>h0o,
                                     <const double*>cso, &d, n_threads)
    if rc != 0:
        raise MemoryError("mamba1_forward: out of memory for scratch buffers")


def backward(cnp.ndarray dx, list grads, cnp.ndarray dout, cnp.ndarray cache,
             list params, tuple sizes, int discretization, int n_threads,
             conv_state=None, dh_last=None, dconv_tail=None, dh0=None, dconv_state=None):
    """dx and grads (BLOCK_PARAM_NAMES order) accumulate the block's VJP.
    Optional (None: zeros / not wanted): conv_state (the forward's), dh_last (B, D, N),
    dconv_tail (B, D, K-1) read; dh0 (B, D, N), dconv_state (B, D, K-1) accumulate."""
    cdef mamba_dims d = make_dims(sizes, 0.0, discretization)
    cdef const void* p[MAMBA_NPARAMS]
    cdef void* g[MAMBA_NPARAMS]
    cdef int i, rc
    cdef bint single = dout.dtype == np.float32
    cdef void* dxo = ptr(dx)
    cdef void* doo = ptr(dout)
    cdef void* co = ptr(cache)
    cdef void* cso = optr(conv_state)
    cdef void* dhlo = optr(dh_last)
    cdef void* dcto = optr(dconv_tail)
    cdef void* dh0o = optr(dh0)
    cdef void* dcso = optr(dconv_state)
    for i in range(MAMBA_NPARAMS):
        p[i] = ptr(params[i])
        g[i] = ptr(grads[i])
    with nogil:
        if single:
            rc = block_backward_state(<float*>dxo, <float**>g, <float*>dh0o, <float*>dcso,
                                      <const float*>doo, <const float*>dhlo,
                                      <const float*>dcto, <const float*>co, <const float**>p,
                                      <const float*>cso, &d, n_threads)
        else:
            rc = block_backward_state(<double*>dxo, <double**>g, <double*>dh0o, <double*>dcso,
                                      <const double*>doo, <const double*>dhlo,
                                      <const double*>dcto, <const double*>co, <const double**>p,
                                      <const double*>cso, &d, n_threads)
    if rc != 0:
        raise MemoryError("mamba1_backward: out of memory for scratch buffers")
