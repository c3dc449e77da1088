/* mx_conv1d.h - depthwise causal conv1d jobs, float (_f) and double (_d).
 *
 * Size letters: B batch, L seqLen, D channels (dInner), K taps (dConv), M = B*L rows,
 * CB = MX_CONV_CB channels per job, KB = MX_CONV_KB taps per pass, RB rows per job.
 * conv[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * xc[b,t-k,d]
 * (tap k = 0 multiplies the current step; zero history before t = 0).
 *
 * A job is a block of rows [r0, r1) (of the flattened B*L rows; a block may span
 * sequences, t is tracked per row) times a block of at most CB channels, with its taps
 * transposed into a (KB, CB) stack tile, so that every inner loop is a contiguous,
 * vectorised pass over the job's channels and each row's slice is a contiguous run of
 * memory. Each vector of V = MX_CONV_V channels is summed over the taps (or the rows)
 * in registers and stored once: a store per tap, followed by loads from rows a multiple
 * of 4 KiB away, stalls on false store-to-load dependencies (4K aliasing).
 *
 * Summation order, the same for any job split: conv and dxc add their taps in the
 * order k = 0, 1, ..; the weight and bias gradients are summed per row block (partial
 * sums, `dw_part` / `db_part`) and the blocks are then added in order by
 * mx_conv1d_reduce; the driver (mamba_ext/cpu/conv1d.pyx) fixes the row blocks from
 * M alone, so the results do not depend on the thread count.
 */
#ifndef MX_CONV1D_H
#define MX_CONV1D_H

#include <stddef.h>
#include "mx_compat.h"

#define MX_CONV_CB 256  /* channels per job */
#define MX_CONV_KB 8    /* taps per pass */
#define MX_CONV_V 16    /* channels summed in registers at a time (one AVX-512 float vector) */

/* One job: rows [r0, r1), channels [d0, d0+n) (n <= CB), taps [k0, k0+kn) (kn <= KB).
   conv, dconv (M, D); xc (M rows, ld_xc apart), dxc (M rows, ld_dxc apart);
   weight (D, K); bias (D,); dw_part (K, D) and db_part (D,): this row block's partial
   sums, written (not added to).
   Forward: conv = (k0 == 0 ? bias : conv) + sum_k weight[., k] * xc[t-k].
   Backward: dxc[t] += sum_k dconv[t+k] weight[., k] (t+k in the same sequence); with
   add 0 the pass of k0 == 0 writes dxc (the same sums into zeros; dxc not read);
   dw_part[k] = sum_t dconv[t] xc[t-k]; db_part = sum_t dconv[t] (when k0 == 0).
   Buffers written must not overlap those read. */
