/* test_mx_scan.c - the chunk kernels of mx_scan.h against a plain double reference.
 *
 * One job of G = MX_SCAN_G lanes over n_steps = 13 steps, N = 5 states, Bs/Cs rows
 * ld_bc = 2N + 3 apart (as columns of xproj), both discretizations:
 *   forward: y and the stored states (hstep = N*G) against the sequential recurrence
 *     h[t] = exp(delta A) h[t-1] + b_bar u[t] in double (b_bar = expm1(delta A)/A Bs, or
 *     delta Bs), y = Cs.h + D u; float32 within 2e-5 relative of the max, double 1e-13;
 *   the in-place forward (hstep = 0) gives bitwise the same y and last state;
 *   a negative delta in some steps (delta*A > 0: the guarded expm1 of those steps)
 *   within the same tolerances, and delta*A > 88 stores em1 = +inf;
 *   backward (double): every gradient against central finite differences of
 *     loss = sum(y * dy) + sum(h_last * G), G the incoming carry, along a random
 *     direction per input (rel. error <= 1e-7).
 * Prints one line per check group.
 */
#include <stdlib.h>
#include "mx_scan.h"
#include "mx_test.h"

enum { G = MX_SCAN_G, GB = MX_SCAN_GB, S = 13, N = 5, LDBC = 2 * N + 3 };

typedef struct {              /* inputs of one job (double) */
    double delta[S * G], u[S * G], bc[S * LDBC], A[N * G], Dl[G], h0[N * G];
} inputs_t;

static void fill(double* a, int n, double lo, double hi) {
    int i;
    for (i = 0; i < n; i++) a[i] = lo + (hi - lo) * mx_test_uniform();
}

static void make_inputs(inputs_t* in) {
    fill(in->delta, S * G, 0.01, 1.5);
    fill(in->u, S * G, -1.0, 1.0);
    fill(in->bc, S * LDBC, -1.0, 1.0);
    fill(in->A, N * G, -3.0, -0.05);
    fill(in->Dl, G, 0.0, 2.0);
    fill(in->h0, N * G, -0.5, 0.5);
}

/* reference: y (S, G), h_last (N, G) */
static void reference(const inputs_t* in, int zoh, double* y, double* h_last) {
    double h[N * G];
    int s, n, g;
    memcpy(h, in->h0, sizeof h);
    for (s = 0; s < S; s++)
        for (g = 0; g < G; g++) {
            double acc = in->Dl[g] * in->u[s * G + g];
            for (n = 0; n < N; n++) {
                double dA = in->delta[s * G + g] * in->A[n * G + g];
                double bb = (zoh ? expm1(dA) / in->A[n * G + g] : in->delta[s * G + g])
                            * in->bc[s * LDBC + n];
                h[n * G + g] = exp(dA) * h[n * G + g] + bb * in->u[s * G + g];
                acc += in->bc[s * LDBC + N + n] * h[n * G + g];
            }
            y[s * G + g] = acc;
        }
    memcpy(h_last, h, sizeof h);
}

static void run_forward_d(const inputs_t* in, int zoh, double* y, double* hs /* (S+1, N, G) */) {
    static double em1[S * N * G], Ainv[N * G];
    int i;
    for (i = 0; i < N * G; i++) Ainv[i] = 1 / in->A[i];
    memcpy(hs, in->h0, sizeof in->h0);
    mx_scan_forward_chunk_d(S, N, zoh, in->delta, in->u, G, in->bc, in->bc + N, LDBC, in->A,
                            Ainv, N * G, hs, em1, y, in->Dl);
}

static double loss_of(const inputs_t* in, int zoh, const double* dy, const double* Gc) {
    double y[S * G], hl[N * G], l = 0;
    int i;
    reference(in, zoh, y, hl);
    for (i = 0; i < S * G; i++) l += y[i] * dy[i];
    for (i = 0; i < N * G; i++) l += hl[i] * Gc[i];
    return l;
}

