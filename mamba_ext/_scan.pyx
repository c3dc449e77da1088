# cython: language_level=3
"""Selective scan (S6): exact ZOH (or Euler) forward and chunked backward.

Size letters: B batch, L seqLen, D dInner, N dState, T = SCAN_CHUNK, nC = ceil(L/T).

Work is split into B*D independent jobs (one sequence b, one channel d), run
with prange. Per step the inner loop runs over the N states of one channel,
which are contiguous everywhere (A (D, N), the Bs/Cs rows, the per-thread state
rows): the hot loops are C below, marked `omp simd`, and in float32 they call a
branch-free expm1 so the N exponentials of a step are computed as one vector.
One exponential per (t, d, n) serves both factors: a_bar = 1 + em and
b_bar = em / A * Bs with em = expm1(Delta*A) (exact ZOH without cancellation).

Backward (vector-Jacobian product), for each job walking t downwards, with
dh = dy[t] * Cs[t] + a_bar[t+1] * dh[t+1] (the carry):
  dCs[t,n] += dy[t] h[t,n];   dBs[t,n] += dh u[t] f;   du[t] += sum_n dh f Bs + dy D_vec
  dDelta[t] += sum_n dh h[t-1] a_bar A + dh u Bs a_bar   (ZOH, f = em/A, df/dDelta = a_bar)
  dA_log[n] += A * dLoss/dA = dh h[t-1] a_bar Delta A + dh u Bs (Delta a_bar - f)
(in Euler f = Delta, so the Bs term of dDelta is dh u Bs and it adds nothing to dA_log).
A_log outside the open interval (-10, 5) gets exactly zero gradient (clamp).

The states inside a chunk are recomputed from the stored chunk-entry state by
the same code as the forward, so they are bitwise the forward's states.
Per-job gradients of shared tensors (dBs/dCs rows of sequence b, dA_log and
D_vec row d) are summed in per-thread buffers and added under a critical
section: dBs/dCs once per sequence a thread visits, dA_log once per job.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.math cimport exp
from cython.parallel cimport prange, parallel
from mamba_ext._types cimport floating, idx_t

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifdef _OPENMP
    #include <omp.h>
    #define MX_PRAGMA(x) _Pragma(#x)
    #else
    #define MX_PRAGMA(x)
    #endif
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    /* Runtime dispatch to AVX-512 / AVX2+FMA clones of the scan loops (wider vectors). */
    #define MX_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
    #else
    #define MX_CLONES
    #endif
    typedef Py_ssize_t mx_idx;

    static inline int mx_threads(int n) {
    #ifdef _OPENMP
        return n > 0 ? n : omp_get_max_threads();
    #else
        return 1;
    #endif
    }

    /* expm1 in float32, branch-free so that loops over it vectorise; a few ulp on
       [-87, 88] (tested against expm1 in double). |x| < 0.5: Taylor polynomial to
       x^8 (truncation < 2e-8 relative). Otherwise exp(x) - 1 with exp(x) = 2^k e^r,
       |r| <= ln2/2, k by the 1.5*2^23 rounding trick, e^r by Cephes' expf polynomial. */
    static inline float mx_expm1f(float x) {
        float xs = x > -87.0f ? x : -87.0f;          /* NaN -> -87 here, kept in p */
        xs = xs < 88.0f ? xs : 88.0f;
        float p = x * (1.0f + x * (0.5f + x * (1.66666672e-1f + x * (4.16666679e-2f
                  + x * (8.33333377e-3f + x * (1.38888892e-3f + x * (1.98412701e-4f
                  + x * 2.48015876e-5f)))))));
        float kf = (xs * 1.44269504f + 12582912.0f) - 12582912.0f;
        float r = (xs - kf * 0.693359375f) + kf * 2.12194440e-4f;
        float e = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
                  + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * r * r
                  + r + 1.0f;
        int32_t bits = ((int32_t)kf + 127) << 23;
        float s;
        memcpy(&s, &bits, sizeof s);
        float big = e * s - 1.0f;
        return (x < -0.5f || x > 0.5f) ? big : p;
    }

    /* One chunk of the forward recurrence for one (b, d) job.
       Delta, u, y: n_steps values ld apart; Bs, Cs: rows ld_bc apart; A, invA (N,);
       h (n_steps+1, N): row 0 is the entering state, row s+1 the state after step s;
       em (n_steps, N) = expm1(Delta*A) per step; y may be NULL. */
    #define MX_SCAN_KERNELS(T, SFX, EXPM1)                                              \\
    static MX_CLONES void mx_scan_chunk_fwd_##SFX(mx_idx n_steps, mx_idx N, int zoh,   \\
            const T* restrict Delta, const T* restrict u, mx_idx ld,                    \\
            const T* restrict Bs, const T* restrict Cs, mx_idx ld_bc,                   \\
            const T* restrict A, const T* restrict invA, T Dv,                          \\
            T* restrict h, T* restrict em1, T* restrict y)                              \\
    {                                                                                   \\
        for (mx_idx s = 0; s < n_steps; s++) {                                          \\
            const T dlt = Delta[s * ld], uu = u[s * ld];                                \\
            const T* restrict Bt = Bs + s * ld_bc;                                      \\
            const T* restrict Ct = Cs + s * ld_bc;                                      \\
            const T* restrict hp = h + s * N;                                           \\
            T* restrict hc = h + (s + 1) * N;                                           \\
            T* restrict e = em1 + s * N;                                                \\
            T acc = 0;                                                                  \\
            MX_PRAGMA(omp simd reduction(+:acc))                                        \\
            for (mx_idx n = 0; n < N; n++) {                                            \\
                T em = EXPM1(dlt * A[n]);                                               \\
                T bb = (zoh ? em * invA[n] : dlt) * Bt[n];                              \\
                T hn = (1 + em) * hp[n] + bb * uu;                                      \\
                e[n] = em;                                                              \\
                hc[n] = hn;                                                             \\
                acc += Ct[n] * hn;                                                      \\
            }                                                                           \\
            if (y) y[s * ld] = acc + Dv * uu;                                           \\
        }                                                                               \\
    }                                                                                   \\
    /* Backward through one chunk, steps n_steps-1 .. 0, given h and em1 of the chunk  \\
       forward. carry (N,) = a_bar[t+1] * dh[t+1] in/out; dBC (n_steps, 2N) rows      \\
       [dBs | dCs] +=; dAacc (N,) += (A times dLoss/dA); *dDacc +=; du, dDelta +=. */   \\
    static MX_CLONES void mx_scan_chunk_bwd_##SFX(mx_idx n_steps, mx_idx N, int zoh,   \\
            const T* restrict Delta, const T* restrict u, const T* restrict dy,         \\
            mx_idx ld, const T* restrict Bs, const T* restrict Cs, mx_idx ld_bc,        \\
            const T* restrict A, const T* restrict invA, T Dv,                          \\
            const T* restrict h, const T* restrict em1,                                 \\
            T* restrict carry, T* restrict dBC, T* restrict dAacc, T* restrict dDacc,   \\
            T* restrict du, T* restrict dDelta)                                         \\
    {                                                                                   \\
        T dD = 0;                                                                       \\
        for (mx_idx s = n_steps - 1; s >= 0; s--) {                                     \\
            const T dlt = Delta[s * ld], uu = u[s * ld], g = dy[s * ld];                \\
            const T* restrict Bt = Bs + s * ld_bc;                                      \\
            const T* restrict Ct = Cs + s * ld_bc;                                      \\
            const T* restrict hp = h + s * N;                                           \\
            const T* restrict hc = h + (s + 1) * N;                                     \\
            const T* restrict e = em1 + s * N;                                          \\
            T* restrict dB = dBC + s * 2 * N;                                           \\
            T* restrict dC = dB + N;                                                    \\
            T dus = 0, dds = 0;                                                         \\
            MX_PRAGMA(omp simd reduction(+:dus, dds))                                   \\
            for (mx_idx n = 0; n < N; n++) {                                            \\
                T em = e[n], ab = 1 + em;                                               \\
                T f = zoh ? em * invA[n] : dlt;                                         \\
                T dh = g * Ct[n] + carry[n];                                            \\
                T dab = dh * hp[n];                                                     \\
                T bterm = dh * uu * Bt[n];                                              \\
                dB[n] += dh * uu * f;                                                   \\
                dC[n] += g * hc[n];                                                     \\
                dus += dh * f * Bt[n];                                                  \\
                dds += dab * ab * A[n] + (zoh ? bterm * ab : bterm);                    \\
                dAacc[n] += dab * ab * dlt * A[n] + (zoh ? bterm * (dlt * ab - f) : 0); \\
                carry[n] = ab * dh;                                                     \\
            }                                                                           \\
            du[s * ld] += dus + g * Dv;                                                 \\
            dDelta[s * ld] += dds;                                                      \\
            dD += g * uu;                                                               \\
        }                                                                               \\
        *dDacc += dD;                                                                   \\
    }                                                                                   \\
    /* Add a thread's dBs/dCs rows (rows, 2N) into the shared rows (ld_bc apart). */    \\
    static void mx_flush_bc_##SFX(T* dBs, T* dCs, mx_idx ld_bc, const T* buf,          \\
                                  mx_idx rows, mx_idx N)                                \\
    {                                                                                   \\
        MX_PRAGMA(omp critical(mamba_ext_scan_bc))                                      \\
        for (mx_idx r = 0; r < rows; r++)                                               \\
            for (mx_idx n = 0; n < N; n++) {                                            \\
                dBs[r * ld_bc + n] += buf[r * 2 * N + n];                               \\
                dCs[r * ld_bc + n] += buf[r * 2 * N + N + n];                           \\
            }                                                                           \\
    }                                                                                   \\
    /* Add one job's dA_log row (zero where the clamp is active) and dD_vec entry. */  \\
    static void mx_flush_d_##SFX(T* dA_row, const T* acc, const T* A_log_row,           \\
                                 mx_idx N, T* dD, T dDacc)                              \\
    {                                                                                   \\
        MX_PRAGMA(omp critical(mamba_ext_scan_d))                                       \\
        {                                                                               \\
            for (mx_idx n = 0; n < N; n++)                                              \\
                if (A_log_row[n] > -10 && A_log_row[n] < 5) dA_row[n] += acc[n];        \\
            *dD += dDacc;                                                               \\
        }                                                                               \\
    }

    MX_SCAN_KERNELS(float, f, mx_expm1f)
    MX_SCAN_KERNELS(double, d, expm1)
    """
    int mx_threads(int n) noexcept nogil
    float mx_expm1f(float x) noexcept nogil
    void mx_scan_chunk_fwd_f(idx_t, idx_t, int, const float*, const float*, idx_t,
                             const float*, const float*, idx_t, const float*, const float*,
                             float, float*, float*, float*) noexcept nogil
    void mx_scan_chunk_fwd_d(idx_t, idx_t, int, const double*, const double*, idx_t,
                             const double*, const double*, idx_t, const double*, const double*,
                             double, double*, double*, double*) noexcept nogil
    void mx_scan_chunk_bwd_f(idx_t, idx_t, int, const float*, const float*, const float*, idx_t,
                             const float*, const float*, idx_t, const float*, const float*, float,
                             const float*, const float*, float*, float*, float*, float*,
                             float*, float*) noexcept nogil
    void mx_scan_chunk_bwd_d(idx_t, idx_t, int, const double*, const double*, const double*, idx_t,
                             const double*, const double*, idx_t, const double*, const double*, double,
                             const double*, const double*, double*, double*, double*, double*,
                             double*, double*) noexcept nogil
    void mx_flush_bc_f(float*, float*, idx_t, const float*, idx_t, idx_t) noexcept nogil
    void mx_flush_bc_d(double*, double*, idx_t, const double*, idx_t, idx_t) noexcept nogil
    void mx_flush_d_f(float*, const float*, const float*, idx_t, float*, float) noexcept nogil
    void mx_flush_d_d(double*, const double*, const double*, idx_t, double*, double) noexcept nogil


