# cython: language_level=3
"""Selective scan (S6): exact ZOH (or Euler) forward and chunked backward.

Size letters: B batch, L seqLen, D dInner, N dState, M = B*L rows, T = SCAN_CHUNK steps
per chunk, C = ceil(L / T) chunks, G = MX_SCAN_G = 64 lanes (channels) per job,
GB = MX_SCAN_GB = 16. Hot loops: csrc/mx_scan.h; constants: csrc/mx_constants.h.

Design:
Work is split into B*ceil(D/G) independent jobs (one sequence b, one group of G
consecutive channels), run with prange, group by group: a thread loads a group's A and
1/A (an exponential and a division each) once for its consecutive jobs of that group.
Each channel of a group is one vector lane: per step and state n the hot loop runs over
the G lanes, with Bs[t,n] and Cs[t,n] broadcast, so no step needs a horizontal sum (a
first version vectorised over n instead and spent most of its time in those sums).
G = 64 (four AVX-512 vectors) took ~25% less scan time than 16 at size c (fewer passes
over Bs, Cs and the per-thread dBs/dCs buffer). A full group reads delta, u, dy and
writes y, du, ddelta in place (rows D apart); only a partial last group (D not a
multiple of G) goes through (T, G) lane copies with zero padding lanes. The forward
keeps one state in place (L1-resident) and stores only the state entering each chunk,
hstate (B, C, D, N); the backward's recomputation keeps the chunk's T+1 states and
expm1 values. The hot loops are C (csrc/mx_scan.h), marked `omp simd`, compiled for
AVX-512 / AVX2 / baseline with runtime dispatch where the compiler supports it
(MX_DISPATCH in csrc/mx_compat.h); in float32 they call the branch-free
mx_expm1f_unsigned_zero of csrc/mx_math.h, or, for a step where no lane's delta is
negative (A < 0, so delta*A <= 0: every step of a block, whose delta is a softplus),
mx_expm1f_le88 without its overflow select: the same values, 10% less time per step.
One exponential per (t, d, n) serves both factors: a_bar = 1 + em and
b_bar = em / A * Bs with em = expm1(delta*A) (exact ZOH without cancellation).

Backward (vector-Jacobian product), for each job walking t downwards, with
dh = dy[t] * Cs[t] + a_bar[t+1] * dh[t+1] (the carry):
  dCs[t,n] += dy[t] h[t,n];   dBs[t,n] += dh u[t] f;   du[t] += sum_n dh f Bs + dy D_vec
  ddelta[t] += sum_n dh h[t-1] a_bar A + dh u Bs a_bar   (ZOH, f = em/A, df/ddelta = a_bar)
  dA_log[n] += A * dLoss/dA = dh h[t-1] a_bar delta A + dh u Bs (delta a_bar - f)
(in Euler f = delta, so the Bs term of ddelta is dh u Bs and it adds nothing to dA_log).
A_log outside the open interval (A_LOG_MIN, A_LOG_MAX) gets exactly zero gradient (clamp).

The states inside a chunk are recomputed from the stored chunk-entry state by
the same code as the forward, so they are bitwise the forward's states.
Per-job gradients of shared tensors (dBs/dCs rows of sequence b, dA_log and
D_vec rows of the group) go to per-job slots (dBs/dCs per lane mod GB in a
per-thread (T, 2N, GB) buffer, folded into the job's (L, 2N) slot after each chunk, so
no per-thread buffer grows with L) and are summed after the parallel loop in a fixed
order, so the gradients are bitwise reproducible and independent of the thread count
(no critical sections). With one channel group (D <= G) a job owns its sequence's
dBs/dCs rows and adds into them directly: no (B, L, 2N) slots at all.

With a_given (scan_forward_state, scan_backward_state) the A_log argument holds A itself:
no clamp, and its gradient is dLoss/dA = (A dLoss/dA) / A (mamba_ext.torch's
mamba_ssm-compatible functions take A, any negative values).

Optional initial / final states (scan_forward_state, scan_backward_state): h0 is
the state entering chunk 0 (so hstate chunk 0 = h0); the backward's carry starts
at dh_last instead of 0, and after step 0 it is a_bar[0] * dh[0] = dLoss/dh0.
"""
from libc.string cimport memcpy, memset
from libc.stdlib cimport malloc, free
from libc.math cimport exp
from cython.parallel cimport prange, parallel
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.constants cimport A_LOG_MIN, A_LOG_MAX, SCAN_CHUNK
from mamba_ext.cpu.threads cimport mx_threads, mx_team, mx_aligned_alloc, mx_aligned_free

