/* test_mx_sgemm.c - mx_sgemm.h against a double reference.
 *   every transa x transb, shapes across the micro-tile (32 x 12) and block (MC 192,
 *   KC 384, NC 2064) edges, op(B) read in place and packed (the last shape's block spans
 *   more than MX_SGEMM_INPLACE_B values for either transb; the others less), leading
 *   dimensions larger than the rows, alpha and beta
 *   (beta 0 must not read C: NaN there), k = 0 (C = beta C);
 *   split invariance: C computed whole, by column slices and by row slices is bitwise
 *   the same (what the core's thread-count invariance relies on);
 *   mx_sgemm_bias: the bias added in the epilogue gives the bits of C preset to it.
 * On a CPU without AVX-512F (or a build that is not x86-64 GCC/Clang) the kernel is never
 * called by the core: the program checks the stub of other builds and stops (printing
 * what a supported run prints: the cross check compares the outputs of two machines).
 */
#include <stdlib.h>
#include "mx_sgemm.h"
#include "mx_test.h"

/* op(X)(i, p) of a column-major X with leading dimension ld */
static double el(const float* X, ptrdiff_t ld, int t, ptrdiff_t i, ptrdiff_t p) {
    return t ? X[i * ld + p] : X[p * ld + i];
}

static float* filled(size_t n) {
    float* x = (float*)malloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) x[i] = (float)(mx_test_uniform() * 2.0 - 1.0);
    return x;
}

static void one(int ta, int tb, ptrdiff_t m, ptrdiff_t n, ptrdiff_t k, ptrdiff_t pad,
                float alpha, float beta) {
    ptrdiff_t lda = (ta ? k : m) + pad, ldb = (tb ? n : k) + pad, ldc = m + pad;
    float* A = filled((size_t)lda * (size_t)(ta ? m : k));
    float* B = filled((size_t)ldb * (size_t)(tb ? k : n));
    float* C = filled((size_t)ldc * (size_t)n);
    float* C0 = (float*)malloc((size_t)ldc * (size_t)n * sizeof(float) + 4);
    double worst = 0;
    memcpy(C0, C, (size_t)ldc * (size_t)n * sizeof(float));
    if (beta == 0.0f)
        for (ptrdiff_t i = 0; i < ldc * n; i++) C[i] = NAN;
    MX_CHECK(mx_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, A, lda, B, ldb, beta,
                      C, ldc) == 0, "mx_sgemm returned an error");
    for (ptrdiff_t j = 0; j < n; j++)
        for (ptrdiff_t i = 0; i < ldc; i++) {
            double want, got = C[j * ldc + i], dot = 0, mag = 0;
            if (i >= m) {       /* rows past m: untouched */
                MX_CHECK(beta == 0.0f ? isnan(got) : got == C0[j * ldc + i],
                         "row %ld past m changed", (long)i);
                continue;
            }
            for (ptrdiff_t p = 0; p < k; p++) {
                double t = el(A, lda, ta, i, p) * el(B, ldb, tb, p, j);
                dot += t;
                mag += fabs(t);
            }
            want = alpha * dot + (beta == 0.0f ? 0.0 : beta * (double)C0[j * ldc + i]);
            mag = fabs(alpha) * mag + fabs(beta) * fabs((double)C0[j * ldc + i]) + 1e-30;
            if (fabs(got - want) / mag > worst) worst = fabs(got - want) / mag;
        }
    /* float32 sums of k terms: error <= ~k * 2^-24 of the sum of magnitudes */
    MX_CHECK(worst <= (double)(k + 2) * 1.2e-7, "%c%c m %ld n %ld k %ld pad %ld alpha %g "
             "beta %g: error %g of the magnitudes", ta ? 'T' : 'N', tb ? 'T' : 'N', (long)m,
             (long)n, (long)k, (long)pad, alpha, beta, worst);
    free(A); free(B); free(C); free(C0);
}

