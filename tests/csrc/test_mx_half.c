/* test_mx_half.c - the float -> half rounding of mx_half.h and its loops.
 *
 * - mx_float_to_half against a reference in double (round to nearest even by rint() on the
 *   half's quantum; >= 65520 -> inf; NaN -> NumPy's NaN bits), on every half value, on the midpoints
 *   between neighbouring halves and one float ulp either side (the ties and the nearest
 *   non-ties), and on every 251st float bit pattern (17 million, all exponents);
 * - every half -> float -> half gives the half back (NaN: a NaN);
 * - mx_round_half_f (in place), mx_float_to_half_row and mx_half_rows_sum_f (P 3, n 37: a
 *   vector body and a tail) against the scalar functions, the sum in row order.
 */
#include <stdlib.h>
#include "mx_half.h"
#include "mx_test.h"

/* The half nearest to f (ties to even) as a double; NaN for NaN. */
static double round_ref(float f) {
    double a = fabs((double)f), q, r;
    int e;
    if (isnan(f)) return NAN;
    if (a >= 65520.0) r = INFINITY;
    else {
        if (a < ldexp(1.0, -14)) q = ldexp(1.0, -24);
        else { frexp(a, &e); q = ldexp(1.0, e - 11); }       /* a in [2^(e-1), 2^e) */
        r = rint(a / q) * q;                                  /* exact: a / q < 2^12 */
    }
    return signbit(f) ? -r : r;
}

static int n_checked = 0;

static void check_one(float f) {
    uint16_t h = mx_float_to_half(f);
    double got = mx_half_to_float(h), want = round_ref(f);
    n_checked++;
    if (isnan(want)) {
        uint32_t top = (mx_test_bits(f) >> 13) & 0x3ffu;          /* NumPy's rule */
        uint16_t nan = (uint16_t)(((mx_test_bits(f) >> 16) & 0x8000u) | 0x7c00u | (top ? top : 1u));
        MX_CHECK(isnan(got) && h == nan, "%08x -> %04x, want %04x", (unsigned)mx_test_bits(f),
                 (unsigned)h, (unsigned)nan);
        return;
    }
    MX_CHECK(got == want && !signbit(got) == !signbit(want), "%08x (%.9g) -> %04x (%.9g), want %.9g",
             (unsigned)mx_test_bits(f), (double)f, (unsigned)h, got, want);
}

int main(void) {
    uint32_t h, b;
    int i, r;
    /* 1. every half, its midpoint with the next one and a float ulp either side */
    for (h = 0; h < 65536; h++) {
        float f = mx_half_to_float((uint16_t)h);
        if (isnan(f)) {
            check_one(f);
            MX_CHECK(isnan(mx_half_to_float(mx_float_to_half(f))), "NaN %04x", (unsigned)h);
            continue;
        }
        MX_CHECK(mx_float_to_half(f) == h, "half %04x -> %g -> %04x", (unsigned)h, (double)f,
                 (unsigned)mx_float_to_half(f));
        check_one(f);
        if ((h & 0x7fffu) < 0x7c00u) {
            float g = mx_half_to_float((uint16_t)(h + 1)), m;
            if (isinf(g)) g = signbit(f) ? -65536.0f : 65536.0f;   /* the overflow boundary */
            m = (float)(((double)f + (double)g) / 2);               /* exact: 12 bits */
            check_one(m);
            check_one(nextafterf(m, 0.0f));
            check_one(nextafterf(m, signbit(m) ? -INFINITY : INFINITY));
        }
    }
    /* 2. a sweep of float bit patterns (every exponent, both signs) */
    for (b = 0; b < 0xffffffffu - 251u; b += 251u) check_one(mx_test_from_bits(b));
    check_one(mx_test_from_bits(0x7f800000u));                /* +inf */
    check_one(mx_test_from_bits(0xff800000u));                /* -inf */
    check_one(mx_test_from_bits(0x7f800001u));                /* a signalling NaN */
    check_one(mx_test_from_bits(0x00000001u));                /* the smallest float */
    check_one(ldexpf(1.0f, -25));                             /* a tie with zero: 0 */
    check_one(nextafterf(ldexpf(1.0f, -25), 1.0f));           /* -> 2^-24 */
    printf("checked %d values\n", n_checked);
    /* 3. the loops */
    {
        enum { P = 3, N = 37, LD = 40 };
        float x[N], y[N], sum[N];
        uint16_t bits[N], rows[P * LD];
        for (i = 0; i < N; i++)
            x[i] = (float)((mx_test_uniform() - 0.5) * ldexp(1.0, (int)(40 * mx_test_uniform()) - 20));
        mx_float_to_half_row(bits, x, N);
        for (i = 0; i < N; i++) {
            MX_CHECK(bits[i] == mx_float_to_half(x[i]), "row %d", i);
            y[i] = x[i];
        }
        mx_round_half_f(y, y, N);
        for (i = 0; i < N; i++)
            MX_CHECK(mx_test_bits(y[i]) == mx_test_bits(mx_half_to_float(bits[i])), "round %d", i);
        for (r = 0; r < P; r++)
            for (i = 0; i < LD; i++)
                rows[r * LD + i] = mx_float_to_half((float)(mx_test_uniform() * 1000 - 500));
        mx_half_rows_sum_f(sum, rows, P, N, LD);
        for (i = 0; i < N; i++) {
            float s = mx_half_to_float(rows[i]);
            for (r = 1; r < P; r++) s += mx_half_to_float(rows[r * LD + i]);
            MX_CHECK(mx_test_bits(sum[i]) == mx_test_bits(s), "sum %d: %g want %g", i,
                     (double)sum[i], (double)s);
        }
    }
    printf("%s (%d failures)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures);
    return mx_test_failures != 0;
}
