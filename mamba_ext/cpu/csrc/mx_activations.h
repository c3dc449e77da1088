/* mx_activations.h - elementwise steps of the block over one row of n contiguous
 * values, float (suffix _f) and double (suffix _d): SiLU, softplus, the gate and
 * their backward factors. Each is one vectorised loop (MX_KERNEL: runtime dispatch
 * to AVX-512 / AVX2 clones where available); the block calls them row by row in
 * parallel (mamba_ext/cpu/block.pyx).
 *
 * Size letter: n values of one row (D, the inner width, in the block; V, the vocabulary,
 * for exp_shift in the cross-entropy of mamba_ext/cpu/model.pyx).
 *   silu(x) = x * sigmoid(x); silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
 *   softplus(x) = max(x, 0) + log1p(exp(-|x|)); softplus'(x) = sigmoid(x) = -expm1(-softplus(x))
 * float32 uses the branch-free helpers of mx_math.h, double uses libm.
 */
#ifndef MX_ACTIVATIONS_H
#define MX_ACTIVATIONS_H

#include <math.h>
#include <stddef.h>
#include "mx_compat.h"
#include "mx_math.h"

#define MX_ACTIVATION_KERNELS(T, SFX, SIGMOID, SOFTPLUS, EXPM1, EXP, SIMD)               \
/* out (n,) = silu(conv (n,)); out may alias conv (no restrict) */                       \
MX_KERNEL void mx_silu_forward_##SFX(T* out, const T* conv, ptrdiff_t n) {              \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) out[i] = conv[i] * SIGMOID(conv[i]);              \
}                                                                                        \
/* delta (n,) = softplus(delta (n,)) in place (delta_pre in, delta out) */               \
MX_KERNEL void mx_softplus_forward_##SFX(T* MX_RESTRICT delta, ptrdiff_t n) {           \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++)                                                    \
        delta[i] = SOFTPLUS(delta[i]);                                                   \
}                                                                                        \
/* gated (n,) = y (n,) * silu(z (n,)) */                                                 \
MX_KERNEL void mx_gate_forward_##SFX(T* MX_RESTRICT gated, const T* MX_RESTRICT y,      \
                                     const T* MX_RESTRICT z, ptrdiff_t n) {              \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) gated[i] = y[i] * z[i] * SIGMOID(z[i]);           \
}                                                                                        \
/* dy (n,) = dgated * silu(z); dz (n,) = dgated * y * silu'(z); dgated, y, z (n,) */     \
MX_KERNEL void mx_gate_backward_##SFX(T* MX_RESTRICT dy, T* MX_RESTRICT dz,             \
        const T* MX_RESTRICT dgated, const T* MX_RESTRICT y, const T* MX_RESTRICT z,     \
        ptrdiff_t n) {                                                                   \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) {                                                  \
        T s = SIGMOID(z[i]);                                                             \
        dy[i] = dgated[i] * z[i] * s;                                                    \
        dz[i] = dgated[i] * y[i] * s * (1 + z[i] * (1 - s));                             \
    }                                                                                    \
}                                                                                        \
/* du (n,) *= silu'(conv (n,)): du becomes dconv */                                      \
MX_KERNEL void mx_silu_backward_##SFX(T* MX_RESTRICT du, const T* MX_RESTRICT conv,     \
                                      ptrdiff_t n) {                                     \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) {                                                  \
        T s = SIGMOID(conv[i]);                                                          \
        du[i] *= s * (1 + conv[i] * (1 - s));                                            \
    }                                                                                    \
}                                                                                        \
/* ddelta (n,) *= softplus'(delta_pre) = -expm1(-delta), from delta (n,) = softplus output: \
   ddelta becomes ddelta_pre */                                                          \
MX_KERNEL void mx_softplus_backward_##SFX(T* MX_RESTRICT ddelta,                        \
                                          const T* MX_RESTRICT delta, ptrdiff_t n) {     \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) ddelta[i] *= -EXPM1(-delta[i]);                    \
}                                                                                        \
/* x (n,) = exp(x - shift) in place (a logits row minus its maximum: the softmax) */     \
MX_KERNEL void mx_exp_shift_##SFX(T* MX_RESTRICT x, T shift, ptrdiff_t n) {             \
    MX_SIMD_IF(SIMD)                                                                     \
    for (ptrdiff_t i = 0; i < n; i++) x[i] = EXP(x[i] - shift);                          \
}                                                                                        \
/* out (n,) += a (n,) (residuals, bias-gradient rows); out and a do not overlap */       \
MX_KERNEL void mx_add_##SFX(T* MX_RESTRICT out, const T* MX_RESTRICT a, ptrdiff_t n) {   \
    MX_OMP_SIMD                                                                          \
    for (ptrdiff_t i = 0; i < n; i++) out[i] += a[i];                                    \
}

/* Row reductions, sums in double: mx_row_sum = sum of a (the softmax's denominator in the
   cross-entropy, mamba_ext/cpu/model.pyx), mx_row_dot2 = sum of a b (RMSNorm's sum of x^2,
   mamba_ext/cpu/rmsnorm.pyx), mx_row_dot3 = sum of a b c (RMSNorm's backward: dout weight x);
   mx_row_max = the largest of a (n >= 1; NaNs are skipped unless a[0] is one).
   MX_ROW_LANES partial sums, lane k over i = k mod MX_ROW_LANES, added in a fixed order at
   the end: one result for a row whichever thread or clone runs it, and no chain of
   dependent double adds (one sum per row was bound by their latency: ~10x slower than the
   row's memory traffic at d_model 256). */
