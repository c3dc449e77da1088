/* mx_recurrent.h - the per-row loops of the one-token recurrent step (generation),
 * float (_f) and double (_d), and the float16-weight matrix-vector product.
 *
 * Size letters: D dInner, N dState, K dConv, IC input columns, OC output columns,
 * B rows (one per sequence of the batch). The driver is mamba_ext/cpu/recurrent.pyx.
 *
 * One time step of one sequence, per channel d (docs/semantics.md, steps 3 and 8-10):
 *   conv = bias + w[d,0] xc + sum_{k=1..K-1} w[d,k] tail[d, K-1-k]   (tail oldest first)
 *   tail <- [tail[1:], xc]
 *   em = expm1(delta A), h = (1 + em) h + (zoh ? em / A : delta) Bs u, y = Cs.h + D_vec u
 * the same single exponential per (d, n) as the chunked scan (csrc/mx_scan.h), so the
 * step and the full forward round alike.
 */
#ifndef MX_RECURRENT_H
#define MX_RECURRENT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "mx_compat.h"
#include "mx_half.h"
#include "mx_math.h"

/* `omp simd reduction(+:v)`: a vectorised sum (plain C may not reorder float adds). */
#if defined(_OPENMP) && !(defined(_MSC_VER) && !defined(__clang__))
#define MX_OMP_SIMD_SUM(v) MX_PRAGMA(omp simd reduction(+:v))
#else
#define MX_OMP_SIMD_SUM(v)
#endif
/* ... only where the loop body vectorises (SIMD 1: float, branch-free helpers; SIMD 0:
   double, libm calls, which no compiler vectorises): as MX_SIMD_IF of mx_compat.h */
#define MX_SIMD_SUM_IF(simd, v) MX_SIMD_SUM_IF_##simd(v)
#define MX_SIMD_SUM_IF_1(v) MX_OMP_SIMD_SUM(v)
#define MX_SIMD_SUM_IF_0(v)

#define MX_RECURRENT_KERNELS(T, SFX, EXPM1, SIMD)                                            \
/* conv (D,) = causal conv of one step; tail (D, S): the last S >= K-1 inputs, oldest   \
   first, shifted in place (S = K-1 here; transformers keeps S = K); xc, bias (D,),      \
   weight (D, K). conv may not alias the others. */                                     \
MX_KERNEL void mx_conv_step_##SFX(T* MX_RESTRICT conv, T* MX_RESTRICT tail,            \
        const T* MX_RESTRICT xc, const T* MX_RESTRICT weight, const T* MX_RESTRICT bias, \
        ptrdiff_t D, ptrdiff_t K, ptrdiff_t S)                                           \
{                                                                                        \
    for (ptrdiff_t d = 0; d < D; d++) {                                                  \
        const T* w = weight + d * K;                                                     \
        T* tl = tail + d * S;                                                            \
        T acc = bias[d] + w[0] * xc[d];                                                  \
        for (ptrdiff_t k = 1; k < K; k++) acc += w[k] * tl[S - k];                       \
        for (ptrdiff_t j = 0; j + 1 < S; j++) tl[j] = tl[j + 1];                         \
        if (S > 0) tl[S - 1] = xc[d];                                                    \
        conv[d] = acc;                                                                   \
    }                                                                                    \
}                                                                                        \
/* One scan step of one sequence: h (D, N) updated in place; y (D,) = Cs.h + D_vec u;   \
   u, delta, D_vec (D,); A, A_inv (D, N); Bs, Cs (N,). */                               \
MX_KERNEL void mx_scan_step_##SFX(T* MX_RESTRICT y, T* MX_RESTRICT h,                  \
        const T* MX_RESTRICT u, const T* MX_RESTRICT delta, const T* MX_RESTRICT A,      \
        const T* MX_RESTRICT A_inv, const T* MX_RESTRICT Bs, const T* MX_RESTRICT Cs,    \
        const T* MX_RESTRICT D_vec, ptrdiff_t D, ptrdiff_t N, int zoh)                   \
{                                                                                        \
    for (ptrdiff_t d = 0; d < D; d++) {                                                  \
        const T dd = delta[d], ud = u[d];                                                \
        const T* MX_RESTRICT a = A + d * N;                                              \
        const T* MX_RESTRICT ia = A_inv + d * N;                                         \
        T* MX_RESTRICT hd = h + d * N;                                                   \
        T acc = 0;                                                                       \
        MX_SIMD_SUM_IF(SIMD, acc)                                                        \
        for (ptrdiff_t n = 0; n < N; n++) {                                              \
            T em = EXPM1(dd * a[n]);                                                     \
            T bb = (zoh ? em * ia[n] : dd) * Bs[n];                                      \
            T hn = (1 + em) * hd[n] + bb * ud;                                           \
            hd[n] = hn;                                                                  \
            acc += Cs[n] * hn;                                                           \
        }                                                                                \
        y[d] = acc + D_vec[d] * ud;                                                      \
    }                                                                                    \
}