#define MX_CONV1D_KERNELS(T, SFX)                                                       \
MX_KERNEL void mx_conv1d_forward_##SFX(T* MX_RESTRICT conv, const T* MX_RESTRICT xc,   \
        ptrdiff_t ld_xc, const T* MX_RESTRICT weight, const T* MX_RESTRICT bias,        \
        ptrdiff_t L, ptrdiff_t D, ptrdiff_t K, ptrdiff_t r0, ptrdiff_t r1,              \
        ptrdiff_t d0, int n, ptrdiff_t k0, int kn)                                      \
{                                                                                       \
    T wt[MX_CONV_KB][MX_CONV_CB];                                                       \
    ptrdiff_t r, t = r0 % L;                                                            \
    for (int kk = 0; kk < kn; kk++)                                                     \
        for (int j = 0; j < n; j++) wt[kk][j] = weight[(d0 + j) * K + k0 + kk];         \
    for (r = r0; r < r1; r++, t = t + 1 == L ? 0 : t + 1) {                             \
        T* MX_RESTRICT o = conv + r * D + d0;                                           \
        int nk = t - k0 + 1 < kn ? (int)(t - k0 + 1) : kn;  /* taps inside the sequence */\
        /* row r - k0 of xc: formed only when a tap reaches it */                       \
        const T* MX_RESTRICT src = nk > 0 ? xc + (r - k0) * ld_xc + d0 : xc;            \
        int j0 = 0;                                                                     \
        if (nk == 4) {     /* four taps (dConv 4), all inside the sequence: one pass     \
                              over the channels, the same sums in the same order */     \
            const T* MX_RESTRICT s1 = src - ld_xc;                                      \
            const T* MX_RESTRICT s2 = s1 - ld_xc;                                       \
            const T* MX_RESTRICT s3 = s2 - ld_xc;                                       \
            const T* init = k0 == 0 ? bias + d0 : o;                                    \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < n; j++)                                                 \
                o[j] = (((init[j] + wt[0][j] * src[j]) + wt[1][j] * s1[j])              \
                        + wt[2][j] * s2[j]) + wt[3][j] * s3[j];                         \
            continue;                                                                   \
        }                                                                               \
        for (; j0 + MX_CONV_V <= n; j0 += MX_CONV_V) {                                  \
            T acc[MX_CONV_V];                                                           \
            T* oj = o + j0;                 /* oj and init: both based on o */          \
            const T* init = k0 == 0 ? bias + d0 + j0 : oj;                              \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) acc[j] = init[j];                       \
            for (int kk = 0; kk < nk; kk++) {                                           \
                const T* MX_RESTRICT s_ = src - kk * ld_xc + j0;                        \
                const T* MX_RESTRICT w = wt[kk] + j0;                                   \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < MX_CONV_V; j++) acc[j] += w[j] * s_[j];             \
            }                                                                           \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) oj[j] = acc[j];                         \
        }                                                                               \
        if (j0 < n) {                            /* the last n - j0 < V channels */     \
            if (k0 == 0)                                                                \
                for (int j = j0; j < n; j++) o[j] = bias[d0 + j];                       \
            for (int kk = 0; kk < nk; kk++) {                                           \
                const T* MX_RESTRICT s_ = src - kk * ld_xc;                             \
                const T* MX_RESTRICT w = wt[kk];                                        \
                for (int j = j0; j < n; j++) o[j] += w[j] * s_[j];                      \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
MX_KERNEL void mx_conv1d_backward_##SFX(T* MX_RESTRICT dxc, ptrdiff_t ld_dxc,          \
        T* MX_RESTRICT dw_part, T* MX_RESTRICT db_part, const T* MX_RESTRICT dconv,     \
        const T* MX_RESTRICT xc, ptrdiff_t ld_xc, const T* MX_RESTRICT weight,          \
        ptrdiff_t L, ptrdiff_t D, ptrdiff_t K, ptrdiff_t r0, ptrdiff_t r1,              \
        ptrdiff_t d0, int n, ptrdiff_t k0, int kn, int add)                             \
{                                                                                       \
    T wt[MX_CONV_KB][MX_CONV_CB];                                                       \
    T* MX_RESTRICT dwp = dw_part + k0 * D + d0;   /* this job's rows: tap kk at kk*D */ \
    const int from0 = !add && k0 == 0;            /* dxc written, not read */           \
    T* MX_RESTRICT dbp = db_part + d0;                                                  \
    ptrdiff_t r, t, t0 = r0 % L;                                                        \
    for (int kk = 0; kk < kn; kk++)                                                     \
        for (int j = 0; j < n; j++) {                                                   \
            wt[kk][j] = weight[(d0 + j) * K + k0 + kk];                                 \
            dwp[kk * D + j] = 0;                                                        \
        }                                                                               \
    /* dxc[t] += sum_k dconv[t+k] w[k]: one vector of channels summed over the taps */  \
    for (r = r0, t = t0; r < r1; r++, t = t + 1 == L ? 0 : t + 1) {                     \
        T* MX_RESTRICT di = dxc + r * ld_dxc + d0;                                      \
        int nk = L - t - k0 < kn ? (int)(L - t - k0) : kn;  /* taps inside the sequence */\
        /* row r + k0 of dconv: formed only when a tap reaches it */                    \
        const T* MX_RESTRICT g = nk > 0 ? dconv + (r + k0) * D + d0 : dconv;            \
        int j0 = 0;                                                                     \
        if (nk == 4) {     /* four taps inside the sequence: one pass, as the forward */ \
            const T* MX_RESTRICT g1 = g + D;                                            \
            const T* MX_RESTRICT g2 = g1 + D;                                           \
            const T* MX_RESTRICT g3 = g2 + D;                                           \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < n; j++)                                                 \
                di[j] = ((((from0 ? 0 : di[j]) + g[j] * wt[0][j]) + g1[j] * wt[1][j])   \
                         + g2[j] * wt[2][j]) + g3[j] * wt[3][j];                        \
            continue;                                                                   \
        }                                                                               \
        for (; j0 + MX_CONV_V <= n; j0 += MX_CONV_V) {                                  \
            T acc[MX_CONV_V];                                                           \
            T* MX_RESTRICT dij = di + j0;                                               \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) acc[j] = from0 ? 0 : dij[j];            \
            for (int kk = 0; kk < nk; kk++) {                                           \
                const T* MX_RESTRICT gk = g + kk * D + j0;                              \
                const T* MX_RESTRICT w = wt[kk] + j0;                                   \
                MX_OMP_SIMD                                                             \
                for (int j = 0; j < MX_CONV_V; j++) acc[j] += gk[j] * w[j];             \
            }                                                                           \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) dij[j] = acc[j];                        \
        }                                                                               \
        if (from0)                                     /* the last n - j0 < V channels */\
            for (int j = j0; j < n; j++) di[j] = 0;                                     \
        for (int kk = 0; kk < nk && j0 < n; kk++) {                                     \
            const T* MX_RESTRICT gk = g + kk * D;                                       \
            const T* MX_RESTRICT w = wt[kk];                                            \
            for (int j = j0; j < n; j++) di[j] += gk[j] * w[j];                         \
        }                                                                               \
    }                                                                                   \
    /* dw_part[k] = sum_t dconv[t] xc[t-k] and db_part = sum_t dconv[t], over the        \
       block's rows in row order, summed in place (the job owns these entries): an       \
       element's next update comes n/V vectors later, so the sums do not wait on each    \
       other */                                                                         \
    if (k0 == 0)                                                                        \
        for (int j = 0; j < n; j++) dbp[j] = 0;                                         \
    if (k0 == 0 && kn == 4) {     /* four taps: V channels at a time over all the rows,   \
                                     the five sums in registers (the same order: rows   \
                                     in order), stored once */                          \
        int j0 = 0;                                                                     \
        for (; j0 + MX_CONV_V <= n; j0 += MX_CONV_V) {                                  \
            T a0[MX_CONV_V], a1[MX_CONV_V], a2[MX_CONV_V], a3[MX_CONV_V], ab[MX_CONV_V]; \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) {                                       \
                a0[j] = 0; a1[j] = 0; a2[j] = 0; a3[j] = 0; ab[j] = 0;                  \
            }                                                                           \
            for (r = r0, t = t0; r < r1; r++, t = t + 1 == L ? 0 : t + 1) {             \
                const T* MX_RESTRICT g = dconv + r * D + d0 + j0;                       \
                const T* MX_RESTRICT s0 = xc + r * ld_xc + d0 + j0;                     \
                if (t >= 3) {                                                           \
                    MX_OMP_SIMD                                                         \
                    for (int j = 0; j < MX_CONV_V; j++) {                               \
                        T gj = g[j];                                                    \
                        ab[j] += gj;                                                    \
                        a0[j] += gj * s0[j];                                            \
                        a1[j] += gj * s0[j - ld_xc];                                    \
                        a2[j] += gj * s0[j - 2 * ld_xc];                                \
                        a3[j] += gj * s0[j - 3 * ld_xc];                                \
                    }                                                                   \
                } else {                                                                \
                    MX_OMP_SIMD                                                         \
                    for (int j = 0; j < MX_CONV_V; j++) {                               \
                        T gj = g[j];                                                    \
                        ab[j] += gj;                                                    \
                        a0[j] += gj * s0[j];                                            \
                        if (t >= 1) a1[j] += gj * s0[j - ld_xc];                        \
                        if (t >= 2) a2[j] += gj * s0[j - 2 * ld_xc];                    \
                    }                                                                   \
                }                                                                       \
            }                                                                           \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < MX_CONV_V; j++) {                                       \
                dbp[j0 + j] = ab[j];                                                    \
                dwp[j0 + j] = a0[j];                                                    \
                dwp[D + j0 + j] = a1[j];                                                \
                dwp[2 * D + j0 + j] = a2[j];                                            \
                dwp[3 * D + j0 + j] = a3[j];                                            \
            }                                                                           \
        }                                                                               \
        if (j0 == n)                                                                    \
            return;                                                                     \
        dbp += j0;        /* the last n - j0 < V channels: the loop below */            \
        dwp += j0;                                                                      \
        d0 += j0;                                                                       \
        n -= j0;                                                                        \
    }                                                                                   \
    for (r = r0, t = t0; r < r1; r++, t = t + 1 == L ? 0 : t + 1) {                     \
        const T* MX_RESTRICT g = dconv + r * D + d0;                                    \
        if (k0 == 0) {                                                                  \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < n; j++) dbp[j] += g[j];                                 \
        }                                                                               \
        for (int kk = 0; kk < kn && k0 + kk <= t; kk++) {                               \
            const T* MX_RESTRICT s_ = xc + (r - k0 - kk) * ld_xc + d0;                  \
            T* MX_RESTRICT dw = dwp + kk * D;                                           \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < n; j++) dw[j] += g[j] * s_[j];                          \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
