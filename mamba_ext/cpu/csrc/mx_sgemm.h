/* mx_sgemm.h - a single-threaded float32 GEMM for CPUs with AVX-512, used where the BLAS
 * would run AVX2 kernels on such a CPU.
 *
 * Design: SciPy's OpenBLAS picks its kernels by CPU model. On a model it does not know (an
 * AMD Zen 5, family 26, in particular) it falls back to its Haswell (AVX2) kernels, and
 * its sgemm runs at half the speed of its own AVX-512 kernels on the same CPU
 * (docs/performance.md, "The BLAS's kernels"); the choice is made once, from the
 * environment, when the library loads, and mamba_ext changes no environment. The core
 * already drives one single-threaded GEMM per OpenMP thread's slice (linear.pyx), so it
 * needs no more than this: BLIS's loop structure (Goto's algorithm) with one micro-kernel.
 *   - C (m, n) = alpha op(A) op(B) + beta C, column-major, as the BLAS sgemm; m, n, k and
 *     the leading dimensions as ptrdiff_t (no 32-bit limit).
 *   - Blocks of KC steps of k, MC rows of op(A), NC columns of op(B): op(B)'s (KC, NC)
 *     block is packed into NR-column slivers (k-major, NR values per step), op(A)'s
 *     (MC, KC) block into MR-row slivers (k-major, MR values per step), both zero-padded
 *     to whole slivers, in this thread's workspace.
 *   - Micro-kernel MR x NR = 32 x 12: 24 zmm accumulators, per step two loads of A's
 *     sliver and 12 broadcasts of B's; edge tiles store through masks.
 *   - Every C element is the same sum in the same order wherever its row and column
 *     fall: per KC block a chain of FMAs over k from zero, then C = alpha acc + beta C
 *     (beta 1 after the first block). So results do not depend on how a caller splits m
 *     or n (the core's thread-count invariance), only on k. beta == 0 never reads C.
 * mx_sgemm_supported(): 1 where this file was compiled for x86_64 with GCC or Clang and
 * the CPU has AVX-512F; elsewhere mx_sgemm must not be called. mx_sgemm_cpu_amd(): 1 on
 * an AMD CPU there (linear.pyx picks the weight gradients' GEMM by it).
 */
#ifndef MX_SGEMM_H
#define MX_SGEMM_H

#include <stddef.h>
#include <string.h>
#include "mx_compat.h"
#include "mx_threads.h"

#if (defined(__x86_64__) || defined(_M_X64)) && MX_GNUC_LIKE && !defined(_MSC_VER)
#define MX_SGEMM_X86 1
#include <immintrin.h>
#else
#define MX_SGEMM_X86 0
#endif

#define MX_SGEMM_MR 32
#define MX_SGEMM_NR 12
/* op(B)'s sliver of NR values as one masked 16-lane vector (mx_sgemm_pack) */
#define MX_SGEMM_NR_MASK ((__mmask16)((1u << MX_SGEMM_NR) - 1u))
#if MX_SGEMM_NR > 16
#error "mx_sgemm_pack copies an NR sliver as one 16-lane vector"
#endif
#define MX_SGEMM_KC 384
#define MX_SGEMM_MC 192
#define MX_SGEMM_NC 2064              /* a multiple of NR */

#if MX_SGEMM_X86
#define MX_AVX512 __attribute__((target("avx512f,fma"), unused))

static MX_UNUSED int mx_sgemm_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

static MX_UNUSED int mx_sgemm_cpu_amd(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
}

/* c (mr <= MR rows, nr <= NR columns, ldc) = alpha a.b + beta c; a (kc, MR), b (kc, NR)
   packed slivers */