MX_KERNELS_BEGIN
MX_RECURRENT_KERNELS(float, f, mx_expm1f, 1)
MX_RECURRENT_KERNELS(double, d, expm1, 0)

/* Output columns [o0, o1) of out (B, OC) = x (B, IC) @ w (OC, IC)^T + bias (OC,) (bias may
   be NULL), w float16 bits, float32 accumulation. Each weight row is read once from
   memory for all B rows (generation reads every weight once per token: the row is
   the unit of memory traffic). Portable version: the conversion is integer work per
   weight, so it runs about as fast as a float32 product (not faster). */
MX_KERNEL void mx_linear_half_portable_f(float* MX_RESTRICT out, const float* MX_RESTRICT x,
        const uint16_t* MX_RESTRICT w, const float* MX_RESTRICT bias,
        ptrdiff_t B, ptrdiff_t IC, ptrdiff_t OC, ptrdiff_t o0, ptrdiff_t o1)
{
    for (ptrdiff_t o = o0; o < o1; o++) {
        const uint16_t* MX_RESTRICT wr = w + o * IC;
        for (ptrdiff_t b = 0; b < B; b++) {
            const float* MX_RESTRICT xr = x + b * IC;
            float acc = 0;
            MX_OMP_SIMD_SUM(acc)
            for (ptrdiff_t i = 0; i < IC; i++) acc += mx_half_to_float(wr[i]) * xr[i];
            out[b * OC + o] = acc + (bias ? bias[o] : 0.0f);
        }
    }
}

MX_KERNELS_END

/* x86-64 with GCC or Clang: the same product with the F16C conversion instruction (one
   instruction per 8 weights; ~2.5x the portable version, so float16 weights are read at
   memory speed), chosen at run time when the CPU has AVX2, F16C and FMA. */
#if MX_GNUC_LIKE && defined(__x86_64__) && !defined(_WIN32) && !defined(MX_NO_DISPATCH)
#include <cpuid.h>
#include <immintrin.h>
#define MX_HAVE_F16C_PATH 1
/* AVX2 and FMA by the compiler's CPU model (it also checks that the OS saves the AVX
   state); F16C by CPUID leaf 1, ECX bit 29 (Clang's __builtin_cpu_supports lacks it). */
