/* mx_adamw.h - the AdamW step's element loop (mamba_ext/cpu/adamw.pyx; maths: adamw.pxd).
 *
 * mx_adamw_range_f / _d: elements [lo, hi) of one AdamW step, in place; returns how many
 * the NaN guard left unchanged. A kernel of a header (runtime-dispatched AVX-512 / AVX2
 * clones, as the other hot loops) because the same loop compiled in the .pyx ran on the
 * baseline SSE2 vectors only: ~7 cycles an element, the optimizer's whole time.
 * mx_select_f / mx_select_d(c, a, b) = c ? a : b chosen on the bits. GCC turns a float
 * ternary whose one side is the old value back into a branch (then no vectorisation);
 * integer masks don't.
 */
#ifndef MX_ADAMW_H
#define MX_ADAMW_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stddef.h>
#include "mx_compat.h"

MX_INLINE float mx_select_f(int c, float a, float b) {
    uint32_t x, y, k = -(uint32_t)(c != 0);
    memcpy(&x, &a, 4); memcpy(&y, &b, 4); x = (x & k) | (y & ~k); memcpy(&a, &x, 4);
    return a;
}

MX_INLINE double mx_select_d(int c, double a, double b) {
    uint64_t x, y, k = -(uint64_t)(c != 0);
    memcpy(&x, &a, 8); memcpy(&y, &b, 8); x = (x & k) | (y & ~k); memcpy(&a, &x, 8);
    return a;
}

/* w, m, v (n,) in place from g; the scalars as adamw_step casts them (gs the gradient
   scale, omb1 = 1 - beta1, b2, omb2 = 1 - beta2, decay = lr weight_decay, step_size =
   lr / (1 - beta1^t), sqrt_bc2 = sqrt(1 - beta2^t), eps, md the clamp, +inf when off) */
#define MX_ADAMW_KERNEL(T, SFX, SQRT, SELECT)                                             \
MX_KERNEL ptrdiff_t mx_adamw_range_##SFX(T* MX_RESTRICT w, T* MX_RESTRICT m,              \
        T* MX_RESTRICT v, const T* MX_RESTRICT g, ptrdiff_t lo, ptrdiff_t hi, T gs,       \
        T omb1, T b2, T omb2, T decay, T step_size, T sqrt_bc2, T eps, T md) {            \
    ptrdiff_t bad = 0;                                                                    \
    for (ptrdiff_t i = lo; i < hi; i++) {                                                 \
        T gi = g[i] * gs, wi = w[i], mo = m[i], vo = v[i];                                \
        T mi = mo + omb1 * (gi - mo);       /* PyTorch's lerp form of b1 m + (1-b1) g */  \
        T vi = b2 * vo + omb2 * gi * gi;                                                  \
        T d = decay * wi + step_size * mi / (SQRT(vi) / sqrt_bc2 + eps);                  \
        int ok = (d - d) + (vi - vi) == 0;  /* x - x: 0 if finite, else NaN */           \
        d = d > md ? md : d;                                                              \
        d = d < -md ? -md : d;                                                            \
        w[i] = SELECT(ok, wi - d, wi);                                                    \
        m[i] = SELECT(ok, mi, mo);                                                        \
        v[i] = SELECT(ok, vi, vo);                                                        \
        bad += !ok;                                                                       \
    }                                                                                     \
    return bad;                                                                           \
}

MX_KERNELS_BEGIN
MX_ADAMW_KERNEL(float, f, sqrtf, mx_select_f)
MX_ADAMW_KERNEL(double, d, sqrt, mx_select_d)
MX_KERNELS_END

#endif /* MX_ADAMW_H */