MX_AVX512 static void mx_sgemm_kernel(ptrdiff_t kc, const float* MX_RESTRICT a,
                                      const float* MX_RESTRICT b, float* MX_RESTRICT c,
                                      ptrdiff_t ldc, float alpha, float beta, int mr, int nr)
{
    __m512 c0[MX_SGEMM_NR], c1[MX_SGEMM_NR];
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    __mmask16 m0 = (__mmask16)(mr >= 16 ? 0xFFFFu : (1u << mr) - 1u);
    __mmask16 m1 = (__mmask16)(mr <= 16 ? 0u : (mr >= 32 ? 0xFFFFu : (1u << (mr - 16)) - 1u));
    ptrdiff_t p;
    int j;
    for (j = 0; j < MX_SGEMM_NR; j++) {
        c0[j] = _mm512_setzero_ps();
        c1[j] = _mm512_setzero_ps();
    }
    for (p = 0; p < kc; p++) {
        __m512 a0 = _mm512_load_ps(a), a1 = _mm512_load_ps(a + 16);
        for (j = 0; j < MX_SGEMM_NR; j++) {
            __m512 bj = _mm512_set1_ps(b[j]);
            c0[j] = _mm512_fmadd_ps(a0, bj, c0[j]);
            c1[j] = _mm512_fmadd_ps(a1, bj, c1[j]);
        }
        a += MX_SGEMM_MR;
        b += MX_SGEMM_NR;
    }
    for (j = 0; j < nr; j++) {
        float* cj = c + j * ldc;
        __m512 r0 = _mm512_mul_ps(va, c0[j]), r1 = _mm512_mul_ps(va, c1[j]);
        if (beta != 0.0f) {
            r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cj), r0);
            r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cj + 16), r1);
        }
        _mm512_mask_storeu_ps(cj, m0, r0);
        _mm512_mask_storeu_ps(cj + 16, m1, r1);
    }
}

/* dst (ceil(rows / w) slivers of (kc, w)) = rows r0 .. r0+rows-1, steps p0 .. p0+kc-1 of
   a matrix X, zero rows past `rows`; X(r, p) = X[p ldx + r] (t 0) or X[r ldx + p] (t 1).
   op(A) packs as rows i of width MR, t = ta; op(B) as its columns j of width NR, t = !tb.
   Both orders read X along its contiguous direction (a sliver at a time over rows ldx
   apart touched a new page per step: TLB misses, 10% of a step); inlined, so that w is a
   constant and a whole sliver's copy is unrolled. */
MX_AVX512 static inline __attribute__((always_inline)) void mx_sgemm_pack(
    int w, int t, const float* X, ptrdiff_t ldx, ptrdiff_t r0, ptrdiff_t rows, ptrdiff_t p0,
    ptrdiff_t kc, float* dst)
{
    ptrdiff_t rem = rows % w, r, p, s0;
    if (rem)                           /* the last sliver's padding rows */
        memset(dst + (rows - rem) * kc, 0, (size_t)kc * (size_t)w * sizeof(float));
    if (!t)             /* step p: `rows` contiguous values */
        for (p = 0; p < kc; p++) {
            const float* s = X + (p0 + p) * ldx + r0;
            for (s0 = 0; s0 < rows; s0 += w) {
                float* d = dst + s0 * kc + p * w;
                ptrdiff_t n = rows - s0 < w ? rows - s0 : w;
                if (n == w && w == MX_SGEMM_NR)   /* NR values: one masked vector */
                    _mm512_mask_storeu_ps(d, MX_SGEMM_NR_MASK,
                                          _mm512_maskz_loadu_ps(MX_SGEMM_NR_MASK, s + s0));
                else if (n == w)       /* a constant count: one unrolled copy, not a loop */
                    for (r = 0; r < w; r++) d[r] = s[s0 + r];
                else
                    for (r = 0; r < n; r++) d[r] = s[s0 + r];
            }
        }
    else                /* row r: kc contiguous values; a sliver's w rows read side by side */
        for (s0 = 0; s0 < rows; s0 += w) {
            const float* s = X + (r0 + s0) * ldx + p0;
            ptrdiff_t n = rows - s0 < w ? rows - s0 : w;
            float* d = dst + s0 * kc;
            for (p = 0; p < kc; p++)
                for (r = 0; r < n; r++) d[p * w + r] = s[r * ldx + p];
        }
}

/* C (m, n) = alpha op(A) op(B) + beta C, column-major; transa, transb 'N' or 'T'.
   Returns 0, or -1 when this thread's workspace cannot be allocated (C untouched). */
