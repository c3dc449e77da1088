/* test_mx_math.c - the float32 helpers of mx_math.h against double libm.
 *
 * Sweeps (about 25 million points per function; `test_mx_math S` thins them S times,
 * for slow emulated runs):
 *   - every 251st float32 bit pattern (the whole range: both signs, every exponent
 *     including denormals, +-0, +-inf, NaNs);
 *   - for mx_log1pf_unit its whole domain [0, 1], every 61st float;
 *   - near 0 (for expm1): every 61st float with |x| in [2^-30, 2^-1];
 *   - listed edge values: +-0, +-inf, NaN, FLT_MIN, the smallest denormal, FLT_MAX and
 *     the thresholds of the clamps (-87, 88) and of float overflow/underflow.
 * Error unit: ulp of the correctly rounded float32 result (ulp of a denormal = 2^-149).
 * Each function has a documented range where the ulp bound holds and a documented
 * behaviour outside it (flush to 0, inf, NaN kept), both checked.
 *
 * Bounds (measured max + margin; the measured maxima are printed):
 *   mx_expf         x in [-87, 88]            <= MAX_ULP_EXP
 *   mx_expm1f       x in [-inf, 88]           <= MAX_ULP_EXPM1
 *   mx_expm1f_unsigned_zero: mx_expm1f's bits for every x but -0 (+0 there)
 *   mx_expm1f_le88: mx_expm1f_unsigned_zero's bits for every x <= 88 and NaN
 *   mx_log1pf_unit  y in [0, 1]               <= MAX_ULP_LOG1P
 *   mx_softplusf    x in [-87, +inf]          <= MAX_ULP_SOFTPLUS; x < -87: exactly 0
 *   mx_sigmoidf     x in [-87, +inf]          <= MAX_ULP_SIGMOID;  x < -88: exactly 0
 */
#include <float.h>
#include <stdlib.h>
#include "mx_math.h"
#include "mx_test.h"

/* measured (gcc 12 -O2, x86_64 and aarch64): exp 0.99, expm1 1.61, log1p 1.26,
   softplus 1.97, sigmoid 2.26 ulp */
#define MAX_ULP_EXP 1.5
#define MAX_ULP_EXPM1 2.0
#define MAX_ULP_LOG1P 1.5
#define MAX_ULP_SOFTPLUS 2.5
#define MAX_ULP_SIGMOID 3.0

/* ulp of the float32 nearest to d (d finite) */
static double ulp_of(double d) {
    int e;
    d = fabs(d);
    if (d < (double)FLT_MIN) return ldexp(1.0, -149);
    frexp(d, &e);                         /* d = m 2^e, m in [0.5, 1) */
    return ldexp(1.0, e - 24);
}

typedef struct { const char* name; double max_ulp; float at; long n; } stat_t;

/* err in ulps of got (float) against exact (double); inf/NaN handled by callers */
static void account(stat_t* s, float x, float got, double exact) {
    double err = fabs((double)got - exact) / ulp_of(exact);
    s->n++;
    if (err > s->max_ulp || err != err) { s->max_ulp = err; s->at = x; }
}

static double softplus_d(double x) { return (x > 0 ? x : 0) + log1p(exp(-fabs(x))); }
static double sigmoid_d(double x) { return 1 / (1 + exp(-x)); }

