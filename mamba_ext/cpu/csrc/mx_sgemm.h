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
 *     to whole slivers, in this thread's workspace. op(A) with transa 'T' (the forward's
 *     W^T) is transposed 16 x 16 values at a time in registers.
 *   - Small products (a small model's, or a group's rows: op(B)'s block spans at most
 *     MX_SGEMM_INPLACE_B values) read op(B)'s whole slivers in place instead: the copy of
 *     B cost as much as a third of the multiplies there (docs/performance.md, session 44);
 *     large blocks keep the packed copy (one page per step of a transb 'T' operand
 *     otherwise).
 *   - Micro-kernel MR x NR = 32 x 12: 24 zmm accumulators, per step two loads of A's
 *     sliver and 12 broadcasts of B's; edge tiles store through masks, and a sliver of at
 *     most 16 rows multiplies only those (12 accumulators).
 *   - mx_sgemm_bias: the bias of a linear layer added in the epilogue (the bits of a
 *     bias preloaded into C with beta 1, without copying it into every row).
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
/* op(B)'s block is read in place up to this many values of B's span (1 MiB) */
#define MX_SGEMM_INPLACE_B (1 << 18)

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

/* How the micro-kernel reads op(B)'s NR columns at step p: from a packed sliver
   (b[p NR + j]), or in place from the caller's matrix, with its leading dimension ldb:
   MX_B_ROWS for transb 'T' (step p is a row of B, its NR values contiguous:
   b[p ldb + j]), MX_B_COLS for transb 'N' (column j contiguous over the steps:
   b[j ldb + p]). In place saves the copy where op(B)'s block is small enough to stay in
   the caches (mx_sgemm's choice); the sums are the same, so are the bits. */
enum { MX_B_PACKED = 0, MX_B_ROWS = 1, MX_B_COLS = 2 };

/* c (mr <= MR rows, nr <= NR columns, ldc) = alpha a.b + beta c (+ bias (mr,), one value
   per row, where bias is not NULL); a (kc, MR) a packed sliver, b op(B)'s NR columns read
   as `mode` says (all NR of them valid unless packed); half: mr <= 16, so only the
   sliver's first 16 rows are multiplied (a product of few rows, e.g. dt_proj's dx of dtRank
   rows, does half the work of a whole tile; the sums of those rows are the same) */
MX_AVX512 static inline __attribute__((always_inline)) void mx_sgemm_tile(
    int mode, int half, ptrdiff_t kc, const float* MX_RESTRICT a, const float* MX_RESTRICT b,
    ptrdiff_t ldb, float* MX_RESTRICT c, ptrdiff_t ldc, float alpha, float beta,
    const float* MX_RESTRICT bias, int mr, int nr)
{
    __m512 c0[MX_SGEMM_NR], c1[MX_SGEMM_NR];
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    __mmask16 m0 = (__mmask16)(mr >= 16 ? 0xFFFFu : (1u << mr) - 1u);
    __mmask16 m1 = (__mmask16)(mr <= 16 ? 0u : (mr >= 32 ? 0xFFFFu : (1u << (mr - 16)) - 1u));
    /* MX_B_COLS: columns 0-2, 3-5, 6-8, 9-11 from four bases, each + 0, ldb, 2 ldb
       (addressing modes of one base and one scaled index) */
    const float* b3 = b + 3 * ldb;
    const float* b6 = b + 6 * ldb;
    const float* b9 = b + 9 * ldb;
    ptrdiff_t p, bstep = mode == MX_B_PACKED ? MX_SGEMM_NR : (mode == MX_B_ROWS ? ldb : 1);
    int j;
    for (j = 0; j < MX_SGEMM_NR; j++) {
        c0[j] = _mm512_setzero_ps();
        c1[j] = _mm512_setzero_ps();
    }
    for (p = 0; p < kc; p++) {
        __m512 a0 = _mm512_load_ps(a), a1 = half ? a0 : _mm512_load_ps(a + 16);
        for (j = 0; j < MX_SGEMM_NR; j++) {
            const float* bj = mode != MX_B_COLS ? b + j
                            : (j < 3 ? b : j < 6 ? b3 : j < 9 ? b6 : b9) + (j % 3) * ldb;
            __m512 bv = _mm512_set1_ps(*bj);
            c0[j] = _mm512_fmadd_ps(a0, bv, c0[j]);
            if (!half)
                c1[j] = _mm512_fmadd_ps(a1, bv, c1[j]);
        }
        a += MX_SGEMM_MR;
        b += bstep;
        if (mode == MX_B_COLS) {
            b3++;
            b6++;
            b9++;
        }
    }
    __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (j = 0; j < nr; j++) {
        float* cj = c + j * ldc;
        __m512 r0 = _mm512_mul_ps(va, c0[j]), r1 = _mm512_mul_ps(va, c1[j]);
        if (bias) {        /* the same rounding as bias preloaded into c with beta 1 */
            r0 = _mm512_add_ps(r0, bias0);
            r1 = _mm512_add_ps(r1, bias1);
        }
        if (beta != 0.0f) {
            r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cj), r0);
            r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cj + 16), r1);
        }
        _mm512_mask_storeu_ps(cj, m0, r0);
        if (!half)
            _mm512_mask_storeu_ps(cj + 16, m1, r1);
    }
}