MX_AVX512 static int mx_sgemm(char transa, char transb, ptrdiff_t m, ptrdiff_t n,
                              ptrdiff_t k, float alpha, const float* A, ptrdiff_t lda,
                              const float* B, ptrdiff_t ldb, float beta, float* C,
                              ptrdiff_t ldc)
{
    int ta = transa == 'T' || transa == 't', tb = transb == 'T' || transb == 't';
    ptrdiff_t ncap = n < MX_SGEMM_NC ? n : MX_SGEMM_NC, kcap = k < MX_SGEMM_KC ? k : MX_SGEMM_KC;
    ptrdiff_t mcap = m < MX_SGEMM_MC ? m : MX_SGEMM_MC;
    size_t na, nb;
    float* apack;
    float* bpack;
    char* ws;
    if (m <= 0 || n <= 0)
        return 0;
    if (k <= 0) {                      /* C = beta C, as the BLAS */
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t i = 0; i < m; i++)
                C[j * ldc + i] = beta == 0.0f ? 0.0f : beta * C[j * ldc + i];
        return 0;
    }
    /* apack (MC/MR slivers of (KC, MR)), bpack (NC/NR slivers of (KC, NR)), both rounded
       up to whole slivers, 64-byte aligned in this thread's workspace */
    na = (size_t)((mcap + MX_SGEMM_MR - 1) / MX_SGEMM_MR * MX_SGEMM_MR) * (size_t)kcap;
    nb = (size_t)((ncap + MX_SGEMM_NR - 1) / MX_SGEMM_NR * MX_SGEMM_NR) * (size_t)kcap;
    ws = (char*)mx_workspace((na + nb) * sizeof(float) + 128);
    if (ws == NULL)
        return -1;
    apack = (float*)(ws + ((64 - ((uintptr_t)ws & 63)) & 63));
    bpack = apack + (na + 15) / 16 * 16;
    for (ptrdiff_t j0 = 0; j0 < n; j0 += MX_SGEMM_NC) {
        ptrdiff_t nc = n - j0 < MX_SGEMM_NC ? n - j0 : MX_SGEMM_NC;
        for (ptrdiff_t p0 = 0; p0 < k; p0 += MX_SGEMM_KC) {
            ptrdiff_t kc = k - p0 < MX_SGEMM_KC ? k - p0 : MX_SGEMM_KC;
            float be = p0 == 0 ? beta : 1.0f;
            mx_sgemm_pack(MX_SGEMM_NR, !tb, B, ldb, j0, nc, p0, kc, bpack);
            for (ptrdiff_t i0 = 0; i0 < m; i0 += MX_SGEMM_MC) {
                ptrdiff_t mc = m - i0 < MX_SGEMM_MC ? m - i0 : MX_SGEMM_MC;
                mx_sgemm_pack(MX_SGEMM_MR, ta, A, lda, i0, mc, p0, kc, apack);
                for (ptrdiff_t jr = 0; jr < nc; jr += MX_SGEMM_NR) {
                    int nr = (int)(nc - jr < MX_SGEMM_NR ? nc - jr : MX_SGEMM_NR);
                    for (ptrdiff_t ir = 0; ir < mc; ir += MX_SGEMM_MR)
                        mx_sgemm_kernel(kc, apack + ir * kc, bpack + jr * kc,
                                        C + (j0 + jr) * ldc + i0 + ir, ldc, alpha, be,
                                        (int)(mc - ir < MX_SGEMM_MR ? mc - ir : MX_SGEMM_MR), nr);
                }
            }
        }
    }
    return 0;
}

#else  /* not x86_64 GCC/Clang: never used */

static MX_UNUSED int mx_sgemm_supported(void) { return 0; }
static MX_UNUSED int mx_sgemm_cpu_amd(void) { return 0; }
static MX_UNUSED int mx_sgemm(char transa, char transb, ptrdiff_t m, ptrdiff_t n,
                              ptrdiff_t k, float alpha, const float* A, ptrdiff_t lda,
                              const float* B, ptrdiff_t ldb, float beta, float* C,
                              ptrdiff_t ldc)
{
    (void)transa; (void)transb; (void)m; (void)n; (void)k; (void)alpha; (void)A; (void)lda;
    (void)B; (void)ldb; (void)beta; (void)C; (void)ldc;
    return -1;
}

#endif

#endif /* MX_SGEMM_H */