static MX_UNUSED int mx_cpu_has_f16c_path(void) {
    unsigned int a, b, c, d;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1u);
}
/* The eight sums of v0..v7 as one vector [sum v0, ..., sum v7] (fixed order). */
__attribute__((target("avx2,f16c,fma"))) static inline __m256 mx_hsum8(
        __m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7)
{
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    /* t0: lane halves hold partial sums of v0..v3 (low 128 bits: elements 0-3 of each,
       high: 4-7); t1 the same for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* 8 weights of row wr from i, float16 -> float32. */
#define MX_W8(wr, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((wr) + (i))))

/* One row at a time, two FMA chains: each weight row is streamed once for all B rows, and
   each of its weights is converted once per four batch rows (130M, float16, batch 16:
   200-225 tok/s against 181-183 converting it per batch row; batch 4 164-172 against
   151-158; measured 2026-12-01, alternated). */
__attribute__((target("avx2,f16c,fma"))) static MX_UNUSED void mx_linear_half_rows_f16c_f(
        float* MX_RESTRICT out, const float* MX_RESTRICT x, const uint16_t* MX_RESTRICT w,
        const float* MX_RESTRICT bias, ptrdiff_t B, ptrdiff_t IC, ptrdiff_t OC, ptrdiff_t o0,
        ptrdiff_t o1)
{
    for (ptrdiff_t o = o0; o < o1; o++) {
        const uint16_t* MX_RESTRICT wr = w + o * IC;
        ptrdiff_t b = 0;
        for (; b + 4 <= B; b += 4) {              /* batch rows in fours: each converted */
            const float* MX_RESTRICT x0 = x + b * IC;   /* weight serves four of them */
            const float* MX_RESTRICT x1 = x0 + IC;
            const float* MX_RESTRICT x2 = x1 + IC;
            const float* MX_RESTRICT x3 = x2 + IC;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;       /* two chains per batch row */
            ptrdiff_t i = 0;
            for (; i + 16 <= IC; i += 16) {
                const __m256 f = MX_W8(wr, i), g = MX_W8(wr, i + 8);
                a0 = _mm256_fmadd_ps(f, _mm256_loadu_ps(x0 + i), a0);
                c0 = _mm256_fmadd_ps(g, _mm256_loadu_ps(x0 + i + 8), c0);
                a1 = _mm256_fmadd_ps(f, _mm256_loadu_ps(x1 + i), a1);
                c1 = _mm256_fmadd_ps(g, _mm256_loadu_ps(x1 + i + 8), c1);
                a2 = _mm256_fmadd_ps(f, _mm256_loadu_ps(x2 + i), a2);
                c2 = _mm256_fmadd_ps(g, _mm256_loadu_ps(x2 + i + 8), c2);
                a3 = _mm256_fmadd_ps(f, _mm256_loadu_ps(x3 + i), a3);
                c3 = _mm256_fmadd_ps(g, _mm256_loadu_ps(x3 + i + 8), c3);
            }
            float s[8];
            _mm256_storeu_ps(s, mx_hsum8(a0, a1, a2, a3, c0, c1, c2, c3));
            for (int r = 0; r < 4; r++) s[r] += s[4 + r];
            for (; i < IC; i++) {
                const float f = mx_half_to_float(wr[i]);
                s[0] += f * x0[i]; s[1] += f * x1[i]; s[2] += f * x2[i]; s[3] += f * x3[i];
            }
            for (int r = 0; r < 4; r++) out[(b + r) * OC + o] = s[r] + (bias ? bias[o] : 0.0f);
        }
        for (; b < B; b++) {
            const float* MX_RESTRICT xr = x + b * IC;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();   /* two FMA chains */
            float lanes[8], acc;
            ptrdiff_t i = 0;
            for (; i + 16 <= IC; i += 16) {
                a0 = _mm256_fmadd_ps(MX_W8(wr, i), _mm256_loadu_ps(xr + i), a0);
                a1 = _mm256_fmadd_ps(MX_W8(wr, i + 8), _mm256_loadu_ps(xr + i + 8), a1);
            }
            _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
            acc = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
                + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            for (; i < IC; i++) acc += mx_half_to_float(wr[i]) * xr[i];
            out[b * OC + o] = acc + (bias ? bias[o] : 0.0f);
        }
    }
}
/* Short rows (IC < MX_HALF_QUAD_MAX_IC): rows in groups of four, so that each converted
   weight serves two batch rows and the horizontal sums are done eight at a time
   (mx_hsum8); the per-output reduction, not the conversion, dominates short rows (2 x 64,
   batch 1: 43,700 tok/s against 31,400 row by row). Long rows go row by row
   (mx_linear_half_rows_f16c_f): with four rows streamed at once the 130M model generated
   50 tok/s against 83 at batch 1 (both measured 2026-12-01, docs/performance.md). */
#define MX_HALF_QUAD_MAX_IC 512
__attribute__((target("avx2,f16c,fma"))) static MX_UNUSED void mx_linear_half_quad_f16c_f(
        float* MX_RESTRICT out, const float* MX_RESTRICT x, const uint16_t* MX_RESTRICT w,
        const float* MX_RESTRICT bias, ptrdiff_t B, ptrdiff_t IC, ptrdiff_t OC, ptrdiff_t o0,
        ptrdiff_t o1)
{
    ptrdiff_t o = o0;
    for (; o + 4 <= o1; o += 4) {
        const uint16_t* MX_RESTRICT w0 = w + o * IC;
        const uint16_t* MX_RESTRICT w1 = w0 + IC;
        const uint16_t* MX_RESTRICT w2 = w1 + IC;
        const uint16_t* MX_RESTRICT w3 = w2 + IC;
        float s[8];
        ptrdiff_t b = 0;
        for (; b + 2 <= B; b += 2) {              /* rows o..o+3 x batch rows b, b+1 */
            const float* MX_RESTRICT xa = x + b * IC;
            const float* MX_RESTRICT xb = xa + IC;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            ptrdiff_t i = 0;
            for (; i + 8 <= IC; i += 8) {
                __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);
                __m256 f0 = MX_W8(w0, i), f1 = MX_W8(w1, i), f2 = MX_W8(w2, i), f3 = MX_W8(w3, i);
                a0 = _mm256_fmadd_ps(f0, va, a0); b0 = _mm256_fmadd_ps(f0, vb, b0);
                a1 = _mm256_fmadd_ps(f1, va, a1); b1 = _mm256_fmadd_ps(f1, vb, b1);
                a2 = _mm256_fmadd_ps(f2, va, a2); b2 = _mm256_fmadd_ps(f2, vb, b2);
                a3 = _mm256_fmadd_ps(f3, va, a3); b3 = _mm256_fmadd_ps(f3, vb, b3);
            }
            _mm256_storeu_ps(s, mx_hsum8(a0, a1, a2, a3, b0, b1, b2, b3));
            for (; i < IC; i++) {
                const float f[4] = {mx_half_to_float(w0[i]), mx_half_to_float(w1[i]),
                                    mx_half_to_float(w2[i]), mx_half_to_float(w3[i])};
                for (int r = 0; r < 4; r++) { s[r] += f[r] * xa[i]; s[4 + r] += f[r] * xb[i]; }
            }
            for (int r = 0; r < 4; r++) {
                const float bo = bias ? bias[o + r] : 0.0f;
                out[b * OC + o + r] = s[r] + bo;
                out[(b + 1) * OC + o + r] = s[4 + r] + bo;
            }
        }
        if (b < B) {                              /* rows o..o+3 x the last batch row: two */
            const float* MX_RESTRICT xa = x + b * IC;   /* FMA chains per row (even, odd 8) */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
            ptrdiff_t i = 0;
            for (; i + 16 <= IC; i += 16) {
                __m256 va = _mm256_loadu_ps(xa + i), vc = _mm256_loadu_ps(xa + i + 8);
                a0 = _mm256_fmadd_ps(MX_W8(w0, i), va, a0); c0 = _mm256_fmadd_ps(MX_W8(w0, i + 8), vc, c0);
                a1 = _mm256_fmadd_ps(MX_W8(w1, i), va, a1); c1 = _mm256_fmadd_ps(MX_W8(w1, i + 8), vc, c1);
                a2 = _mm256_fmadd_ps(MX_W8(w2, i), va, a2); c2 = _mm256_fmadd_ps(MX_W8(w2, i + 8), vc, c2);
                a3 = _mm256_fmadd_ps(MX_W8(w3, i), va, a3); c3 = _mm256_fmadd_ps(MX_W8(w3, i + 8), vc, c3);
            }
            if (i + 8 <= IC) {
                __m256 va = _mm256_loadu_ps(xa + i);
                a0 = _mm256_fmadd_ps(MX_W8(w0, i), va, a0); a1 = _mm256_fmadd_ps(MX_W8(w1, i), va, a1);
                a2 = _mm256_fmadd_ps(MX_W8(w2, i), va, a2); a3 = _mm256_fmadd_ps(MX_W8(w3, i), va, a3);
                i += 8;
            }
            _mm256_storeu_ps(s, mx_hsum8(a0, a1, a2, a3, c0, c1, c2, c3));
            for (int r = 0; r < 4; r++) s[r] += s[4 + r];
            for (; i < IC; i++) {
                s[0] += mx_half_to_float(w0[i]) * xa[i]; s[1] += mx_half_to_float(w1[i]) * xa[i];
                s[2] += mx_half_to_float(w2[i]) * xa[i]; s[3] += mx_half_to_float(w3[i]) * xa[i];
            }
            for (int r = 0; r < 4; r++) out[b * OC + o + r] = s[r] + (bias ? bias[o + r] : 0.0f);
        }
    }
    if (o < o1)                                   /* the last rows of the range, one by one */
        mx_linear_half_rows_f16c_f(out, x, w, bias, B, IC, OC, o, o1);
}