/* mx_sgemm_tile with `mode` and `half` constants in each branch (one loop compiled per pair) */
MX_AVX512 static void mx_sgemm_kernel(int mode, ptrdiff_t kc, const float* MX_RESTRICT a,
                                      const float* MX_RESTRICT b, ptrdiff_t ldb,
                                      float* MX_RESTRICT c, ptrdiff_t ldc, float alpha,
                                      float beta, const float* MX_RESTRICT bias, int mr,
                                      int nr)
{
    if (mr <= 16) {
        if (mode == MX_B_ROWS)
            mx_sgemm_tile(MX_B_ROWS, 1, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
        else if (mode == MX_B_COLS)
            mx_sgemm_tile(MX_B_COLS, 1, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
        else
            mx_sgemm_tile(MX_B_PACKED, 1, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
    } else if (mode == MX_B_ROWS)
        mx_sgemm_tile(MX_B_ROWS, 0, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
    else if (mode == MX_B_COLS)
        mx_sgemm_tile(MX_B_COLS, 0, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
    else
        mx_sgemm_tile(MX_B_PACKED, 0, kc, a, b, ldb, c, ldc, alpha, beta, bias, mr, nr);
}

/* dst[q ldd + i] = src[i lds + q] for i, q < 16: a 16 x 16 block transposed in registers
   (pairs of floats, then of pairs, then of 128-bit lanes, twice) */
MX_AVX512 static inline __attribute__((always_inline)) void mx_sgemm_transpose16(
    const float* src, ptrdiff_t lds, float* dst, ptrdiff_t ldd)
{
    __m512 r[16], t[16];
    int i, j;
    for (i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (i = 0; i < 16; i += 2) {      /* t[i], t[i+1]: rows i, i+1 interleaved */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (i = 0; i < 16; i += 4) {      /* r[i + j]: rows i..i+3 at steps j, j+4, j+8, j+12 */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (j = 0; j < 4; j++) {          /* rows 0-7 and 8-15 at steps j, j+8 (t[j], t[8+j])
                                          and j+4, j+12 (t[4+j], t[12+j]) */
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    }
    for (j = 0; j < 4; j++) {          /* step q: rows 0-15 */
        _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
        _mm512_storeu_ps(dst + (j + 8) * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD));
        _mm512_storeu_ps(dst + (j + 4) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));
        _mm512_storeu_ps(dst + (j + 12) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD));
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
            p = 0;
            if (w % 16 == 0 && n == w)     /* whole 16 x 16 blocks transposed in registers */
                for (; p + 16 <= kc; p += 16)
                    for (r = 0; r < w; r += 16)
                        mx_sgemm_transpose16(s + r * ldx + p, ldx, d + p * w + r, w);
            for (; p < kc; p++)
                for (r = 0; r < n; r++) d[p * w + r] = s[r * ldx + p];
        }
}

/* C (m, n) = alpha op(A) op(B) + beta C + bias, column-major; transa, transb 'N' or 'T';
   bias (m,) (one value per row of C, added to every column) or NULL. With beta 0 the
   same bits as C preset to the bias columns and beta 1 (alpha op(A) op(B) + bias rounded
   once), without that copy. Returns 0, or -1 when this thread's workspace cannot be allocated (C
   untouched). */
MX_AVX512 static int mx_sgemm_bias(char transa, char transb, ptrdiff_t m, ptrdiff_t n,
                                   ptrdiff_t k, float alpha, const float* A, ptrdiff_t lda,
                                   const float* B, ptrdiff_t ldb, float beta, float* C,
                                   ptrdiff_t ldc, const float* bias)
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
    if (k <= 0) {                      /* C = beta C (+ bias), as the BLAS */
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t i = 0; i < m; i++)
                C[j * ldc + i] = (beta == 0.0f ? 0.0f : beta * C[j * ldc + i])
                                 + (bias ? bias[i] : 0.0f);
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
            /* op(B)'s whole slivers read in place (bmode) where its (kc, nc) block spans
               at most MX_SGEMM_INPLACE_B values of B: transb 'N' reads NR columns, each
               contiguous; 'T' kc rows, ldb apart. Else (and always for a last partial
               sliver, whose padding columns must be zeros) from the packed copy. */
            int bmode = (tb ? kc * ldb : nc * ldb) <= MX_SGEMM_INPLACE_B
                        ? (tb ? MX_B_ROWS : MX_B_COLS) : MX_B_PACKED;
            ptrdiff_t nfull = bmode == MX_B_PACKED ? 0 : nc / MX_SGEMM_NR * MX_SGEMM_NR;
            if (nfull < nc)                  /* the slivers from nfull on, packed */
                mx_sgemm_pack(MX_SGEMM_NR, !tb, B, ldb, j0 + nfull, nc - nfull, p0, kc,
                              bpack + nfull * kc);
            for (ptrdiff_t i0 = 0; i0 < m; i0 += MX_SGEMM_MC) {
                ptrdiff_t mc = m - i0 < MX_SGEMM_MC ? m - i0 : MX_SGEMM_MC;
                mx_sgemm_pack(MX_SGEMM_MR, ta, A, lda, i0, mc, p0, kc, apack);
                for (ptrdiff_t jr = 0; jr < nc; jr += MX_SGEMM_NR) {
                    int nr = (int)(nc - jr < MX_SGEMM_NR ? nc - jr : MX_SGEMM_NR);
                    int mode = jr < nfull ? bmode : MX_B_PACKED;
                    const float* bs = mode == MX_B_PACKED ? bpack + jr * kc
                                    : tb ? B + p0 * ldb + j0 + jr : B + (j0 + jr) * ldb + p0;
                    for (ptrdiff_t ir = 0; ir < mc; ir += MX_SGEMM_MR)
                        mx_sgemm_kernel(mode, kc, apack + ir * kc, bs, ldb,
                                        C + (j0 + jr) * ldc + i0 + ir, ldc, alpha, be,
                                        bias && p0 == 0 ? bias + i0 + ir : NULL,
                                        (int)(mc - ir < MX_SGEMM_MR ? mc - ir : MX_SGEMM_MR), nr);
                }
            }
        }
    }
    return 0;
}

/* C (m, n) = alpha op(A) op(B) + beta C: the BLAS's sgemm (mx_sgemm_bias without a bias) */
MX_AVX512 static int mx_sgemm(char transa, char transb, ptrdiff_t m, ptrdiff_t n,
                              ptrdiff_t k, float alpha, const float* A, ptrdiff_t lda,
                              const float* B, ptrdiff_t ldb, float beta, float* C,
                              ptrdiff_t ldc)
{
    return mx_sgemm_bias(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, NULL);
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
static MX_UNUSED int mx_sgemm_bias(char transa, char transb, ptrdiff_t m, ptrdiff_t n,
                                   ptrdiff_t k, float alpha, const float* A, ptrdiff_t lda,
                                   const float* B, ptrdiff_t ldb, float beta, float* C,
                                   ptrdiff_t ldc, const float* bias)
{
    (void)bias;
    return mx_sgemm(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

#endif

#endif /* MX_SGEMM_H */