static void check_forward(int zoh, int neg) {
    static inputs_t in;
    static double y_ref[S * G], hl_ref[N * G], y[S * G], hs[(S + 1) * N * G];
    static float fdelta[S * G], fu[S * G], fbc[S * LDBC], fA[N * G], fAi[N * G], fD[G];
    static float fh[(S + 1) * N * G], fem[S * N * G], fy[S * G];
    static float gh[N * G], gem[N * G], gy[S * G];
    double err = 0, errf = 0, scale = 0;
    int i;
    make_inputs(&in);
    if (neg) {              /* one lane of two steps: delta*A > 0 */
        in.delta[3 * G + 5] = -0.8;
        in.delta[7 * G + 40] = -0.3;
    }
    reference(&in, zoh, y_ref, hl_ref);
    run_forward_d(&in, zoh, y, hs);
    for (i = 0; i < S * G; i++) {
        scale = fmax(scale, fabs(y_ref[i]));
        err = fmax(err, fabs(y[i] - y_ref[i]));
    }
    for (i = 0; i < N * G; i++) err = fmax(err, fabs(hs[S * N * G + i] - hl_ref[i]));
    MX_CHECK(err <= 1e-13 * scale, "double forward (zoh=%d): error %g, scale %g", zoh, err, scale);

    for (i = 0; i < S * G; i++) { fdelta[i] = (float)in.delta[i]; fu[i] = (float)in.u[i]; }
    for (i = 0; i < S * LDBC; i++) fbc[i] = (float)in.bc[i];
    for (i = 0; i < N * G; i++) { fA[i] = (float)in.A[i]; fAi[i] = 1 / fA[i]; fh[i] = (float)in.h0[i]; }
    for (i = 0; i < G; i++) fD[i] = (float)in.Dl[i];
    mx_scan_forward_chunk_f(S, N, zoh, fdelta, fu, G, fbc, fbc + N, LDBC, fA, fAi, N * G, fh,
                            fem, fy, fD);
    for (i = 0; i < S * G; i++) errf = fmax(errf, fabs((double)fy[i] - y_ref[i]));
    MX_CHECK(errf <= 2e-5 * scale, "float forward (zoh=%d): error %g, scale %g", zoh, errf, scale);

    /* in place (hstep = 0): the same arithmetic, so bitwise the same y and last state */
    for (i = 0; i < N * G; i++) gh[i] = (float)in.h0[i];
    mx_scan_forward_chunk_f(S, N, zoh, fdelta, fu, G, fbc, fbc + N, LDBC, fA, fAi, 0, gh, gem,
                            gy, fD);
    MX_CHECK(memcmp(gy, fy, sizeof gy) == 0, "in-place forward y differs (zoh=%d)", zoh);
    MX_CHECK(memcmp(gh, fh + S * N * G, sizeof gh) == 0, "in-place last state differs");
    if (neg) {              /* delta*A = 120 > 88: expm1 overflows to +inf */
        fdelta[9 * G + 2] = -40.0f;
        fA[0 * G + 2] = -3.0f;
        mx_scan_forward_chunk_f(S, N, zoh, fdelta, fu, G, fbc, fbc + N, LDBC, fA, fAi, N * G,
                                fh, fem, fy, fD);
        MX_CHECK(isinf(fem[(9 * N + 0) * G + 2]) && fem[(9 * N + 0) * G + 2] > 0,
                 "expm1 of delta*A = 120: %g, want +inf", (double)fem[(9 * N + 0) * G + 2]);
    }
    printf("forward  zoh=%d%s: double error %.2e, float error %.2e (of max |y| %.3f)\n", zoh,
           neg ? ", delta < 0 in 2 steps" : "", err, errf, scale);
}

/* directional derivative of loss along v applied to one input array */
static double fd_along(inputs_t* in, double* field, const double* v, int n, int zoh,
                       const double* dy, const double* Gc) {
    static double save[S * G + S * LDBC + N * G];   /* larger than any input */
    const double eps = 1e-6;
    double lp, lm;
    int i;
    memcpy(save, field, n * sizeof(double));
    for (i = 0; i < n; i++) field[i] = save[i] + eps * v[i];
    lp = loss_of(in, zoh, dy, Gc);
    for (i = 0; i < n; i++) field[i] = save[i] - eps * v[i];
    lm = loss_of(in, zoh, dy, Gc);
    memcpy(field, save, n * sizeof(double));
    return (lp - lm) / (2 * eps);
}