/* One point through every function: checks of the range contract + accounting. */
static void check_point(float x, stat_t* st) {
    float e = mx_expf(x), em = mx_expm1f(x), sp = mx_softplusf(x), sg = mx_sigmoidf(x);
    float emu = mx_expm1f_unsigned_zero(x), eml = mx_expm1f_le88(x);
    if (x != x) {                                       /* NaN in, NaN out */
        MX_CHECK(e != e && em != em && emu != emu && eml != eml && sp != sp && sg != sg,
                 "NaN not kept");
        return;
    }
    /* the scan's expm1 where delta*A <= 88: mx_expm1f_unsigned_zero's bits */
    if (x <= 88.0f)
        MX_CHECK(mx_test_bits(eml) == mx_test_bits(emu), "mx_expm1f_le88(%a) = %a, "
                 "mx_expm1f_unsigned_zero %a", x, eml, emu);
    /* the scan's expm1: mx_expm1f's bits, but +0 for -0 */
    MX_CHECK(x == 0.0f ? emu == 0.0f && !signbit(emu) : mx_test_bits(emu) == mx_test_bits(em),
             "mx_expm1f_unsigned_zero(%a) = %a, mx_expm1f %a", x, emu, em);
    /* exp */
    if (x < -87.0f) MX_CHECK(e == 0.0f, "expf(%a) = %a, want 0 (flush)", x, e);
    else if (x > 88.0f) MX_CHECK(isinf(e) && e > 0, "expf(%a) = %a, want inf", x, e);
    else account(&st[0], x, e, exp((double)x));
    /* expm1 */
    if (x > 88.0f) MX_CHECK(isinf(em) && em > 0, "expm1f(%a) = %a, want inf", x, em);
    else if (x == 0.0f) MX_CHECK(mx_test_bits(em) == mx_test_bits(x), "expm1f(%a) = %a", x, em);
    else account(&st[1], x, em, expm1((double)x));
    /* softplus */
    if (isinf(x)) MX_CHECK(x > 0 ? (isinf(sp) && sp > 0) : sp == 0.0f, "softplus(%a) = %a", x, sp);
    else if (x < -87.0f) MX_CHECK(sp == 0.0f, "softplus(%a) = %a, want 0", x, sp);
    else account(&st[3], x, sp, softplus_d((double)x));
    /* sigmoid */
    if (x < -88.0f) MX_CHECK(sg == 0.0f, "sigmoid(%a) = %a, want 0", x, sg);
    else if (x < -87.0f) MX_CHECK(fabs((double)sg - sigmoid_d((double)x)) <= ldexp(1.0, -126),
                                  "sigmoid(%a) = %a", x, sg);
    else if (isinf(x)) MX_CHECK(sg == 1.0f, "sigmoid(%a) = %a", x, sg);
    else account(&st[4], x, sg, sigmoid_d((double)x));
}

int main(int argc, char** argv) {
    stat_t st[5] = {{"mx_expf", 0, 0, 0}, {"mx_expm1f", 0, 0, 0}, {"mx_log1pf_unit", 0, 0, 0},
                    {"mx_softplusf", 0, 0, 0}, {"mx_sigmoidf", 0, 0, 0}};
    const double bound[5] = {MAX_ULP_EXP, MAX_ULP_EXPM1, MAX_ULP_LOG1P, MAX_ULP_SOFTPLUS,
                             MAX_ULP_SIGMOID};
    const float edges[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MIN, -FLT_MIN,
                           FLT_MAX, -FLT_MAX, 1.4e-45f, -1.4e-45f, FLT_EPSILON, -FLT_EPSILON,
                           -87.0f, 88.0f, -88.0f, 87.0f, 88.7228f, 88.7229f, -103.97f, -103.98f,
                           -87.33655f, -87.33654f, 1.0f, -1.0f, 0.5f, -0.5f,
                           0.34657359f, -0.34657359f, 1e-8f, -1e-8f, 20.0f, -20.0f};
    uint64_t b;
    uint32_t u;
    int i, fails = 0;
    const uint32_t thin = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 1u;
    const long min_points = 16000000L / (long)(thin ? thin : 1);

    for (i = 0; i < (int)(sizeof edges / sizeof edges[0]); i++) check_point(edges[i], st);
    for (b = 0; b <= 0xFFFFFFFFull; b += 251u * thin) check_point(mx_test_from_bits((uint32_t)b), st);
    /* near 0: |x| in [2^-30, 2^-1], both signs */
    for (u = mx_test_bits(ldexpf(1.0f, -30)); u <= mx_test_bits(0.5f); u += 61u * thin) {
        check_point(mx_test_from_bits(u), st);
        check_point(-mx_test_from_bits(u), st);
    }
    /* log1p on its domain [0, 1] (0 and 1 included) */
    for (u = 0; u <= mx_test_bits(1.0f); u += 61u * thin) {
        float y = mx_test_from_bits(u);
        account(&st[2], y, mx_log1pf_unit(y), log1p((double)y));
    }
    account(&st[2], 1.0f, mx_log1pf_unit(1.0f), log1p(1.0));

    for (i = 0; i < 5; i++) {
        printf("%-15s max error %.3f ulp at %.9g over %ld points (bound %.1f)\n", st[i].name,
               st[i].max_ulp, (double)st[i].at, st[i].n, bound[i]);
        MX_CHECK(st[i].max_ulp <= bound[i] && st[i].n > min_points, "%s: %.3f ulp > %.1f",
                 st[i].name, st[i].max_ulp, bound[i]);
    }
    fails = mx_test_failures;
    printf("%s (%d failure%s)\n", fails ? "FAILED" : "OK", fails, fails == 1 ? "" : "s");
    return fails ? 1 : 0;
}
