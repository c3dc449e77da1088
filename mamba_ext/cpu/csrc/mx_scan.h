/* mx_scan.h - the hot loops of the chunked selective scan (S6), float (_f) and double (_d).
 *
 * Size letters: N dState, G = MX_SCAN_G lanes (consecutive channels of dInner),
 * GB = MX_SCAN_GB, n_steps <= SCAN_CHUNK steps of one chunk.
 * The driver (job split, chunk loop, lane staging, deterministic reductions) is
 * mamba_ext/cpu/scan.pyx; its "Design:" note explains the layout.
 *
 * Lanes: every kernel works on G consecutive channels at once, one vector lane per
 * channel, so no step needs a horizontal sum. Buffers marked (.., G) hold one value
 * per lane, lane index innermost. Per (t, d, n) ONE exponential serves both factors:
 * em = expm1(delta*A), a_bar = 1 + em, b_bar = em / A * Bs (exact ZOH, no
 * cancellation) or delta * Bs (Euler).
 */
#ifndef MX_SCAN_H
#define MX_SCAN_H

#include <math.h>
#include <stddef.h>
#include "mx_compat.h"
#include "mx_math.h"

typedef ptrdiff_t mx_idx;

/* G = 64 lanes (four AVX-512 vectors) took ~25% less scan time than 16 at size c. */
#define MX_SCAN_G 64
/* dBs/dCs terms are kept per lane of one 16-lane slice: the G lanes are folded to
   MX_SCAN_GB (vertical adds) before they are stored, so the per-thread (T, 2N, GB)
   buffer stays G/GB times smaller. */
#define MX_SCAN_GB 16

/* mx_scan_forward_chunk: one chunk of the forward recurrence for one (b, channel group) job.
     delta, u (n_steps rows ld apart, G lanes each): read in place (ld = D) for a full
       group, from (n_steps, G) lane copies (ld = G) for a partial one;
     Bs, Cs (n_steps rows ld_bc apart, N each): shared by all lanes;
     A, A_inv (N, G): A (< 0) and 1/A; a step whose deltas are none negative (the
       softplus of a block) has delta*A <= 0 (or NaN) and takes EXPM1_LE88, the
       exponential without its overflow select (the same values there); a step with one
       negative delta takes EXPM1;
     h: hstep = N*G keeps every state, h (n_steps+1, N, G), row 0 the entering state,
       row s+1 the state after step s (the backward's recomputation); hstep = 0 (the
       forward) updates one state h (N, G) in place, so the working set stays in L1;
     em1 (n_steps, N, G) = expm1(delta*A) when hstep = N*G; not written when hstep = 0
       (may be NULL then);
     y (n_steps rows ld apart, G) = sum_n Cs*h + D_lane*u, D_lane (G,) the lanes' D_vec;
       y may be NULL. */
/* one step of the forward for G lanes of state n (the body of mx_scan_forward_chunk);
   STORE_EM: whether em goes to e (the backward's recomputation keeps it) */
#define MX_SCAN_FORWARD_LANES(T, EXPM1, SIMD_EXPM1, STORE_EM)                             \
            MX_SIMD_IF(SIMD_EXPM1)                                                      \
            for (int g = 0; g < MX_SCAN_G; g++) {                                       \
                T em = EXPM1(ds[g] * a[g]), iag = ia[g];  /* plain loads, no masks */   \
                T bb = (zoh ? em * iag : ds[g]) * b;                                    \
                T hn = (1 + em) * hp[g] + bb * us[g];                                   \
                if (STORE_EM) e[g] = em;                                                \
                hc[g] = hn;                                                             \
                acc[g] += c * hn;                                                       \
            }
/* one step of the backward for G lanes of state n (the body of mx_scan_backward_chunk),
   ZOH 1 or 0 (Euler, f = delta). With dab = dh h[t-1] and bterm = dh u Bs:
     ZOH:   ddelta += a_bar (dab A + bterm);  A dLoss/dA += delta a_bar (dab A + bterm)
                                                             - bterm f
     Euler: ddelta += dab a_bar A + bterm;    A dLoss/dA += dab a_bar A delta
   (the maths of scan.pyx's Design note, its common factors taken out). */
