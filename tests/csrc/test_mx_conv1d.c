/* test_mx_conv1d.c - the conv1d jobs of mx_conv1d.h against the plain formula (double).
 *
 * B = 2, L = 11, D = 260 channels (a full job of CB = 256 and a partial one of 4), K = 11
 * taps (two passes: KB = 8 and 3), row blocks of RB = 5 rows (blocks that span the end of
 * a sequence, and a last partial one), xc rows ld_xc = 2D apart (the xc half of xz):
 *   forward: conv[b,t,d] = bias[d] + sum_{k<=t} w[d,k] xc[b,t-k,d], to 1e-14;
 *   backward: dxc, and dweight, dbias through the partial sums and mx_conv1d_reduce,
 *   against the transposed formula, to 1e-14; with add 0 (dxc written, not read) the
 *   same dxc bitwise over NaN, the z half of each row untouched.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "mx_conv1d.h"
#include "mx_test.h"

enum { B = 2, L = 11, D = 260, K = 11, LDX = 2 * D, M = B * L, RB = 5,
       NBLK = (M + RB - 1) / RB };

static void run_jobs(int backward, int add, double* conv, double* dxc, double* dw, double* db,
                     const double* dconv, const double* xc, const double* w,
                     const double* bias) {
    static double dw_part[NBLK * K * D], db_part[NBLK * D];
    ptrdiff_t r0, d0, k0;
    for (r0 = 0; r0 < M; r0 += RB)
        for (d0 = 0; d0 < D; d0 += MX_CONV_CB)
            for (k0 = 0; k0 < K; k0 += MX_CONV_KB) {
                int n = (int)(D - d0 < MX_CONV_CB ? D - d0 : MX_CONV_CB);
                int kn = (int)(K - k0 < MX_CONV_KB ? K - k0 : MX_CONV_KB);
                ptrdiff_t r1 = r0 + RB < M ? r0 + RB : M, blk = r0 / RB;
                if (backward)
                    mx_conv1d_backward_d(dxc, LDX, dw_part + blk * K * D, db_part + blk * D,
                                         dconv, xc, LDX, w, L, D, K, r0, r1, d0, n, k0, kn,
                                         add);
                else
                    mx_conv1d_forward_d(conv, xc, LDX, w, bias, L, D, K, r0, r1, d0, n, k0,
                                        kn);
            }
    if (backward)
        for (d0 = 0; d0 < D; d0 += MX_CONV_CB)
            mx_conv1d_reduce_d(dw, db, dw_part, db_part, NBLK, D, K, d0,
                               (int)(D - d0 < MX_CONV_CB ? D - d0 : MX_CONV_CB));
}

int main(void) {
    static double xc[B * L * LDX], w[D * K], bias[D], conv[B * L * D], dconv[B * L * D];
    static double dxc[B * L * LDX], dw[D * K], db[D];
    static double r_dxc[B * L * LDX], r_dw[D * K], r_db[D];
    static double dxc2[B * L * LDX], dw2[D * K], db2[D];
    const double seven = 7.0;
    double err = 0, errb = 0;
    int b, t, d, k, i;
    for (i = 0; i < B * L * LDX; i++) xc[i] = mx_test_uniform() - 0.5;
    for (i = 0; i < D * K; i++) w[i] = mx_test_uniform() - 0.5;
    for (i = 0; i < D; i++) bias[i] = mx_test_uniform() - 0.5;
    for (i = 0; i < B * L * D; i++) dconv[i] = mx_test_uniform() - 0.5;

    run_jobs(0, 1, conv, NULL, NULL, NULL, NULL, xc, w, bias);
    for (b = 0; b < B; b++) for (t = 0; t < L; t++) for (d = 0; d < D; d++) {
        double want = bias[d];
        for (k = 0; k <= t && k < K; k++) want += w[d * K + k] * xc[(b * L + t - k) * LDX + d];
        err = fmax(err, fabs(conv[(b * L + t) * D + d] - want));
    }
    MX_CHECK(err <= 1e-14, "forward error %g", err);

    run_jobs(1, 1, NULL, dxc, dw, db, dconv, xc, w, NULL);
    for (b = 0; b < B; b++) for (t = 0; t < L; t++) for (d = 0; d < D; d++) {
        double g = dconv[(b * L + t) * D + d];
        r_db[d] += g;
        for (k = 0; k <= t && k < K; k++) {
            r_dxc[(b * L + t - k) * LDX + d] += g * w[d * K + k];
            r_dw[d * K + k] += g * xc[(b * L + t - k) * LDX + d];
        }
    }
    for (i = 0; i < B * L * LDX; i++) errb = fmax(errb, fabs(dxc[i] - r_dxc[i]));
    for (i = 0; i < D * K; i++) errb = fmax(errb, fabs(dw[i] - r_dw[i]));
    for (i = 0; i < D; i++) errb = fmax(errb, fabs(db[i] - r_db[i]));
    MX_CHECK(errb <= 1e-14, "backward error %g", errb);
    /* the z half of each xz row (columns D .. 2D-1) is never written */
    for (i = 0; i < B * L; i++) for (d = D; d < LDX; d++)
        MX_CHECK(dxc[i * LDX + d] == 0.0, "dxc wrote outside its half at row %d", i);
    /* add 0: the same dxc bitwise over NaN (not read), the z half untouched */
    for (i = 0; i < B * L * LDX; i++) dxc2[i] = i % LDX < D ? NAN : 7.0;
    run_jobs(1, 0, NULL, dxc2, dw2, db2, dconv, xc, w, NULL);
    for (i = 0; i < B * L * LDX; i++)
        MX_CHECK(memcmp(&dxc2[i], i % LDX < D ? &dxc[i] : &seven, sizeof(double)) == 0,
                 "add 0: dxc[%d] = %g", i, dxc2[i]);
    printf("conv1d: forward error %.2e, backward error %.2e\n", err, errb);
    printf("%s (%d failure%s)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures,
           mx_test_failures == 1 ? "" : "s");
    return mx_test_failures ? 1 : 0;
}