# The hot loops (argument meanings and shapes: csrc/mx_scan.h).
cdef extern from "csrc/mx_scan.h" nogil:
    enum: MX_SCAN_G, MX_SCAN_GB
    void mx_scan_forward_chunk_f(idx_t n_steps, idx_t N, int zoh,
                                 const float* delta, const float* u, idx_t ld,
                                 const float* Bs, const float* Cs, idx_t ld_bc,
                                 const float* A, const float* A_inv, idx_t hstep,
                                 float* h, float* em1, float* y, const float* D_lane) noexcept
    void mx_scan_forward_chunk_d(idx_t n_steps, idx_t N, int zoh,
                                 const double* delta, const double* u, idx_t ld,
                                 const double* Bs, const double* Cs, idx_t ld_bc,
                                 const double* A, const double* A_inv, idx_t hstep,
                                 double* h, double* em1, double* y, const double* D_lane) noexcept
    void mx_scan_backward_chunk_f(idx_t n_steps, idx_t N, int zoh,
                                  const float* delta, const float* u, const float* dy, idx_t ld,
                                  const float* Bs, const float* Cs, idx_t ld_bc,
                                  const float* A, const float* A_inv, const float* D_lane,
                                  const float* h, const float* em1,
                                  float* carry, float* dBC, float* dA_acc, float* dD_acc,
                                  float* du, float* ddelta, int add) noexcept
    void mx_scan_backward_chunk_d(idx_t n_steps, idx_t N, int zoh,
                                  const double* delta, const double* u, const double* dy,
                                  idx_t ld, const double* Bs, const double* Cs, idx_t ld_bc,
                                  const double* A, const double* A_inv, const double* D_lane,
                                  const double* h, const double* em1,
                                  double* carry, double* dBC, double* dA_acc, double* dD_acc,
                                  double* du, double* ddelta, int add) noexcept
    void mx_scan_fold_f(idx_t n_rows, const float* dBC, float* sums) noexcept
    void mx_scan_fold_d(idx_t n_rows, const double* dBC, double* sums) noexcept


cdef inline void* scratch(idx_t n, size_t itemsize) noexcept nogil:
    # n values of itemsize bytes, 64-byte aligned (free with mx_aligned_free)
    return mx_aligned_alloc(n * itemsize)


cdef idx_t scan_nchunks(idx_t L) noexcept nogil:
    return (L + SCAN_CHUNK - 1) // SCAN_CHUNK


cdef inline int load_AT(floating* AT, floating* invAT, floating* Dv, const floating* A_log,
                        int a_given, int zoh, const floating* D_vec, idx_t N, int nl) noexcept nogil:
    # AT, invAT (N, G) = A, 1/A of the nl channels whose A_log rows (N,) start at A_log;
    # A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX)), or A = A_log's values as they are when
    # a_given; padding lanes get A = -1 (their inputs are 0). invAT is only read by ZOH:
    # zeros in Euler (no divisions: they cost as much as a one-step scan).
    # Dv (G,) = their D_vec entries (padding lanes 0).
    # Returns 1 when a given A is not negative (or NaN), else 0.
    cdef idx_t n
    cdef int g, bad = 0
    cdef double a
    for g in range(MX_SCAN_G):
        Dv[g] = D_vec[g] if g < nl else 0
    for n in range(N):
        for g in range(MX_SCAN_G):
            if g < nl and a_given:
                AT[n * MX_SCAN_G + g] = A_log[g * N + n]
                if not (A_log[g * N + n] < 0):
                    bad = 1
            elif g < nl:
                a = A_log[g * N + n]
                a = A_LOG_MIN if a < A_LOG_MIN else (A_LOG_MAX if a > A_LOG_MAX else a)
                AT[n * MX_SCAN_G + g] = <floating>(-exp(a))
            else:
                AT[n * MX_SCAN_G + g] = -1
            invAT[n * MX_SCAN_G + g] = 1 / AT[n * MX_SCAN_G + g] if zoh else 0
    return bad