def expm1f_vec(float[::1] x not None, float[::1] out not None):
    """out = float32 expm1 of x with the scan's vectorised kernel (for tests)."""
    cdef idx_t i
    for i in range(min(x.shape[0], out.shape[0])):
        out[i] = mx_expm1f(x[i])


cdef idx_t scan_nchunks(idx_t L) noexcept nogil:
    return (L + SCAN_CHUNK - 1) // SCAN_CHUNK


cdef inline void load_A(floating* A, floating* invA, const floating* A_log_row,
                        idx_t N) noexcept nogil:
    # A (N,) = -exp(clamp(A_log, -10, 5)); invA = 1/A
    cdef idx_t n
    cdef double a
    for n in range(N):
        a = A_log_row[n]
        a = -10.0 if a < -10.0 else (5.0 if a > 5.0 else a)
        A[n] = <floating>(-exp(a))
        invA[n] = 1 / A[n]


cdef inline void chunk_fwd(idx_t tn, idx_t N, int zoh, const floating* Delta,
                           const floating* u, idx_t ld, const floating* Bs,
                           const floating* Cs, idx_t ld_bc, const floating* A,
                           const floating* invA, floating Dv, floating* h,
                           floating* em1, floating* y) noexcept nogil:
    if floating is float:
        mx_scan_chunk_fwd_f(tn, N, zoh, Delta, u, ld, Bs, Cs, ld_bc, A, invA, Dv, h, em1, y)
    else:
        mx_scan_chunk_fwd_d(tn, N, zoh, Delta, u, ld, Bs, Cs, ld_bc, A, invA, Dv, h, em1, y)


