/* test_mx_recurrent.c - the kernels of mx_recurrent.h (the one-token recurrent step).
 *
 * - mx_half_to_float on all 65536 half bit patterns against the definition
 *   (-1)^s 2^(e-15) (1 + m/1024), subnormals 2^-14 m/1024, inf, NaN: exact;
 * - mx_linear_half_f (the CPU's fastest path) and mx_linear_half_portable_f (B 3, IC 70:
 *   a vector body and a tail; output blocks) against a double sum of the same converted
 *   weights: within float rounding of the sum;
 * - mx_conv_step_f / mx_scan_step_f / _d against the formulas of the header evaluated in
 *   double (K 4 and K 1, zoh and euler), and the tail shift.
 */
#include <stdlib.h>
#include "mx_recurrent.h"
#include "mx_test.h"

static double half_ref(uint32_t h) {
    int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
    v = e ? ldexp(1.0 + m / 1024.0, e - 15) : ldexp(m / 1024.0, -14);
    return s ? -v : v;
}

int main(void) {
    uint32_t h;
    int i, b, o, d, n, k;
    /* 1. every half */
    for (h = 0; h < 65536; h++) {
        float f = mx_half_to_float((uint16_t)h);
        double r = half_ref(h);
        if (isnan(r)) MX_CHECK(isnan(f), "half %04x -> %g, want NaN", (unsigned)h, (double)f);
        else MX_CHECK((double)f == r && !signbit(f) == !signbit(r), "half %04x -> %g, want %g",
                      (unsigned)h, (double)f, r);
    }
    /* 2. the float16-weight product */
    {
        enum { B = 3, IC = 70, OC = 130 };
        static uint16_t w[OC * IC];
        static float x[B * IC], bias[OC], out[B * OC], out2[B * OC], row[IC];
        for (i = 0; i < OC * IC; i++) w[i] = (uint16_t)(0x2000 + (int)(0x3000 * mx_test_uniform()))
                                             | (mx_test_uniform() < 0.5 ? 0x8000 : 0);
        for (i = 0; i < B * IC; i++) x[i] = (float)(2 * mx_test_uniform() - 1);
        for (i = 0; i < OC; i++) bias[i] = (float)(mx_test_uniform() - 0.5);
        mx_linear_half_f(out, x, w, bias, B, IC, OC, 0, 64);
        mx_linear_half_f(out, x, w, bias, B, IC, OC, 64, OC);
        mx_linear_half_portable_f(out2, x, w, bias, B, IC, OC, 0, OC);
        for (o = 0; o < OC; o++) {
            mx_half_row_to_float(row, w + o * IC, IC);
            for (b = 0; b < B; b++) {
                double s = bias[o], mag = fabs(bias[o]);
                for (i = 0; i < IC; i++) {
                    MX_CHECK(row[i] == (float)half_ref(w[o * IC + i]), "row %d %d", o, i);
                    s += (double)row[i] * x[b * IC + i];
                    mag += fabs((double)row[i] * x[b * IC + i]);
                }
                MX_CHECK(fabs(out[b * OC + o] - s) <= 1e-6 * mag, "out[%d,%d] %g want %g",
                         b, o, (double)out[b * OC + o], s);
                MX_CHECK(fabs(out2[b * OC + o] - s) <= 1e-6 * mag, "portable out[%d,%d] %g want %g",
                         b, o, (double)out2[b * OC + o], s);
            }
        }
    }
    /* 3. conv and scan steps (float and double) */
    {
        enum { D = 37, N = 5 };
        for (k = 1; k <= 4; k += 3) {
            int zoh;
            for (zoh = 0; zoh <= 1; zoh++) {
                static float xc[D], wc[D * 4], bc[D], tail[D * 3], tail0[D * 3], conv[D];
                static float h[D * N], h0[D * N], A[D * N], Ai[D * N], Bs[N], Cs[N], Dv[D],
                    delta[D], y[D];
                static double xcd[D], wcd[D * 4], bcd[D], taild[D * 3], convd[D];
                static double hd[D * N], Ad[D * N], Aid[D * N], Bsd[N], Csd[N], Dvd[D],
                    deltad[D], yd[D];
                for (d = 0; d < D; d++) {
                    xc[d] = (float)(xcd[d] = (float)(2 * mx_test_uniform() - 1));
                    bc[d] = (float)(bcd[d] = (float)(mx_test_uniform() - 0.5));
                    Dv[d] = (float)(Dvd[d] = (float)(mx_test_uniform() + 0.5));
                    delta[d] = (float)(deltad[d] = (float)(0.01 + mx_test_uniform()));
                    for (i = 0; i < k; i++) wc[d * k + i] = (float)(wcd[d * k + i] = (float)(mx_test_uniform() - 0.5));
                    for (i = 0; i < k - 1; i++)
                        tail0[d * (k - 1) + i] = tail[d * (k - 1) + i] =
                            (float)(taild[d * (k - 1) + i] = (float)(mx_test_uniform() - 0.5));
                    for (n = 0; n < N; n++) {
                        Ad[d * N + n] = A[d * N + n] = -(float)(0.1 + 3 * mx_test_uniform());
                        Ai[d * N + n] = 1 / A[d * N + n];
                        Aid[d * N + n] = Ai[d * N + n];
                        hd[d * N + n] = h0[d * N + n] = h[d * N + n] = (float)(mx_test_uniform() - 0.5);
                    }
                }
                for (n = 0; n < N; n++) {
                    Bs[n] = (float)(Bsd[n] = (float)(mx_test_uniform() - 0.5));
                    Cs[n] = (float)(Csd[n] = (float)(mx_test_uniform() - 0.5));
                }
                mx_conv_step_f(conv, tail, xc, wc, bc, D, k, k - 1);
                mx_conv_step_d(convd, taild, xcd, wcd, bcd, D, k, k - 1);
                for (d = 0; d < D; d++) {
                    double want = bcd[d] + wcd[d * k] * xcd[d];
                    for (i = 1; i < k; i++) want += wcd[d * k + i] * tail0[d * (k - 1) + k - 1 - i];
                    MX_CHECK(fabs(conv[d] - want) < 1e-6 && fabs(convd[d] - want) < 1e-12,
                             "conv k %d d %d: %g %g want %g", k, d, (double)conv[d], convd[d], want);
                    for (i = 0; i + 1 < k - 1; i++)
                        MX_CHECK(tail[d * (k - 1) + i] == tail0[d * (k - 1) + i + 1], "tail shift");
                    if (k > 1) MX_CHECK(tail[d * (k - 1) + k - 2] == xc[d], "tail newest");
                }
                mx_scan_step_f(y, h, xc, delta, A, Ai, Bs, Cs, Dv, D, N, zoh);
                mx_scan_step_d(yd, hd, xcd, deltad, Ad, Aid, Bsd, Csd, Dvd, D, N, zoh);
                for (d = 0; d < D; d++) {
                    double want = Dvd[d] * xcd[d];
                    for (n = 0; n < N; n++) {
                        double em = expm1(deltad[d] * Ad[d * N + n]);
                        double bb = (zoh ? em * Aid[d * N + n] : deltad[d]) * Bsd[n];   /* 1/A as given */
                        double hn = (1 + em) * h0[d * N + n] + bb * xcd[d];
                        want += Csd[n] * hn;
                        MX_CHECK(fabs(h[d * N + n] - hn) < 1e-6 && fabs(hd[d * N + n] - hn) < 1e-12,
                                 "h zoh %d d %d n %d: %g %g want %g", zoh, d, n,
                                 (double)h[d * N + n], hd[d * N + n], hn);
                    }
                    MX_CHECK(fabs(y[d] - want) < 1e-5 && fabs(yd[d] - want) < 1e-12,
                             "y zoh %d d %d: %g %g want %g", zoh, d, (double)y[d], yd[d], want);
                }
            }
        }
    }
    printf("%s (%d failures)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures);
    return mx_test_failures != 0;
}