cdef inline void stage(floating* dst, const floating* src, idx_t rows, idx_t ld,
                       int nl) noexcept nogil:
    # dst (rows, G) = nl values of each of `rows` rows ld apart; padding lanes 0
    cdef idx_t s
    cdef int g
    for s in range(rows):
        for g in range(MX_SCAN_G):
            dst[s * MX_SCAN_G + g] = src[s * ld + g] if g < nl else 0


cdef inline void state_io(floating* h, floating* hs, idx_t N, int nl, bint store) noexcept nogil:
    # h (N, G) lanes <-> hs (nl, N) rows of the stored (B, C, D, N) states
    cdef idx_t n
    cdef int g
    for n in range(N):
        for g in range(MX_SCAN_G):
            if store:
                if g < nl:
                    hs[g * N + n] = h[n * MX_SCAN_G + g]
            else:
                h[n * MX_SCAN_G + g] = hs[g * N + n] if g < nl else 0


cdef inline void chunk_fwd(idx_t tn, idx_t N, int zoh, const floating* dl,
                           const floating* uu, idx_t ld, const floating* Bs, const floating* Cs,
                           idx_t ld_bc, const floating* AT, const floating* invAT,
                           idx_t hstep, floating* h, floating* em1, floating* y,
                           const floating* Dv) noexcept nogil:
    # mx_scan_forward_chunk of the buffers' precision: dl, uu (tn rows ld apart, G) delta
    # and u; Bs, Cs (tn rows ld_bc apart, N); AT, invAT (N, G); h (tn+1, N, G) or (N, G)
    # (hstep 0); em1 likewise; y (tn rows ld apart, G) or NULL; Dv (G,)
    if floating is float:
        mx_scan_forward_chunk_f(tn, N, zoh, dl, uu, ld, Bs, Cs, ld_bc, AT, invAT, hstep, h, em1, y, Dv)
    else:
        mx_scan_forward_chunk_d(tn, N, zoh, dl, uu, ld, Bs, Cs, ld_bc, AT, invAT, hstep, h, em1, y, Dv)


cdef inline void state_add(floating* hs, const floating* h, idx_t N, int nl) noexcept nogil:
    # hs (nl, N) rows of a (B, D, N) state += lanes h (N, G)
    cdef idx_t n
    cdef int g
    for g in range(nl):
        for n in range(N):
            hs[g * N + n] += h[n * MX_SCAN_G + g]


# Shapes of every argument of the four entry points: scan.pxd.
cdef int scan_forward(floating* y, floating* hstate,
                      const floating* u, const floating* delta,
                      const floating* Bs, const floating* Cs, idx_t ld_bc,
                      const floating* A_log, const floating* D_vec,
                      idx_t B, idx_t L, idx_t D, idx_t N,
                      int discretization, int n_threads) noexcept nogil:
    return scan_forward_state(y, hstate, <floating*>NULL, u, delta, Bs, Cs, ld_bc, A_log, 0,
                              D_vec, <floating*>NULL, B, L, D, N, discretization, n_threads)