#define MX_ROW_LANES 8
#define MX_ROW_SUM(TERM)                                                                  \
    double acc[MX_ROW_LANES] = {0, 0, 0, 0, 0, 0, 0, 0};                                 \
    ptrdiff_t i = 0;                                                                      \
    int k;                                                                                \
    for (; i + MX_ROW_LANES <= n; i += MX_ROW_LANES) {                                    \
        MX_OMP_SIMD                                                                       \
        for (k = 0; k < MX_ROW_LANES; k++) acc[k] += TERM(i + k);                         \
    }                                                                                     \
    for (k = 0; i + k < n; k++) acc[k] += TERM(i + k);                                    \
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#define MX_ROW_SUM_KERNELS(T, SFX)                                                        \
MX_KERNEL double mx_row_sum_##SFX(const T* MX_RESTRICT a, ptrdiff_t n) {                  \
    MX_ROW_SUM(MX_ROW_TERM1)                                                              \
}                                                                                         \
MX_KERNEL T mx_row_max_##SFX(const T* MX_RESTRICT a, ptrdiff_t n) {                       \
    T m[MX_ROW_LANES];                                                                    \
    ptrdiff_t i = 0;                                                                      \
    int k;                                                                                \
    for (k = 0; k < MX_ROW_LANES; k++) m[k] = a[0];                                       \
    for (; i + MX_ROW_LANES <= n; i += MX_ROW_LANES) {                                    \
        MX_OMP_SIMD                                                                       \
        for (k = 0; k < MX_ROW_LANES; k++) m[k] = a[i + k] > m[k] ? a[i + k] : m[k];      \
    }                                                                                     \
    for (k = 0; i + k < n; k++) m[k] = a[i + k] > m[k] ? a[i + k] : m[k];                 \
    for (k = 1; k < MX_ROW_LANES; k++) m[0] = m[k] > m[0] ? m[k] : m[0];                  \
    return m[0];                                                                          \
}                                                                                         \
MX_KERNEL double mx_row_dot2_##SFX(const T* MX_RESTRICT a, const T* MX_RESTRICT b,        \
                                   ptrdiff_t n) {                                         \
    MX_ROW_SUM(MX_ROW_TERM2)                                                              \
}                                                                                         \
MX_KERNEL double mx_row_dot3_##SFX(const T* MX_RESTRICT a, const T* MX_RESTRICT b,        \
                                   const T* MX_RESTRICT c, ptrdiff_t n) {                 \
    MX_ROW_SUM(MX_ROW_TERM3)                                                              \
}
/* RMSNorm's rows (mamba_ext/cpu/rmsnorm.pyx), in double as the row sums, for either
   precision: s = the row's rstd, dot = s * mean(dout weight x) over the row.
   mx_rmsnorm_row:     out (n,) = x s weight
   mx_rmsnorm_dx_row:  dx (n,) += s (g weight - x s dot), g = dout
   mx_rmsnorm_dw_row:  dw (n,) += g (x s), the row's term of dweight
   Kernels of this header (dispatched clones) rather than loops in the .pyx, which is
   compiled for the baseline ISA only (two doubles a vector). */
#define MX_RMSNORM_ROW_KERNELS(T, SFX)                                                    \
MX_KERNEL void mx_rmsnorm_row_##SFX(T* MX_RESTRICT out, const T* MX_RESTRICT x,          \
                                    const T* MX_RESTRICT weight, double s, ptrdiff_t n) {\
    MX_OMP_SIMD                                                                           \
    for (ptrdiff_t i = 0; i < n; i++) out[i] = (T)((double)x[i] * s * (double)weight[i]);\
}                                                                                         \
MX_KERNEL void mx_rmsnorm_dx_row_##SFX(T* MX_RESTRICT dx, const T* MX_RESTRICT g,        \
        const T* MX_RESTRICT weight, const T* MX_RESTRICT x, double s, double dot,      \
        ptrdiff_t n) {                                                                    \
    MX_OMP_SIMD                                                                           \
    for (ptrdiff_t i = 0; i < n; i++)                                                     \
        dx[i] += (T)(s * ((double)g[i] * (double)weight[i] - (double)x[i] * s * dot));    \
}                                                                                         \
MX_KERNEL void mx_rmsnorm_dw_row_##SFX(T* MX_RESTRICT dw, const T* MX_RESTRICT g,        \
                                       const T* MX_RESTRICT x, double s, ptrdiff_t n) {  \
    MX_OMP_SIMD                                                                           \
    for (ptrdiff_t i = 0; i < n; i++) dw[i] += (T)((double)g[i] * ((double)x[i] * s));   \
}
#define MX_ROW_TERM1(j) ((double)a[j])
#define MX_ROW_TERM2(j) ((double)a[j] * b[j])
#define MX_ROW_TERM3(j) ((double)a[j] * b[j] * c[j])

/* SIMD 1 for float: the inline branch-free helpers vectorise (`omp simd`); 0 for double:
   libm calls, which no compiler vectorises */
MX_KERNELS_BEGIN
MX_ACTIVATION_KERNELS(float, f, mx_sigmoidf, mx_softplusf, mx_expm1f, mx_expf, 1)
MX_ACTIVATION_KERNELS(double, d, mx_sigmoid, mx_softplus, expm1, exp, 0)
MX_RMSNORM_ROW_KERNELS(float, f)
MX_RMSNORM_ROW_KERNELS(double, d)
MX_ROW_SUM_KERNELS(float, f)
MX_ROW_SUM_KERNELS(double, d)
MX_KERNELS_END

#endif /* MX_ACTIVATIONS_H */
