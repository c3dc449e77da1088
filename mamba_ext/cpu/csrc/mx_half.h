/* mx_half.h - IEEE half (float16) <-> float conversions and the loops over flat arrays
 * built on them: mixed precision's rounding of gradients to fp16 values, their fp16 copies
 * for the wire, and the sum of fp16 rows (mamba_ext/cpu/half.pyx); float16 weights of
 * generation (csrc/mx_recurrent.h).
 *
 * Why in C: NumPy's float16 casts convert one element at a time (2.5-4.5 ns per element
 * on our 2-core machine, against ~0.1 ns for a float32 multiply); these are branch-free
 * (bit selects), so the loops vectorise on any x86-64 or arm64 baseline.
 *
 * Size letters: n elements, P rows. Rounding is NumPy's astype(float16) bit for bit (to
 * nearest, ties to even; magnitudes >= 65520 -> inf; below 2^-25 -> zero; the sign kept),
 * NaN -> NaN with the top 10 bits of the payload, at least 1 (NumPy's rule: a signalling
 * NaN stays signalling, unlike the F16C instruction's conversion).
 */
#ifndef MX_HALF_H
#define MX_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "mx_compat.h"

/* IEEE half (bits) -> float, branch-free so the loops below vectorise, and with no
   subnormal float anywhere (a subnormal operand costs a microcode assist per vector):
   a normal half is its bits shifted into place with the exponent rebased by 127 - 15;
   a subnormal half is its mantissa times 2^-24 (an exact int -> float conversion);
   exponent 31 (inf/NaN) keeps an all-ones float exponent. */
MX_INLINE float mx_half_to_float(uint16_t hb) {
    uint32_t h = hb, e = h & 0x7c00u, em = (h & 0x7fffu) << 13, bits;
    float sub = (float)(int32_t)(h & 0x3ffu) * 5.9604644775390625e-8f;   /* 2^-24 */
    uint32_t sub_bits;
    float f;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    bits = e == 0x7c00u ? (em | 0x7f800000u) : (e == 0 ? sub_bits : em + 0x38000000u);
    bits |= (h & 0x8000u) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> IEEE half bits (header comment for the rounding), branch-free:
   - |f| in [2^-14, 65536): the exponent rebased by 15 - 127 and the 13 dropped bits
     rounded to nearest even by adding 0xfff + (the kept lowest bit); a carry into the
     exponent is the right result (65520 -> inf);
   - |f| < 2^-14 (half subnormals): |f| + 0.5f rounds to the half's quantum 2^-24 in the
     float add itself (0.5's ulp), leaving the half's bits in the low mantissa;
   - |f| >= 65536 or inf -> inf; NaN -> 0x7c00 | top payload bits, 0x7c01 if those are 0. */
MX_INLINE uint16_t mx_float_to_half(float f) {
    uint32_t x, ax, sub_bits, norm, nan, h;
    float sub;
    memcpy(&x, &f, sizeof x);
    ax = x & 0x7fffffffu;
    norm = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;       /* ax - (112 << 23) + ... */
    memcpy(&sub, &ax, sizeof sub);
    sub += 0.5f;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    nan = 0x7c00u | ((ax >> 13) & 0x3ffu);
    nan |= (uint32_t)(nan == 0x7c00u);
    h = ax < 0x38800000u ? sub_bits - 0x3f000000u
      : (ax < 0x47800000u ? norm : (ax > 0x7f800000u ? nan : 0x7c00u));
    return (uint16_t)(h | ((x >> 16) & 0x8000u));
}

MX_KERNELS_BEGIN

/* out (n,) = float(w (n,)) : one row of a float16 table (the embedding lookup). */
MX_KERNEL void mx_half_row_to_float(float* MX_RESTRICT out, const uint16_t* MX_RESTRICT w,
                                    ptrdiff_t n) {
    MX_OMP_SIMD
    for (ptrdiff_t i = 0; i < n; i++) out[i] = mx_half_to_float(w[i]);
}

/* out (n,) = half bits of x (n,). */
MX_KERNEL void mx_float_to_half_row(uint16_t* MX_RESTRICT out, const float* MX_RESTRICT x,
                                    ptrdiff_t n) {
    MX_OMP_SIMD
    for (ptrdiff_t i = 0; i < n; i++) out[i] = mx_float_to_half(x[i]);
}

/* out (n,) = x (n,) rounded to the nearest half value, as float (out may be x). */
MX_KERNEL void mx_round_half_f(float* out, const float* x, ptrdiff_t n) {
    MX_OMP_SIMD
    for (ptrdiff_t i = 0; i < n; i++) out[i] = mx_half_to_float(mx_float_to_half(x[i]));
}

/* out (n,) = sum over the P rows of h (row r at h + r * ld) of their float values, in row
   order: ((h_0 + h_1) + h_2) + ... in float (one pass per row). */
MX_KERNEL void mx_half_rows_sum_f(float* MX_RESTRICT out, const uint16_t* MX_RESTRICT h,
                                  ptrdiff_t P, ptrdiff_t n, ptrdiff_t ld) {
    MX_OMP_SIMD
    for (ptrdiff_t i = 0; i < n; i++) out[i] = mx_half_to_float(h[i]);
    for (ptrdiff_t r = 1; r < P; r++) {
        const uint16_t* MX_RESTRICT hr = h + r * ld;
        MX_OMP_SIMD
        for (ptrdiff_t i = 0; i < n; i++) out[i] += mx_half_to_float(hr[i]);
    }
}

MX_KERNELS_END

#endif /* MX_HALF_H */