#undef MX_W8

__attribute__((target("avx2,f16c,fma"))) static MX_UNUSED void mx_linear_half_f16c_f(
        float* MX_RESTRICT out, const float* MX_RESTRICT x, const uint16_t* MX_RESTRICT w,
        const float* MX_RESTRICT bias, ptrdiff_t B, ptrdiff_t IC, ptrdiff_t OC, ptrdiff_t o0,
        ptrdiff_t o1)
{
    if (IC < MX_HALF_QUAD_MAX_IC)
        mx_linear_half_quad_f16c_f(out, x, w, bias, B, IC, OC, o0, o1);
    else
        mx_linear_half_rows_f16c_f(out, x, w, bias, B, IC, OC, o0, o1);
}
#else
#define MX_HAVE_F16C_PATH 0
#endif

/* mx_linear_half_portable_f's contract, on the fastest path the CPU has. */
static MX_UNUSED void mx_linear_half_f(float* MX_RESTRICT out, const float* MX_RESTRICT x,
        const uint16_t* MX_RESTRICT w, const float* MX_RESTRICT bias,
        ptrdiff_t B, ptrdiff_t IC, ptrdiff_t OC, ptrdiff_t o0, ptrdiff_t o1)
{
#if MX_HAVE_F16C_PATH
    static int f16c = -1;          /* -1: not asked yet (a benign race: every thread agrees) */
    if (f16c < 0)
        f16c = mx_cpu_has_f16c_path();
    if (f16c) {
        mx_linear_half_f16c_f(out, x, w, bias, B, IC, OC, o0, o1);
        return;
    }
#endif
    mx_linear_half_portable_f(out, x, w, bias, B, IC, OC, o0, o1);
}

#endif /* MX_RECURRENT_H */
