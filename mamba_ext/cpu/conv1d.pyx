# cython: language_level=3
"""Depthwise causal conv1d (size letters: B batch, L seqLen, D channels, K taps).

The work (B*L*D*K multiply-adds) is small next to the GEMMs and the scan, but a
plain loop nest (weights read K apart, outputs possibly aliasing inputs for the
compiler) ran at ~1 GFLOP/s, ~3% of size c. So: jobs of CB channels run in
parallel (OpenMP default thread count), each owning its channels' out / dinp /
dweight / dbias entries (no reduction), with its taps transposed into a (KB, CB)
stack tile so every inner loop is a contiguous, vectorised (restrict, AVX-512 /
AVX2 clones) pass over the CB channels. Taps beyond KB are done in further passes.
"""
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t
# (cimported for its C prelude: the MX_CLONES / MX_PRAGMA macros used below)
from mamba_ext.cpu.activations cimport mx_silu_f

cdef extern from *:
    """
    #define MX_CONV_CB 64   /* channels per job */
    #define MX_CONV_KB 8    /* taps per pass */
    /* One job: channels [d0, d0+n) (n <= CB), taps [k0, k0+kn) (kn <= KB), all B*L rows.
       out, dout (B*L, D); inp (rows ld_in apart), dinp (rows ld_dinp apart); weight (D, K).
       Forward: out = (k0 == 0 ? bias : out) + sum_k w[., k] * inp[t-k].
       Backward: dinp[t-k] += dout[t] w[., k]; dweight[., k] += sum_t dout[t] inp[t-k];
       dbias += sum_t dout[t] (when k0 == 0). Buffers written must not overlap those read. */
    #define MX_CONV_KERNELS(T, SFX)                                                        \
    static MX_CLONES void mx_conv_fwd_##SFX(T* restrict out, const T* restrict inp,      \
            Py_ssize_t ld_in, const T* restrict weight, const T* restrict bias,           \
            Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t K,                       \
            Py_ssize_t d0, int n, Py_ssize_t k0, int kn)                                  \
    {                                                                                    \
        T wt[MX_CONV_KB][MX_CONV_CB];                                                    \
        for (int kk = 0; kk < kn; kk++)                                                  \
            for (int j = 0; j < n; j++) wt[kk][j] = weight[(d0 + j) * K + k0 + kk];      \
        for (Py_ssize_t b = 0; b < B; b++)                                               \
            for (Py_ssize_t t = 0; t < L; t++) {                                         \
                Py_ssize_t r = b * L + t;                                                \
                T* restrict o = out + r * D + d0;                                        \
                if (k0 == 0) {                                                           \
                    MX_PRAGMA(omp simd)                                                  \
                    for (int j = 0; j < n; j++) o[j] = bias[d0 + j];                     \
                }                                                                        \
                for (int kk = 0; kk < kn && k0 + kk <= t; kk++) {                        \
                    const T* restrict src = inp + (r - k0 - kk) * ld_in + d0;            \
                    const T* restrict w = wt[kk];                                        \
                    MX_PRAGMA(omp simd)                                                  \
                    for (int j = 0; j < n; j++) o[j] += w[j] * src[j];                   \
                }                                                                        \
            }                                                                            \
    }                                                                                    \
    static MX_CLONES void mx_conv_bwd_##SFX(T* restrict dinp, Py_ssize_t ld_dinp,        \
            T* restrict dweight, T* restrict dbias, const T* restrict dout,              \
            const T* restrict inp, Py_ssize_t ld_in, const T* restrict weight,           \
            Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t K,                       \
            Py_ssize_t d0, int n, Py_ssize_t k0, int kn)                                  \
    {                                                                                    \
        T wt[MX_CONV_KB][MX_CONV_CB], dwt[MX_CONV_KB][MX_CONV_CB];                       \
        for (int kk = 0; kk < kn; kk++)                                                  \
            for (int j = 0; j < n; j++) {                                                \
                wt[kk][j] = weight[(d0 + j) * K + k0 + kk];                              \
                dwt[kk][j] = 0;                                                          \
            }                                                                            \
        for (Py_ssize_t b = 0; b < B; b++)                                               \
            for (Py_ssize_t t = 0; t < L; t++) {                                         \
                Py_ssize_t r = b * L + t;                                                \
                const T* restrict g = dout + r * D + d0;                                 \
                if (k0 == 0) {                                                           \
                    MX_PRAGMA(omp simd)                                                  \
                    for (int j = 0; j < n; j++) dbias[d0 + j] += g[j];                   \
                }                                                                        \
                for (int kk = 0; kk < kn && k0 + kk <= t; kk++) {                        \
                    const T* restrict src = inp + (r - k0 - kk) * ld_in + d0;            \
                    T* restrict di = dinp + (r - k0 - kk) * ld_dinp + d0;                \
                    const T* restrict w = wt[kk];                                        \
                    T* restrict dw = dwt[kk];                                            \
                    MX_PRAGMA(omp simd)                                                  \
                    for (int j = 0; j < n; j++) {                                        \
                        dw[j] += g[j] * src[j];                                          \
                        di[j] += g[j] * w[j];                                            \
                    }                                                                    \
                }                                                                        \
            }                                                                            \
        for (int kk = 0; kk < kn; kk++)                                                  \
            for (int j = 0; j < n; j++) dweight[(d0 + j) * K + k0 + kk] += dwt[kk][j];   \
    }
    MX_CONV_KERNELS(float, f)
    MX_CONV_KERNELS(double, d)
    """
    enum: MX_CONV_CB, MX_CONV_KB
    void mx_conv_fwd_f(float*, const float*, idx_t, const float*, const float*,
                       idx_t, idx_t, idx_t, idx_t, idx_t, int, idx_t, int) noexcept nogil
    void mx_conv_fwd_d(double*, const double*, idx_t, const double*, const double*,
                       idx_t, idx_t, idx_t, idx_t, idx_t, int, idx_t, int) noexcept nogil
    void mx_conv_bwd_f(float*, idx_t, float*, float*, const float*, const float*, idx_t,
                       const float*, idx_t, idx_t, idx_t, idx_t, idx_t, int, idx_t, int) noexcept nogil
    void mx_conv_bwd_d(double*, idx_t, double*, double*, const double*, const double*, idx_t,
                       const double*, idx_t, idx_t, idx_t, idx_t, idx_t, int, idx_t, int) noexcept nogil