/* C whole vs by slices of columns (n) and of rows (m): bitwise equal */
static void splits(int ta, int tb, ptrdiff_t m, ptrdiff_t n, ptrdiff_t k) {
    ptrdiff_t lda = ta ? k : m, ldb = tb ? n : k;
    float* A = filled((size_t)lda * (size_t)(ta ? m : k));
    float* B = filled((size_t)ldb * (size_t)(tb ? k : n));
    float* C1 = filled((size_t)m * (size_t)n);
    float* C2 = (float*)malloc((size_t)m * (size_t)n * sizeof(float));
    float* C3 = (float*)malloc((size_t)m * (size_t)n * sizeof(float));
    char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
    memcpy(C2, C1, (size_t)m * (size_t)n * sizeof(float));
    memcpy(C3, C1, (size_t)m * (size_t)n * sizeof(float));
    mx_sgemm(a, b, m, n, k, 1.0f, A, lda, B, ldb, 1.0f, C1, m);
    for (ptrdiff_t j0 = 0; j0 < n; j0 += 48) {           /* the core's column slices */
        ptrdiff_t nn = n - j0 < 48 ? n - j0 : 48;
        mx_sgemm(a, b, m, nn, k, 1.0f, A, lda, tb ? B + j0 : B + j0 * ldb, ldb, 1.0f,
                 C2 + j0 * m, m);
    }
    for (ptrdiff_t i0 = 0; i0 < m; i0 += 40) {           /* row slices, off the tile grid */
        ptrdiff_t mm = m - i0 < 40 ? m - i0 : 40;
        mx_sgemm(a, b, mm, n, k, 1.0f, ta ? A + i0 * lda : A + i0, lda, B, ldb, 1.0f,
                 C3 + i0, m);
    }
    MX_CHECK(memcmp(C1, C2, (size_t)m * (size_t)n * sizeof(float)) == 0,
             "%c%c: column slices changed the bits", a, b);
    MX_CHECK(memcmp(C1, C3, (size_t)m * (size_t)n * sizeof(float)) == 0,
             "%c%c: row slices changed the bits", a, b);
    free(A); free(B); free(C1); free(C2); free(C3);
}

/* mx_sgemm_bias (beta 0) against C preset to the bias columns with beta 1: bitwise equal */
static void bias_bits(int ta, int tb, ptrdiff_t m, ptrdiff_t n, ptrdiff_t k) {
    ptrdiff_t lda = ta ? k : m, ldb = tb ? n : k;
    float* A = filled((size_t)lda * (size_t)(ta ? m : k));
    float* B = filled((size_t)ldb * (size_t)(tb ? k : n));
    float* bias = filled((size_t)m);
    float* C1 = (float*)malloc((size_t)m * (size_t)n * sizeof(float));
    float* C2 = (float*)malloc((size_t)m * (size_t)n * sizeof(float));
    char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
    for (ptrdiff_t j = 0; j < n; j++)
        for (ptrdiff_t i = 0; i < m; i++) {
            C1[j * m + i] = bias[i];
            C2[j * m + i] = NAN;                /* beta 0: never read */
        }
    mx_sgemm(a, b, m, n, k, 1.0f, A, lda, B, ldb, 1.0f, C1, m);
    MX_CHECK(mx_sgemm_bias(a, b, m, n, k, 1.0f, A, lda, B, ldb, 0.0f, C2, m, bias) == 0,
             "mx_sgemm_bias returned an error");
    MX_CHECK(memcmp(C1, C2, (size_t)m * (size_t)n * sizeof(float)) == 0,
             "%c%c m %ld n %ld k %ld: the bias epilogue changed the bits", a, b, (long)m,
             (long)n, (long)k);
    free(A); free(B); free(bias); free(C1); free(C2);
}

int main(void) {
    static const ptrdiff_t shapes[][3] = {
        {1, 1, 1}, {32, 12, 7}, {31, 11, 5}, {33, 13, 17}, {64, 24, 384}, {65, 25, 385},
        {193, 37, 100}, {200, 2070, 30}, {100, 5, 800}, {7, 300, 64},
        {40, 700, 500}};
    if (!mx_sgemm_supported()) {
#if !MX_SGEMM_X86
        float c = 1.0f;        /* the stub of other builds refuses (x86: never called here) */
        MX_CHECK(mx_sgemm('N', 'N', 1, 1, 1, 1.0f, &c, 1, &c, 1, 0.0f, &c, 1) == -1,
                 "the stub must refuse");
#endif
        printf("OK (%d failures)\n", mx_test_failures);
        return mx_test_failures != 0;
    }
    for (int t = 0; t < 4; t++) {
        int ta = t & 1, tb = t >> 1;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            one(ta, tb, shapes[s][0], shapes[s][1], shapes[s][2], (ptrdiff_t)(s % 3) * 3,
                s % 2 ? 0.5f : 1.0f, s % 4 == 0 ? 0.0f : (s % 4 == 1 ? 1.0f : -0.75f));
        one(ta, tb, 40, 30, 0, 1, 1.0f, 0.5f);        /* k = 0: C = beta C */
        one(ta, tb, 40, 30, 0, 0, 1.0f, 0.0f);        /* k = 0, beta 0: C = 0 */
        splits(ta, tb, 211, 150, 400);
        bias_bits(ta, tb, 211, 150, 400);          /* k past KC: the bias once */
        bias_bits(ta, tb, 45, 7, 0);               /* k = 0: C = bias */
        bias_bits(ta, tb, 64, 256, 64);
    }
    printf("OK (%d failures)\n", mx_test_failures);
    return mx_test_failures != 0;
}