#define MX_SCAN_BACKWARD_LANES(T, ZOH)                                                  \
            MX_OMP_SIMD                                                                 \
            for (int g = 0; g < MX_SCAN_G; g++) {                                       \
                T em = e[g], ab = 1 + em, dsg = ds[g];                                  \
                T f = ZOH ? em * ia[g] : dsg;                                           \
                T dh = gs[g] * c + cr[g];                                               \
                T dab = dh * hp[g];                                                     \
                T dhu = dh * us[g];                                                     \
                T bterm = dhu * b;                                                      \
                tB[g] = dhu * f;                                                        \
                tC[g] = gs[g] * hc[g];                                                  \
                dus[g] += dh * f * b;                                                   \
                if (ZOH) {                                                              \
                    T v = ab * (dab * a[g] + bterm);                                    \
                    dds[g] += v;                                                        \
                    dA[g] += dsg * v - bterm * f;                                       \
                } else {                                                                \
                    T q = dab * ab * a[g];                                              \
                    dds[g] += q + bterm;                                                \
                    dA[g] += q * dsg;                                                   \
                }                                                                       \
                cr[g] = ab * dh;                                                        \
            }
#define MX_SCAN_KERNELS(T, SFX, EXPM1, EXPM1_LE88, SIMD_EXPM1)                          \
MX_KERNEL void mx_scan_forward_chunk_##SFX(mx_idx n_steps, mx_idx N, int zoh,          \
        const T* MX_RESTRICT delta, const T* MX_RESTRICT u, mx_idx ld,                  \
        const T* MX_RESTRICT Bs, const T* MX_RESTRICT Cs, mx_idx ld_bc,                 \
        const T* MX_RESTRICT A, const T* MX_RESTRICT A_inv, mx_idx hstep,               \
        T* MX_RESTRICT h, T* MX_RESTRICT em1, T* MX_RESTRICT y,                         \
        const T* MX_RESTRICT D_lane)                                                    \
{                                                                                       \
    for (mx_idx s = 0; s < n_steps; s++) {                                              \
        const T* MX_RESTRICT ds = delta + s * ld;                                       \
        const T* MX_RESTRICT us = u + s * ld;                                           \
        T acc[MX_SCAN_G];                                                               \
        int up = 0;               /* a delta < 0: delta*A (A < 0) may exceed 88 */      \
        for (int g = 0; g < MX_SCAN_G; g++) {                                           \
            acc[g] = 0;                                                                 \
            up |= ds[g] < 0;                                                            \
        }                                                                               \
        for (mx_idx n = 0; n < N; n++) {                                                \
            const T b = Bs[s * ld_bc + n], c = Cs[s * ld_bc + n];                       \
            const T* MX_RESTRICT a = A + n * MX_SCAN_G;                                 \
            const T* MX_RESTRICT ia = A_inv + n * MX_SCAN_G;                            \
            const T* hp = h + s * hstep + n * MX_SCAN_G;   /* hp == hc if hstep == 0 */ \
            T* hc = h + (s + 1) * hstep + n * MX_SCAN_G;                                \
            T* MX_RESTRICT e = em1 + s * hstep + n * MX_SCAN_G;                         \
            if (up && hstep)                                                            \
                MX_SCAN_FORWARD_LANES(T, EXPM1, SIMD_EXPM1, 1)                          \
            else if (up)                                                                \
                MX_SCAN_FORWARD_LANES(T, EXPM1, SIMD_EXPM1, 0)                          \
            else if (hstep)                                                             \
                MX_SCAN_FORWARD_LANES(T, EXPM1_LE88, SIMD_EXPM1, 1)                     \
            else                                                                        \
                MX_SCAN_FORWARD_LANES(T, EXPM1_LE88, SIMD_EXPM1, 0)                     \
        }                                                                               \
        if (y)                                                                          \
            for (int g = 0; g < MX_SCAN_G; g++) y[s * ld + g] = acc[g] + D_lane[g] * us[g]; \
    }                                                                                   \
}                                                                                       \
/* mx_scan_backward_chunk: steps n_steps-1 .. 0 of one chunk, given h and em1 of the chunk's \
   recomputed forward (hstep = N*G). delta, u, dy, du, ddelta: rows ld apart, as delta \
   in the forward; carry (N, G) = a_bar[t+1] * dh[t+1], in/out;                         \
   dBC (n_steps, 2N, GB) = [dBs | dCs] terms per lane mod GB (written, not read; summed \
   by the driver);                                                                      \
   dA_acc (N, G) += A * dLoss/dA; dD_acc (G,) += dy*u (dLoss/dD_vec);                   \
   du (+)= scan part + dy*D_lane; ddelta (+)= scan part: added to where add != 0, else  \
   written (not read). */                                                               \