cdef void conv1d_forward(floating* out, const floating* inp, idx_t ld_in,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # out (B, L, D); inp (B*L rows, ld_in); weight (D, K); bias (D,)
    cdef idx_t j, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn
    if B * L * D == 0:
        return
    for j in prange((D + MX_CONV_CB - 1) // MX_CONV_CB, schedule='static'):
        d0 = j * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv_fwd_f(out, inp, ld_in, weight, bias, B, L, D, K, d0, n, k0, kn)
            else:
                mx_conv_fwd_d(out, inp, ld_in, weight, bias, B, L, D, K, d0, n, k0, kn)


cdef void conv1d_backward(floating* dinp, idx_t ld_dinp, floating* dweight, floating* dbias,
                          const floating* dout, const floating* inp, idx_t ld_in,
                          const floating* weight,
                          idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # dinp (B*L rows, ld_dinp) +=; dweight (D, K) +=; dbias (D,) +=
    # dout (B, L, D); inp (B*L rows, ld_in); weight (D, K)
    cdef idx_t j, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn
    if B * L * D == 0:
        return
    for j in prange((D + MX_CONV_CB - 1) // MX_CONV_CB, schedule='static'):
        d0 = j * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv_bwd_f(dinp, ld_dinp, dweight, dbias, dout, inp, ld_in, weight,
                              B, L, D, K, d0, n, k0, kn)
            else:
                mx_conv_bwd_d(dinp, ld_dinp, dweight, dbias, dout, inp, ld_in, weight,
                              B, L, D, K, d0, n, k0, kn)
