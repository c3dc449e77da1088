/* mx_conv1d.h - depthwise causal conv1d jobs, float (_f) and double (_d).
 *
 * Size letters: B batch, L seqLen, D channels (dInner), K taps (dConv),
 * CB = MX_CONV_CB channels per job, KB = MX_CONV_KB taps per pass.
 * conv[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * xc[b,t-k,d]
 * (tap k = 0 multiplies the current step; zero history before t = 0).
 *
 * A plain loop nest (weights read K apart, outputs possibly aliasing inputs for the
 * compiler) ran at ~1 GFLOP/s, ~3% of size c. So one job owns CB channels (its conv /
 * dxc / dweight / dbias entries: no reduction between jobs) and transposes its taps
 * into a (KB, CB) stack tile, so every inner loop is a contiguous, vectorised pass
 * over the job's channels. The driver (mamba_ext/cpu/conv1d.pyx) runs jobs in
 * parallel and further passes for taps beyond KB.
 */
#ifndef MX_CONV1D_H
#define MX_CONV1D_H

#include <stddef.h>
#include "mx_compat.h"

#define MX_CONV_CB 64   /* channels per job */
#define MX_CONV_KB 8    /* taps per pass */

/* One job: channels [d0, d0+n) (n <= CB), taps [k0, k0+kn) (kn <= KB), all B*L rows.
   conv, dconv (B*L, D); xc (B*L rows, ld_xc apart), dxc (B*L rows, ld_dxc apart);
   weight, dweight (D, K); bias, dbias (D,).
   Forward: conv = (k0 == 0 ? bias : conv) + sum_k weight[., k] * xc[t-k].
   Backward: dxc[t-k] += dconv[t] weight[., k]; dweight[., k] += sum_t dconv[t] xc[t-k];
   dbias += sum_t dconv[t] (when k0 == 0). Buffers written must not overlap those read. */
#define MX_CONV1D_KERNELS(T, SFX)                                                       \
MX_KERNEL void mx_conv1d_forward_##SFX(T* MX_RESTRICT conv, const T* MX_RESTRICT xc,   \
        ptrdiff_t ld_xc, const T* MX_RESTRICT weight, const T* MX_RESTRICT bias,        \
        ptrdiff_t B, ptrdiff_t L, ptrdiff_t D, ptrdiff_t K,                             \
        ptrdiff_t d0, int n, ptrdiff_t k0, int kn)                                      \
{                                                                                       \
    T wt[MX_CONV_KB][MX_CONV_CB];                                                       \
    for (int kk = 0; kk < kn; kk++)                                                     \
        for (int j = 0; j < n; j++) wt[kk][j] = weight[(d0 + j) * K + k0 + kk];         \
    for (ptrdiff_t b = 0; b < B; b++)                                                   \
        for (ptrdiff_t t = 0; t < L; t++) {                                             \
            ptrdiff_t r = b * L + t;                                                    \
            T* MX_RESTRICT o = conv + r * D + d0;                                       \
            if (k0 == 0) {                                                              \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < n; j++) o[j] = bias[d0 + j];                        \
            }                                                                           \
            for (int kk = 0; kk < kn && k0 + kk <= t; kk++) {                           \
                const T* MX_RESTRICT src = xc + (r - k0 - kk) * ld_xc + d0;             \
                const T* MX_RESTRICT w = wt[kk];                                        \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < n; j++) o[j] += w[j] * src[j];                      \
            }                                                                           \
        }                                                                               \
}                                                                                       \
MX_KERNEL void mx_conv1d_backward_##SFX(T* MX_RESTRICT dxc, ptrdiff_t ld_dxc,          \
        T* MX_RESTRICT dweight, T* MX_RESTRICT dbias, const T* MX_RESTRICT dconv,       \
        const T* MX_RESTRICT xc, ptrdiff_t ld_xc, const T* MX_RESTRICT weight,          \
        ptrdiff_t B, ptrdiff_t L, ptrdiff_t D, ptrdiff_t K,                             \
        ptrdiff_t d0, int n, ptrdiff_t k0, int kn)                                      \
{                                                                                       \
    T wt[MX_CONV_KB][MX_CONV_CB], dwt[MX_CONV_KB][MX_CONV_CB];                          \
    for (int kk = 0; kk < kn; kk++)                                                     \
        for (int j = 0; j < n; j++) {                                                   \
            wt[kk][j] = weight[(d0 + j) * K + k0 + kk];                                 \
            dwt[kk][j] = 0;                                                             \
        }                                                                               \
    for (ptrdiff_t b = 0; b < B; b++)                                                   \
        for (ptrdiff_t t = 0; t < L; t++) {                                             \
            ptrdiff_t r = b * L + t;                                                    \
            const T* MX_RESTRICT g = dconv + r * D + d0;                                \
            if (k0 == 0) {                                                              \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < n; j++) dbias[d0 + j] += g[j];                      \
            }                                                                           \
            for (int kk = 0; kk < kn && k0 + kk <= t; kk++) {                           \
                const T* MX_RESTRICT src = xc + (r - k0 - kk) * ld_xc + d0;             \
                T* MX_RESTRICT di = dxc + (r - k0 - kk) * ld_dxc + d0;                  \
                const T* MX_RESTRICT w = wt[kk];                                        \
                T* MX_RESTRICT dw = dwt[kk];                                            \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < n; j++) {                                           \
                    dw[j] += g[j] * src[j];                                             \
                    di[j] += g[j] * w[j];                                               \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    for (int kk = 0; kk < kn; kk++)                                                     \
        for (int j = 0; j < n; j++) dweight[(d0 + j) * K + k0 + kk] += dwt[kk][j];      \
}

MX_KERNELS_BEGIN
MX_CONV1D_KERNELS(float, f)
MX_CONV1D_KERNELS(double, d)
MX_KERNELS_END

#endif /* MX_CONV1D_H */