/* mx_conv1d_reduce: channels [d0, d0+n) (n <= CB): dweight (D, K) += the sum over the  \
   nblk row blocks, in block order, of dw_part (nblk, K, D); dbias (D,) += likewise of   \
   db_part (nblk, D). */                                                                \
MX_KERNEL void mx_conv1d_reduce_##SFX(T* MX_RESTRICT dweight, T* MX_RESTRICT dbias,    \
        const T* MX_RESTRICT dw_part, const T* MX_RESTRICT db_part, ptrdiff_t nblk,     \
        ptrdiff_t D, ptrdiff_t K, ptrdiff_t d0, int n)                                  \
{                                                                                       \
    T acc[MX_CONV_CB];                                                                  \
    for (ptrdiff_t k = 0; k <= K; k++) {    /* k == K: the bias */                      \
        const T* MX_RESTRICT p = k < K ? dw_part + k * D + d0 : db_part + d0;           \
        ptrdiff_t stride = k < K ? K * D : D;                                           \
        for (int j = 0; j < n; j++) acc[j] = p[j];                                      \
        for (ptrdiff_t b = 1; b < nblk; b++) {                                          \
            const T* MX_RESTRICT q = p + b * stride;                                    \
            MX_OMP_SIMD                                                                 \
            for (int j = 0; j < n; j++) acc[j] += q[j];                                 \
        }                                                                               \
        if (k < K)                                                                      \
            for (int j = 0; j < n; j++) dweight[(d0 + j) * K + k] += acc[j];            \
        else                                                                            \
            for (int j = 0; j < n; j++) dbias[d0 + j] += acc[j];                        \
    }                                                                                   \
}

MX_KERNELS_BEGIN
MX_CONV1D_KERNELS(float, f)
MX_CONV1D_KERNELS(double, d)
MX_KERNELS_END

#endif /* MX_CONV1D_H */