cdef int scan_forward(floating* y, floating* hstates,
                      const floating* u, const floating* Delta,
                      const floating* Bs, const floating* Cs, idx_t ld_bc,
                      const floating* A_log, const floating* D_vec,
                      idx_t B, idx_t L, idx_t D, idx_t N,
                      int discretization, int n_threads) noexcept nogil:
    cdef idx_t T = SCAN_CHUNK, nC = scan_nchunks(L)
    cdef idx_t job, b, d, c, t0, tn, r0
    cdef int zoh = discretization == 0, failed = 0
    cdef int* failp = &failed
    cdef int nt = mx_threads(n_threads)
    cdef floating* buf = NULL
    cdef floating* A = NULL
    cdef floating* invA = NULL
    cdef floating* h = NULL
    cdef floating* em1 = NULL
    if B * D == 0 or L == 0:
        return 0
    nt = <int>min(<idx_t>nt, B * D)
    with parallel(num_threads=nt):
        # per thread: A, invA (N,); h (T+1, N); em1 (T, N)
        buf = <floating*>malloc(((2 * T + 3) * N) * sizeof(floating))
        if buf == NULL:
            failp[0] = 1
        A = buf
        invA = buf + N
        h = buf + 2 * N
        em1 = h + (T + 1) * N
        for job in prange(B * D, schedule='static'):
            if buf != NULL:
                b = job // D
                d = job % D
                load_A(A, invA, A_log + d * N, N)
                memset(h, 0, N * sizeof(floating))
                for c in range(nC):
                    t0 = c * T
                    tn = min(T, L - t0)
                    r0 = b * L + t0
                    if c > 0:  # entering state = last state of the previous chunk
                        memcpy(h, h + T * N, N * sizeof(floating))
                    memcpy(hstates + ((b * nC + c) * D + d) * N, h, N * sizeof(floating))
                    chunk_fwd(tn, N, zoh, Delta + r0 * D + d, u + r0 * D + d, D,
                              Bs + r0 * ld_bc, Cs + r0 * ld_bc, ld_bc, A, invA, D_vec[d],
                              h, em1, y + r0 * D + d)
        free(buf)
    return -1 if failed else 0


