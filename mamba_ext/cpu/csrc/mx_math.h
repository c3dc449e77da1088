/* mx_math.h - branch-free float32 exp / expm1 / log1p / softplus / sigmoid.
 *
 * libm's scalar expf / expm1f / log1pf are not vectorised by the compilers we build
 * with, and they were the largest cost outside BLAS and the scan. These are plain
 * polynomial evaluations with selects instead of branches, so a loop over them
 * vectorises. Accuracy against double libm over a dense sweep of the whole float
 * range: tests/csrc/test_mx_math.c (bounds stated there).
 *
 * Range conventions (float32):
 *   mx_expf(x):   0 for x < -87 (results near or under FLT_MIN flush to 0), +inf for
 *                 x > 88, NaN for NaN.
 *   mx_expm1f(x): -1 + 2^-87-ish for x < -87 (i.e. -1 rounded), +inf for x > 88,
 *                 expm1(+-0) = +-0, NaN for NaN.
 *   mx_log1pf_unit(y): log(1 + y) for y in [0, 1] only (the softplus argument).
 *   mx_softplusf(x) = max(x, 0) + log1p(exp(-|x|)) (no overflow for any x).
 *   mx_sigmoidf(x) = 1 / (1 + exp(-x)).
 */
#ifndef MX_MATH_H
#define MX_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "mx_compat.h"

/* e^r - 1 = r + r^2 P(r) for |r| <= ln2/2, P Cephes' expf polynomial (degree 5),
   evaluated by pairs of terms (Estrin): three multiply-adds deep after r^2 instead of
   six, which the exponentials of the scan and of the activations are bound by */
MX_INLINE float mx_expm1_poly(float r) {
    float r2 = r * r;
    return (((1.9875691500e-4f * r + 1.3981999507e-3f) * r2
             + (8.3334519073e-3f * r + 4.1665795894e-2f)) * r2
            + (1.6666665459e-1f * r + 5.0000001201e-1f)) * r2 + r;
}

/* exp(x) = 2^k e^r, |r| <= ln2/2, k by the 1.5*2^23 rounding trick (x clamped to
   [-87, 88] so 2^k stays a normal float), e^r = 1 + mx_expm1_poly(r).
   Returns e^r in *er and 2^k in *scale. */
MX_INLINE void mx_exp_parts(float x, float* er, float* scale) {
    float xs = x > -87.0f ? x : -87.0f;          /* NaN -> -87; callers keep NaN */
    float kf, r;
    int32_t bits;
    xs = xs < 88.0f ? xs : 88.0f;
    kf = (xs * 1.44269504f + 12582912.0f) - 12582912.0f;
    r = (xs - kf * 0.693359375f) + kf * 2.12194440e-4f;
    *er = mx_expm1_poly(r) + 1.0f;
    bits = ((int32_t)kf + 127) << 23;            /* 2^k, k in [-126, 127] */
    memcpy(scale, &bits, sizeof bits);
}

/* expf */
MX_INLINE float mx_expf(float x) {
    float er, s;
    mx_exp_parts(x, &er, &s);
    /* below e^-87 (results near or under FLT_MIN) flush to 0; above e^88, inf */
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : (x == x ? er * s : x));
}

/* expm1f: with x = k ln2 + r, expm1(x) = 2^k (e^r - 1) + (2^k - 1), e^r - 1 = r + r^2 P(r)
   by the same polynomial as mx_exp_parts (no cancellation: k = 0 for |x| < ln2/2, and
   2^k - 1 is exact). One polynomial per value, not two: the scan computes one expm1
   per (t, d, n). The same values as mx_exp_parts' k and r, with fewer selects (this is
   the scan's inner loop): only the lower clamp (a max that passes a NaN on: it then
   propagates through the polynomial), 2^k from the rounding sum's low bits (no float ->
   int conversion, so a NaN or a huge x is not undefined behaviour), and x > 88 replaced
   by inf at the end. mx_expm1f_le88 leaves that last select out: its result is defined
   for x <= 88 or NaN only (the scan's delta*A where no delta is negative, A < 0), and
   there it is mx_expm1f_unsigned_zero's. mx_expm1f_unsigned_zero gives +0 for x = -0
   (one select fewer: the scan, where the sign of a zero em changes no result);
   mx_expm1f keeps expm1(-0) = -0. */