MX_KERNEL void mx_scan_backward_chunk_##SFX(mx_idx n_steps, mx_idx N, int zoh,         \
        const T* MX_RESTRICT delta, const T* MX_RESTRICT u, const T* MX_RESTRICT dy,    \
        mx_idx ld, const T* MX_RESTRICT Bs, const T* MX_RESTRICT Cs, mx_idx ld_bc,      \
        const T* MX_RESTRICT A, const T* MX_RESTRICT A_inv, const T* MX_RESTRICT D_lane,\
        const T* MX_RESTRICT h, const T* MX_RESTRICT em1,                               \
        T* MX_RESTRICT carry, T* MX_RESTRICT dBC, T* MX_RESTRICT dA_acc,                \
        T* MX_RESTRICT dD_acc, T* MX_RESTRICT du, T* MX_RESTRICT ddelta, int add)       \
{                                                                                       \
    for (mx_idx s = n_steps - 1; s >= 0; s--) {                                         \
        const T* MX_RESTRICT ds = delta + s * ld;                                       \
        const T* MX_RESTRICT us = u + s * ld;                                           \
        const T* MX_RESTRICT gs = dy + s * ld;                                          \
        T dus[MX_SCAN_G], dds[MX_SCAN_G];                                               \
        for (int g = 0; g < MX_SCAN_G; g++) { dus[g] = 0; dds[g] = 0; }                 \
        for (mx_idx n = 0; n < N; n++) {                                                \
            const T b = Bs[s * ld_bc + n], c = Cs[s * ld_bc + n];                       \
            const T* MX_RESTRICT a = A + n * MX_SCAN_G;                                 \
            const T* MX_RESTRICT ia = A_inv + n * MX_SCAN_G;                            \
            const T* MX_RESTRICT hp = h + (s * N + n) * MX_SCAN_G;                      \
            const T* MX_RESTRICT hc = h + ((s + 1) * N + n) * MX_SCAN_G;                \
            const T* MX_RESTRICT e = em1 + (s * N + n) * MX_SCAN_G;                     \
            T* MX_RESTRICT cr = carry + n * MX_SCAN_G;                                  \
            T* MX_RESTRICT dB = dBC + (s * 2 * N + n) * MX_SCAN_GB;                     \
            T* MX_RESTRICT dC = dBC + (s * 2 * N + N + n) * MX_SCAN_GB;                 \
            T tB[MX_SCAN_G], tC[MX_SCAN_G];                                             \
            T* MX_RESTRICT dA = dA_acc + n * MX_SCAN_G;                                 \
            if (zoh)                                                                    \
                MX_SCAN_BACKWARD_LANES(T, 1)                                            \
            else                                                                        \
                MX_SCAN_BACKWARD_LANES(T, 0)                                            \
            /* the G lanes folded to GB in order (lane g + GB, then g + 2 GB, ...), as   \
               one vector loop over g: written as nested loops, GCC added them one     \
               float at a time (docs/performance.md, session 45) */                    \
            MX_OMP_SIMD                                                                 \
            for (int g = 0; g < MX_SCAN_GB; g++) {                                      \
                T sb = tB[g], sc = tC[g];                                               \
                for (int j = MX_SCAN_GB; j < MX_SCAN_G; j += MX_SCAN_GB) {              \
                    sb += tB[j + g];                                                    \
                    sc += tC[j + g];                                                    \
                }                                                                       \
                dB[g] = sb;                                                             \
                dC[g] = sc;                                                             \
            }                                                                           \
        }                                                                               \
        for (int g = 0; g < MX_SCAN_G; g++) {                                           \
            du[s * ld + g] = (add ? du[s * ld + g] : 0) + (dus[g] + gs[g] * D_lane[g]); \
            ddelta[s * ld + g] = (add ? ddelta[s * ld + g] : 0) + dds[g];               \
            dD_acc[g] += gs[g] * us[g];                                                 \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
/* mx_scan_fold: sums (n_rows,) = each row of dBC (n_rows, GB) summed over its GB lanes \
   in lane order (a fixed order: the gradients stay bitwise reproducible). A kernel of  \
   its own so that the compiler vectorises it across rows. */                           \
MX_KERNEL void mx_scan_fold_##SFX(mx_idx n_rows, const T* MX_RESTRICT dBC,             \
        T* MX_RESTRICT sums)                                                            \
{                                                                                       \
    for (mx_idx k = 0; k < n_rows; k++) {                                               \
        T sum = 0;                                                                      \
        for (int g = 0; g < MX_SCAN_GB; g++) sum = sum + dBC[k * MX_SCAN_GB + g];       \
        sums[k] = sum;                                                                  \
    }                                                                                   \
}

/* SIMD_EXPM1 1 for float: the inline mx_expm1f_unsigned_zero vectorises (`omp simd`);
   0 for double: libm's expm1, which no compiler vectorises */
MX_KERNELS_BEGIN
MX_SCAN_KERNELS(float, f, mx_expm1f_unsigned_zero, mx_expm1f_le88, 1)
MX_SCAN_KERNELS(double, d, expm1, expm1, 0)
MX_KERNELS_END

#endif /* MX_SCAN_H */
