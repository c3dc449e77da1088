/* test_mx_activations.c - the row kernels of mx_activations.h.
 *
 * Each vectorised row kernel (n = 1000 values, so a vector body and a scalar tail run)
 * against the same formula evaluated one value at a time with the scalar helpers of
 * mx_math.h (float) or libm (double): bitwise equal in an ISO C build without FMA,
 * within 2e-6 (float) / 1e-14 (double) times max(|value|, 1) where the compiler may
 * contract a*b+c into an FMA (GNU C modes, a target with FMA, Clang's runtime-dispatched
 * clones; dz cancels near 1 + z (1 - sigmoid(z)) = 0, where an FMA changes the last bits
 * of a small difference). The inputs span [-30, 30] plus values beyond the exp clamps.
 */
#include <stdlib.h>
#include "mx_activations.h"
#include "mx_test.h"

#define NV 1000

#if defined(__FP_FAST_FMAF) || !defined(__STRICT_ANSI__) || \
    (defined(MX_DISPATCH_ON) && defined(__clang__))
/* the compiler may contract a*b+c into an FMA: GNU C modes, a target with FMA, or Clang's
   AVX-512 / AVX2 clones of the kernels (Clang contracts within expressions by default) */
#define TOL_F 2e-6
#define TOL_D 1e-14
#else
#define TOL_F 0.0
#define TOL_D 0.0
#endif

static int close_f(float a, float b) {
    return a == b || fabsf(a - b) <= (float)TOL_F * fmaxf(fabsf(b), 1.0f);
}
static int close_d(double a, double b) {
    return a == b || fabs(a - b) <= TOL_D * fmax(fabs(b), 1.0);
}

int main(void) {
    static float x[NV], y[NV], z[NV], o[NV], o2[NV], d[NV];
    static double xd[NV], yd[NV], zd[NV], od[NV], od2[NV], dd[NV];
    int i, bad = 0;
    for (i = 0; i < NV; i++) {
        xd[i] = -30 + 60 * mx_test_uniform();
        yd[i] = -2 + 4 * mx_test_uniform();
        zd[i] = -30 + 60 * mx_test_uniform();
        dd[i] = -1 + 2 * mx_test_uniform();
    }
    xd[0] = 100; xd[1] = -100; zd[2] = 100; zd[3] = -100; xd[4] = 0; zd[5] = -0.0;
    for (i = 0; i < NV; i++) { x[i] = (float)xd[i]; y[i] = (float)yd[i]; z[i] = (float)zd[i];
                               d[i] = (float)dd[i]; }

#define EXPECT_F(label, expr_vec, expr_one)                                          \
    do {                                                                             \
        expr_vec;                                                                    \
        for (i = 0; i < NV; i++) {                                                   \
            float want = (expr_one);                                                 \
            if (!close_f(o[i], want)) {                                              \
                bad++;                                                               \
                MX_CHECK(0, "%s[%d]: kernel %a, scalar %a", label, i, o[i], want);   \
                break;                                                               \
            }                                                                        \
        }                                                                            \
    } while (0)
#define EXPECT_D(label, expr_vec, expr_one)                                          \
    do {                                                                             \
        expr_vec;                                                                    \
        for (i = 0; i < NV; i++) {                                                   \
            double want = (expr_one);                                                \
            if (!close_d(od[i], want)) {                                             \
                bad++;                                                               \
                MX_CHECK(0, "%s[%d]: kernel %a, scalar %a", label, i, od[i], want);  \
                break;                                                               \
            }                                                                        \
        }                                                                            \
    } while (0)

    EXPECT_F("silu_forward_f", mx_silu_forward_f(o, x, NV), x[i] * mx_sigmoidf(x[i]));
    EXPECT_F("softplus_forward_f", (memcpy(o, x, sizeof o), mx_softplus_forward_f(o, NV)),
             mx_softplusf(x[i]));
    EXPECT_F("gate_forward_f", mx_gate_forward_f(o, y, z, NV), y[i] * z[i] * mx_sigmoidf(z[i]));
    EXPECT_F("gate_backward_f (dy)", mx_gate_backward_f(o, o2, d, y, z, NV),
             d[i] * z[i] * mx_sigmoidf(z[i]));
    EXPECT_F("gate_backward_f (dz)", memcpy(o, o2, sizeof o),
             d[i] * y[i] * mx_sigmoidf(z[i]) * (1 + z[i] * (1 - mx_sigmoidf(z[i]))));
    EXPECT_F("silu_backward_f", (memcpy(o, d, sizeof o), mx_silu_backward_f(o, x, NV)),
             d[i] * (mx_sigmoidf(x[i]) * (1 + x[i] * (1 - mx_sigmoidf(x[i])))));
    EXPECT_F("softplus_backward_f", (memcpy(o, d, sizeof o), mx_softplus_backward_f(o, y, NV)),
             d[i] * -mx_expm1f(-y[i]));
    EXPECT_F("exp_shift_f", (memcpy(o, x, sizeof o), mx_exp_shift_f(o, 2.5f, NV)),
             mx_expf(x[i] - 2.5f));

    EXPECT_D("silu_forward_d", mx_silu_forward_d(od, xd, NV), xd[i] * (1 / (1 + exp(-xd[i]))));
    EXPECT_D("softplus_forward_d", (memcpy(od, xd, sizeof od), mx_softplus_forward_d(od, NV)),
             (xd[i] > 0 ? xd[i] : 0) + log1p(exp(-fabs(xd[i]))));
    EXPECT_D("gate_backward_d (dz)", (mx_gate_backward_d(od2, od, dd, yd, zd, NV)),
             dd[i] * yd[i] * (1 / (1 + exp(-zd[i]))) * (1 + zd[i] * (1 - 1 / (1 + exp(-zd[i])))));
    EXPECT_D("softplus_backward_d", (memcpy(od, dd, sizeof od),
                                     mx_softplus_backward_d(od, yd, NV)),
             dd[i] * -expm1(-yd[i]));
    EXPECT_D("exp_shift_d", (memcpy(od, xd, sizeof od), mx_exp_shift_d(od, 2.5, NV)),
             exp(xd[i] - 2.5));

    /* limits: silu(-100) = -0 or tiny, softplus(100) = 100, softplus(-100) = 0 */
    mx_softplus_forward_f(memcpy(o, x, sizeof o), NV);
    MX_CHECK(o[0] == 100.0f && o[1] == 0.0f, "softplus(+-100) = %a, %a", o[0], o[1]);
    /* the softmax's exp of a row minus its maximum: exp(0) = 1 exactly, far below -> 0 */
    o[0] = 3.0f; o[1] = -200.0f;
    mx_exp_shift_f(o, 3.0f, 2);
    MX_CHECK(o[0] == 1.0f && o[1] == 0.0f, "exp_shift(0), exp_shift(-203) = %a, %a", o[0], o[1]);
    printf("row kernels: %d mismatches\n", bad);     /* same text on every target */
    printf("%s (%d failure%s)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures,
           mx_test_failures == 1 ? "" : "s");
    return mx_test_failures ? 1 : 0;
}