MX_INLINE float mx_expm1f_le88(float x) {
    float xs = -87.0f > x ? -87.0f : x;         /* max(-87, x), NaN -> x: one vmaxps */
    float t, kf, r, pm1, s;
    uint32_t tb, bits;
    t = xs * 1.44269504f + 12582912.0f;          /* k in the low mantissa bits */
    kf = t - 12582912.0f;
    r = (xs - kf * 0.693359375f) + kf * 2.12194440e-4f;
    pm1 = mx_expm1_poly(r);
    memcpy(&tb, &t, sizeof tb);
    bits = (tb + (127u - 0x4B400000u)) << 23;    /* 2^k (k = tb - 0x4B400000) */
    memcpy(&s, &bits, sizeof bits);
    return s * pm1 + (s - 1.0f);
}

MX_INLINE float mx_expm1f_unsigned_zero(float x) {
    float v = mx_expm1f_le88(x);
    return x > 88.0f ? INFINITY : v;
}

MX_INLINE float mx_expm1f(float x) {
    float v = mx_expm1f_unsigned_zero(x);
    return x == 0.0f ? x : v;                     /* expm1(-0) = -0 */
}

/* log1p(y) for y in [0, 1]: w = 1 + y rounded, c = (y - (w - 1)) / w restores the
   rounding, log(w) with w = m 2^e, m in [sqrt(1/2), sqrt(2)) by Cephes' logf
   polynomial. */
MX_INLINE float mx_log1pf_unit(float y) {
    float w = 1.0f + y;
    float c = (y - (w - 1.0f)) / w;
    float e = w > 1.41421356f ? 1.0f : 0.0f;
    float x = (w > 1.41421356f ? 0.5f * w : w) - 1.0f;
    float z = x * x, z2 = z * z;
    /* the degree-8 polynomial by pairs of terms (Estrin), four multiply-adds deep
       instead of eight */
    float p = ((-2.4999993993e-1f * x + 3.3333331174e-1f)
               + (-1.6668057665e-1f * x + 2.0000714765e-1f) * z)
              + ((-1.2420140846e-1f * x + 1.4249322787e-1f)
                 + (-1.1514610310e-1f * x + 1.1676998740e-1f) * z + 7.0376836292e-2f * z2) * z2;
    p = p * x * z;
    p += e * -2.12194440e-4f;
    p += -0.5f * z;
    return x + p + e * 0.693359375f + c;
}

/* softplus(x) = max(x, 0) + log1p(exp(-|x|)) */
MX_INLINE float mx_softplusf(float x) {
    return (x > 0 ? x : 0) + mx_log1pf_unit(mx_expf(-fabsf(x)));
}

/* sigmoid(x) = 1 / (1 + exp(-x)), the same values as 1 / (1 + mx_expf(-x)) for every x,
   with one division: exp(-x) from mx_exp_parts (-x clamped to [-87, 88], so finite and
   positive: 1 for x > 87 as with mx_expf's 0), then the limit 0 below -88 (where
   mx_expf's inf gave it) and NaN by selects after the division. Written so because the
   selects of mx_expf before the division made the compiler divide twice per vector. */
MX_INLINE float mx_sigmoidf(float x) {
    float er, scale, s;
    mx_exp_parts(-x, &er, &scale);
    s = 1 / (1 + er * scale);
    return x < -88.0f ? 0.0f : (x == x ? s : x);
}

/* The same in double, by libm (exact to an ulp; not vectorised, and not hot). */
MX_INLINE double mx_softplus(double x) { return (x > 0 ? x : 0) + log1p(exp(-fabs(x))); }
MX_INLINE double mx_sigmoid(double x) { return 1 / (1 + exp(-x)); }

#endif /* MX_MATH_H */