static void check_backward(int zoh) {
    static inputs_t in;
    static double dy[S * G], Gc[N * G], y[S * G], hs[(S + 1) * N * G], em1[S * N * G];
    static double Ainv[N * G], carry[N * G], dBC[S * 2 * N * GB], dA[N * G], dD[G];
    static double du[S * G], dd[S * G], du0[S * G], dd0[S * G], v[S * LDBC + S * G + N * G];
    double an, fd, worst = 0;
    int i, s, n, g, k;
    make_inputs(&in);
    fill(dy, S * G, -1, 1);
    fill(Gc, N * G, -1, 1);
    run_forward_d(&in, zoh, y, hs);
    for (i = 0; i < N * G; i++) Ainv[i] = 1 / in.A[i];
    /* em1 of the stored states, as the driver's recomputation gives them */
    mx_scan_forward_chunk_d(S, N, zoh, in.delta, in.u, G, in.bc, in.bc + N, LDBC, in.A, Ainv,
                            N * G, hs, em1, NULL, in.Dl);
    /* du, dd written (add 0) over NaN: not read; then added (add 1) to 1.0: 1 + the same */
    for (k = 0; k < 2; k++) {
        memcpy(carry, Gc, sizeof carry);
        memset(dA, 0, sizeof dA); memset(dD, 0, sizeof dD);
        for (i = 0; i < S * 2 * N * GB; i++) dBC[i] = NAN;   /* written, not read */
        for (i = 0; i < S * G; i++) du[i] = dd[i] = k == 0 ? NAN : 1.0;
        mx_scan_backward_chunk_d(S, N, zoh, in.delta, in.u, dy, G, in.bc, in.bc + N, LDBC,
                                 in.A, Ainv, in.Dl, hs, em1, carry, dBC, dA, dD, du, dd, k);
        if (k == 0) { memcpy(du0, du, sizeof du); memcpy(dd0, dd, sizeof dd); }
        else
            for (i = 0; i < S * G; i++)
                MX_CHECK(du[i] == 1.0 + du0[i] && dd[i] == 1.0 + dd0[i], "backward zoh=%d add=1:"
                         " row %d lane %d is not 1 + the written value", zoh, i / G, i % G);
    }
    memcpy(du, du0, sizeof du); memcpy(dd, dd0, sizeof dd);

    for (k = 0; k < 6; k++) {           /* u, delta, Bs|Cs, A, D_vec, h0 */
        double* field; int n_el;
        an = 0;
        if (k == 0) { field = in.u; n_el = S * G; }
        else if (k == 1) { field = in.delta; n_el = S * G; }
        else if (k == 2) { field = in.bc; n_el = S * LDBC; }
        else if (k == 3) { field = in.A; n_el = N * G; }
        else if (k == 4) { field = in.Dl; n_el = G; }
        else { field = in.h0; n_el = N * G; }
        fill(v, n_el, -1, 1);
        if (k == 2)                      /* columns beyond Bs|Cs get no gradient */
            for (s = 0; s < S; s++) for (i = 2 * N; i < LDBC; i++) v[s * LDBC + i] = 0;
        for (i = 0; i < n_el; i++) {
            double gr;
            if (k == 0) gr = du[i];
            else if (k == 1) gr = dd[i];
            else if (k == 2) {           /* dBC (S, 2N, GB): sum over the GB lane classes */
                s = i / LDBC; n = i % LDBC; gr = 0;
                if (n < 2 * N) for (g = 0; g < GB; g++) gr += dBC[(s * 2 * N + n) * GB + g];
            }
            else if (k == 3) gr = dA[i] / in.A[i];   /* dA_acc = A * dLoss/dA */
            else if (k == 4) gr = dD[i];
            else gr = carry[i];                       /* carry out = dLoss/dh0 */
            an += gr * v[i];
        }
        /* D_vec's gradient in the kernel is dy*u only (the y skip term); the reference
           loss has the same. */
        fd = fd_along(&in, field, v, n_el, zoh, dy, Gc);
        worst = fmax(worst, fabs(an - fd) / fmax(1.0, fabs(fd)));
        MX_CHECK(fabs(an - fd) <= 1e-7 * fmax(1.0, fabs(fd)), "backward zoh=%d input %d: "
                 "analytic %.12g, finite differences %.12g", zoh, k, an, fd);
    }
    printf("backward zoh=%d: worst relative gap to finite differences %.2e\n", zoh, worst);
}

int main(void) {
    int zoh;
    for (zoh = 1; zoh >= 0; zoh--) {
        check_forward(zoh, 0);
        check_forward(zoh, 1);
        check_backward(zoh);
    }
    printf("%s (%d failure%s)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures,
           mx_test_failures == 1 ? "" : "s");
    return mx_test_failures ? 1 : 0;
}