cdef int scan_backward(floating* du, floating* dDelta, floating* dBs, floating* dCs,
                       floating* dA_log, floating* dD_vec,
                       const floating* dy, const floating* hstates,
                       const floating* u, const floating* Delta,
                       const floating* Bs, const floating* Cs, idx_t ld_bc,
                       const floating* A_log, const floating* D_vec,
                       idx_t B, idx_t L, idx_t D, idx_t N,
                       int discretization, int n_threads) noexcept nogil:
    cdef idx_t T = SCAN_CHUNK, nC = scan_nchunks(L)
    cdef idx_t job, b, d, c, t0, tn, r0
    cdef int zoh = discretization == 0, failed = 0
    cdef int* failp = &failed
    cdef int nt = mx_threads(n_threads)
    cdef floating* buf = NULL
    cdef floating* A = NULL
    cdef floating* invA = NULL
    cdef floating* h = NULL
    cdef floating* em1 = NULL
    cdef floating* carry = NULL
    cdef floating* dAacc = NULL
    cdef floating* dBC = NULL
    cdef floating dDacc
    cdef idx_t* cur_b = NULL
    if B * D == 0 or L == 0:
        return 0
    nt = <int>min(<idx_t>nt, B * D)
    with parallel(num_threads=nt):
        # per thread: A, invA, carry, dAacc (N,); h (T+1, N); em1 (T, N);
        # dBC (L, 2N) = this thread's dBs | dCs rows of sequence cur_b[0]
        buf = <floating*>malloc(((2 * T + 5) * N + 2 * L * N) * sizeof(floating))
        cur_b = <idx_t*>malloc(sizeof(idx_t))
        if buf == NULL or cur_b == NULL:
            failp[0] = 1
        else:
            cur_b[0] = -1
        A = buf
        invA = buf + N
        carry = buf + 2 * N
        dAacc = buf + 3 * N
        h = buf + 4 * N
        em1 = h + (T + 1) * N
        dBC = em1 + T * N
        for job in prange(B * D, schedule='static'):
            if buf != NULL and cur_b != NULL:
                b = job // D
                d = job % D
                if b != cur_b[0]:
                    if cur_b[0] >= 0:
                        flush_bc(dBs + cur_b[0] * L * ld_bc, dCs + cur_b[0] * L * ld_bc,
                                 ld_bc, dBC, L, N)
                    memset(dBC, 0, 2 * L * N * sizeof(floating))
                    cur_b[0] = b
                load_A(A, invA, A_log + d * N, N)
                memset(carry, 0, 2 * N * sizeof(floating))   # carry and dAacc
                dDacc = 0
                for c in range(nC - 1, -1, -1):
                    t0 = c * T
                    tn = min(T, L - t0)
                    r0 = b * L + t0
                    memcpy(h, hstates + ((b * nC + c) * D + d) * N, N * sizeof(floating))
                    chunk_fwd(tn, N, zoh, Delta + r0 * D + d, u + r0 * D + d, D,
                              Bs + r0 * ld_bc, Cs + r0 * ld_bc, ld_bc, A, invA, D_vec[d],
                              h, em1, <floating*>NULL)
                    if floating is float:
                        mx_scan_chunk_bwd_f(tn, N, zoh, Delta + r0 * D + d, u + r0 * D + d,
                                            dy + r0 * D + d, D, Bs + r0 * ld_bc, Cs + r0 * ld_bc,
                                            ld_bc, A, invA, D_vec[d], h, em1, carry,
                                            dBC + t0 * 2 * N, dAacc, &dDacc,
                                            du + r0 * D + d, dDelta + r0 * D + d)
                    else:
                        mx_scan_chunk_bwd_d(tn, N, zoh, Delta + r0 * D + d, u + r0 * D + d,
                                            dy + r0 * D + d, D, Bs + r0 * ld_bc, Cs + r0 * ld_bc,
                                            ld_bc, A, invA, D_vec[d], h, em1, carry,
                                            dBC + t0 * 2 * N, dAacc, &dDacc,
                                            du + r0 * D + d, dDelta + r0 * D + d)
                if floating is float:
                    mx_flush_d_f(dA_log + d * N, dAacc, A_log + d * N, N, dD_vec + d, dDacc)
                else:
                    mx_flush_d_d(dA_log + d * N, dAacc, A_log + d * N, N, dD_vec + d, dDacc)
        if buf != NULL and cur_b != NULL and cur_b[0] >= 0:
            flush_bc(dBs + cur_b[0] * L * ld_bc, dCs + cur_b[0] * L * ld_bc, ld_bc, dBC, L, N)
        free(buf)
        free(cur_b)
    return -1 if failed else 0


cdef inline void flush_bc(floating* dBs, floating* dCs, idx_t ld_bc, const floating* buf,
                          idx_t rows, idx_t N) noexcept nogil:
    if floating is float:
        mx_flush_bc_f(dBs, dCs, ld_bc, buf, rows, N)
    else:
        mx_flush_bc_d(dBs, dCs, ld_bc, buf, rows, N)