cdef int scan_forward_state(floating* y, floating* hstate, floating* h_last,
                            const floating* u, const floating* delta,
                            const floating* Bs, const floating* Cs, idx_t ld_bc,
                            const floating* A_log, int a_given, const floating* D_vec,
                            const floating* h0, idx_t B, idx_t L, idx_t D, idx_t N,
                            int discretization, int n_threads) noexcept nogil:
    # Jobs: (sequence b, group of G channels d0 .. d0+nl-1), group-major, so that a
    # thread's consecutive jobs share their group's A (tag: the d0 loaded, and whether its
    # given A was refused).
    cdef idx_t T = SCAN_CHUNK, G = MX_SCAN_G, C = scan_nchunks(L), ng = (D + MX_SCAN_G - 1) // MX_SCAN_G
    cdef idx_t job, b, d0, c, t0, tn, r0, s
    cdef int nl, g, zoh = discretization == 0, failed = 0, bad = 0
    cdef int* failp = &failed
    cdef int* badp = &bad
    cdef int nt = mx_threads(n_threads)
    cdef floating* buf = NULL
    cdef floating* AT = NULL
    cdef floating* invAT = NULL
    cdef floating* Dv = NULL
    cdef floating* dl = NULL
    cdef floating* uu = NULL
    cdef floating* yy = NULL
    cdef floating* h = NULL
    cdef floating* em1 = NULL
    cdef idx_t* tag = NULL
    if B * D == 0 or L == 0:
        return 0
    # state updates per thread: 2^14 take ~10 us (an exponential each)
    nt = mx_team(nt, B * L * D * N, 1 << 14, B * ng)
    with parallel(num_threads=nt):
        # per thread: AT, invAT (N, G); Dv (G,); dl, uu, yy (T, G) (lane copies for a
        # partial group); h, em1 (N, G) (the state, updated in place); tag (2,)
        buf = <floating*>scratch((4 * N + 1 + 3 * T) * G, sizeof(floating))
        tag = <idx_t*>malloc(2 * sizeof(idx_t))
        if buf == NULL or tag == NULL:
            failp[0] = 1
        else:
            tag[0] = -1
        AT = buf
        invAT = AT + N * G
        Dv = invAT + N * G
        dl = Dv + G
        uu = dl + T * G
        yy = uu + T * G
        h = yy + T * G
        em1 = h + N * G
        for job in prange(B * ng, schedule='static'):
            if buf != NULL and tag != NULL:
                b = job % B
                d0 = (job // B) * G
                nl = <int>min(G, D - d0)
                if tag[0] != d0:
                    tag[1] = load_AT(AT, invAT, Dv, A_log + d0 * N, a_given, zoh, D_vec + d0,
                                     N, nl)
                    tag[0] = d0
                if tag[1]:
                    badp[0] = 1
                    continue
                if h0 != NULL:
                    state_io(h, <floating*>h0 + (b * D + d0) * N, N, nl, False)
                else:
                    memset(h, 0, N * G * sizeof(floating))
                for c in range(C):
                    t0 = c * T
                    tn = min(T, L - t0)
                    r0 = b * L + t0
                    state_io(h, hstate + ((b * C + c) * D + d0) * N, N, nl, True)
                    if nl == G:   # full group: read and write the (M, D) rows in place
                        chunk_fwd(tn, N, zoh, delta + r0 * D + d0, u + r0 * D + d0, D,
                                  Bs + r0 * ld_bc, Cs + r0 * ld_bc, ld_bc, AT, invAT, 0, h, em1,
                                  y + r0 * D + d0, Dv)
                    else:
                        stage(dl, delta + r0 * D + d0, tn, D, nl)
                        stage(uu, u + r0 * D + d0, tn, D, nl)
                        chunk_fwd(tn, N, zoh, dl, uu, G, Bs + r0 * ld_bc, Cs + r0 * ld_bc,
                                  ld_bc, AT, invAT, 0, h, em1, yy, Dv)
                        for s in range(tn):
                            for g in range(nl):
                                y[(r0 + s) * D + d0 + g] = yy[s * G + g]
                if h_last != NULL:
                    state_io(h, h_last + (b * D + d0) * N, N, nl, True)
        mx_aligned_free(buf)
        free(tag)
    return -1 if failed else (-2 if bad else 0)


cdef int scan_backward(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                       floating* dA_log, floating* dD_vec,
                       const floating* dy, const floating* hstate,
                       const floating* u, const floating* delta,
                       const floating* Bs, const floating* Cs, idx_t ld_bc,
                       const floating* A_log, const floating* D_vec,
                       idx_t B, idx_t L, idx_t D, idx_t N,
                       int discretization, int n_threads) noexcept nogil:
    return scan_backward_state(du, ddelta, dBs, dCs, dA_log, dD_vec, <floating*>NULL, dy,
                               <floating*>NULL, hstate, u, delta, Bs, Cs, ld_bc, A_log, 0,
                               D_vec, B, L, D, N, discretization, n_threads)


cdef int scan_backward_state(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                             floating* dA_log, floating* dD_vec, floating* dh0,
                             const floating* dy, const floating* dh_last,
                             const floating* hstate,
                             const floating* u, const floating* delta,
                             const floating* Bs, const floating* Cs, idx_t ld_bc,
                             const floating* A_log, int a_given, const floating* D_vec,
                             idx_t B, idx_t L, idx_t D, idx_t N,
                             int discretization, int n_threads) noexcept nogil:
    return backward_state(du, ddelta, dBs, dCs, dA_log, dD_vec, dh0, dy, dh_last, hstate, u,
                          delta, Bs, Cs, ld_bc, A_log, a_given, D_vec, B, L, D, N,
                          discretization, 1, n_threads)


cdef int scan_backward_state_set(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                                 floating* dA_log, floating* dD_vec, floating* dh0,
                                 const floating* dy, const floating* dh_last,
                                 const floating* hstate,
                                 const floating* u, const floating* delta,
                                 const floating* Bs, const floating* Cs, idx_t ld_bc,
                                 const floating* A_log, int a_given, const floating* D_vec,
                                 idx_t B, idx_t L, idx_t D, idx_t N,
                                 int discretization, int n_threads) noexcept nogil:
    return backward_state(du, ddelta, dBs, dCs, dA_log, dD_vec, dh0, dy, dh_last, hstate, u,
                          delta, Bs, Cs, ld_bc, A_log, a_given, D_vec, B, L, D, N,
                          discretization, 0, n_threads)


cdef int backward_state(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                        floating* dA_log, floating* dD_vec, floating* dh0,
                        const floating* dy, const floating* dh_last,
                        const floating* hstate,
                        const floating* u, const floating* delta,
                        const floating* Bs, const floating* Cs, idx_t ld_bc,
                        const floating* A_log, int a_given, const floating* D_vec,
                        idx_t B, idx_t L, idx_t D, idx_t N,
                        int discretization, int add, int n_threads) noexcept nogil:
    # Deterministic: every job writes its shares of the shared gradients (dBs/dCs rows of
    # its sequence, dA_log/D_vec rows of its channels) to its own slot of partBC / partAD,
    # and these are summed afterwards in a fixed order (over channel groups, resp. over
    # sequences). So the result is bitwise the same for any thread count and timing.
    cdef idx_t T = SCAN_CHUNK, G = MX_SCAN_G, C = scan_nchunks(L), ng = (D + MX_SCAN_G - 1) // MX_SCAN_G
    cdef idx_t job, b, d0, c, t0, tn, r0, s, j, k, r, n
    cdef int nl, g, zoh = discretization == 0, failed = 0
    cdef int* failp = &failed
    cdef int nt = mx_threads(n_threads)
    cdef floating* buf = NULL
    cdef floating* AT = NULL
    cdef floating* invAT = NULL
    cdef floating* carry = NULL
    cdef floating* dAacc = NULL
    cdef floating* dDacc = NULL
    cdef floating* Dv = NULL
    cdef const floating* pdl = NULL
    cdef const floating* puu = NULL
    cdef const floating* pdy = NULL
    cdef floating* pdu = NULL
    cdef floating* pdD = NULL
    cdef idx_t ld
    cdef floating* dl = NULL
    cdef floating* uu = NULL
    cdef floating* dyy = NULL
    cdef floating* dul = NULL
    cdef floating* dDl = NULL
    cdef floating* h = NULL
    cdef floating* em1 = NULL
    cdef floating* dBC = NULL
    cdef floating* pbc = NULL
    cdef floating* sums = NULL
    cdef floating* part = NULL
    cdef floating* partBC = NULL
    cdef floating* partAD = NULL
    cdef idx_t* tag = NULL
    cdef idx_t slot
    cdef floating sum, al
    if B * D == 0 or L == 0:
        return 0
    # partBC (B, ng, L, 2N): dBs | dCs terms of each job, summed over its lanes; none
    # when ng == 1 (one job per sequence: it adds its rows into dBs / dCs directly);
    # partAD (B, ng, N+1, G): each job's dAacc (N, G) and dDacc (G,)
    cdef idx_t nbc = B * ng * L * 2 * N if ng > 1 else 0
    part = <floating*>scratch(nbc + B * ng * (N + 1) * G, sizeof(floating))
    if part == NULL:
        return -1
    partBC = part
    partAD = part + nbc
    # state updates per thread: 2^14 take ~10 us (an exponential each)
    nt = mx_team(nt, B * L * D * N, 1 << 14, B * ng)
    with parallel(num_threads=nt):
        # per thread: AT, invAT, carry, dAacc (N, G); dDacc, Dv (G,); dl, uu, dyy, dul, dDl
        # (T, G) (lane copies for a partial group); h (T+1, N, G); em1 (T, N, G);
        # dBC (T, 2N, GB): one chunk's dBs | dCs terms per lane mod GB, folded into the
        # job's slot of partBC after the chunk (independent of L: issue 12); sums (T, 2N):
        # the folded rows when ng == 1, added into dBs | dCs.
        buf = <floating*>scratch((4 * N + 2 + 5 * T + (2 * T + 1) * N) * G
                                 + 2 * T * N * (MX_SCAN_GB + 1), sizeof(floating))
        tag = <idx_t*>malloc(sizeof(idx_t))       # the d0 whose A is loaded
        if buf == NULL or tag == NULL:
            failp[0] = 1
        else:
            tag[0] = -1
        AT = buf
        invAT = AT + N * G
        carry = invAT + N * G
        dAacc = carry + N * G
        dDacc = dAacc + N * G
        Dv = dDacc + G
        dl = Dv + G
        uu = dl + T * G
        dyy = uu + T * G
        dul = dyy + T * G
        dDl = dul + T * G
        h = dDl + T * G
        em1 = h + (T + 1) * N * G
        dBC = em1 + T * N * G
        sums = dBC + 2 * T * N * MX_SCAN_GB
        for job in prange(B * ng, schedule='static'):
            if buf != NULL and tag != NULL:
                # group-major jobs (as the forward's); slot: the job's place in partBC and
                # partAD, sequence-major
                b = job % B
                d0 = (job // B) * G
                slot = b * ng + job // B
                nl = <int>min(G, D - d0)
                if tag[0] != d0:
                    load_AT(AT, invAT, Dv, A_log + d0 * N, a_given, zoh, D_vec + d0, N, nl)
                    tag[0] = d0
                memset(carry, 0, (2 * N + 1) * G * sizeof(floating))  # carry, dAacc, dDacc
                if dh_last != NULL:   # the adjoint entering from after step L-1
                    state_io(carry, <floating*>dh_last + (b * D + d0) * N, N, nl, False)
                for c in range(C - 1, -1, -1):
                    t0 = c * T
                    tn = min(T, L - t0)
                    r0 = b * L + t0
                    state_io(h, <floating*>hstate + ((b * C + c) * D + d0) * N, N, nl, False)
                    if nl == G:   # full group: read and accumulate the (M, D) rows in place
                        pdl = delta + r0 * D + d0
                        puu = u + r0 * D + d0
                        pdy = dy + r0 * D + d0
                        pdu = du + r0 * D + d0
                        pdD = ddelta + r0 * D + d0
                        ld = D
                    else:
                        stage(dl, delta + r0 * D + d0, tn, D, nl)
                        stage(uu, u + r0 * D + d0, tn, D, nl)
                        stage(dyy, dy + r0 * D + d0, tn, D, nl)
                        pdl, puu, pdy, pdu, pdD, ld = dl, uu, dyy, dul, dDl, G
                    chunk_fwd(tn, N, zoh, pdl, puu, ld, Bs + r0 * ld_bc, Cs + r0 * ld_bc,
                              ld_bc, AT, invAT, N * G, h, em1, <floating*>NULL, Dv)
                    if floating is float:
                        mx_scan_backward_chunk_f(tn, N, zoh, pdl, puu, pdy, ld, Bs + r0 * ld_bc,
                                            Cs + r0 * ld_bc, ld_bc, AT, invAT, Dv, h, em1,
                                            carry, dBC, dAacc, dDacc, pdu, pdD,
                                            add if nl == G else 0)
                    else:
                        mx_scan_backward_chunk_d(tn, N, zoh, pdl, puu, pdy, ld, Bs + r0 * ld_bc,
                                            Cs + r0 * ld_bc, ld_bc, AT, invAT, Dv, h, em1,
                                            carry, dBC, dAacc, dDacc, pdu, pdD,
                                            add if nl == G else 0)
                    # the chunk's rows of the job's slot: dBC summed over its GB lanes
                    # (ng == 1: the job owns these rows of dBs / dCs and adds into them)
                    pbc = partBC + (slot * L + t0) * 2 * N if ng > 1 else sums
                    if floating is float:
                        mx_scan_fold_f(tn * 2 * N, dBC, pbc)
                    else:
                        mx_scan_fold_d(tn * 2 * N, dBC, pbc)
                    if ng == 1:
                        for s in range(tn):
                            for k in range(N):
                                j = (r0 + s) * ld_bc + k
                                dBs[j] = (dBs[j] if add else 0) + sums[s * 2 * N + k]
                                dCs[j] = (dCs[j] if add else 0) + sums[s * 2 * N + N + k]
                    if nl < G:        # the staged lanes, written by the chunk (not added)
                        for s in range(tn):
                            for g in range(nl):
                                j = (r0 + s) * D + d0 + g
                                du[j] = (du[j] if add else 0) + dul[s * G + g]
                                ddelta[j] = (ddelta[j] if add else 0) + dDl[s * G + g]
                if dh0 != NULL:       # carry = a_bar[0] * dh[0] = dLoss/dh0
                    state_add(dh0 + (b * D + d0) * N, carry, N, nl)
                # the job's slot of dAacc, dDacc (its dBs | dCs rows were folded per chunk)
                memcpy(partAD + slot * (N + 1) * G, dAacc, (N + 1) * G * sizeof(floating))
        mx_aligned_free(buf)
        free(tag)
    if not failed and ng > 1:
        # dBs/dCs row r of sequence b: sum over the channel groups j = 0 .. ng-1
        for r in prange(B * L, schedule='static', num_threads=nt, nogil=True):
            b = r // L
            for k in range(2 * N):
                sum = 0
                for j in range(ng):
                    sum = sum + partBC[((b * ng + j) * L + r - b * L) * 2 * N + k]
                if k < N:
                    dBs[r * ld_bc + k] = (dBs[r * ld_bc + k] if add else 0) + sum
                else:
                    dCs[r * ld_bc + k - N] = (dCs[r * ld_bc + k - N] if add else 0) + sum
    if not failed:
        # dA_log (zero where the clamp is active; dA = (A dLoss/dA) / A when a_given), D_vec:
        # sum over the sequences b = 0 .. B-1
        for j in range(ng):
            d0 = j * G
            nl = <int>min(G, D - d0)
            for g in range(nl):
                for n in range(N + 1):
                    sum = 0
                    for b in range(B):
                        sum = sum + partAD[(b * ng + j) * (N + 1) * G + n * G + g]
                    if n == N:
                        dD_vec[d0 + g] += sum
                    elif a_given:
                        dA_log[(d0 + g) * N + n] += sum / A_log[(d0 + g) * N + n]
                    else:
                        al = A_log[(d0 + g) * N + n]
                        if al > A_LOG_MIN and al < A_LOG_MAX:
                            dA_log[(d0 + g) * N + n] += sum
    mx_aligned_free(part)
    return -1 if failed else 0
