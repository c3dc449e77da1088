/* mx_test.h - tiny helpers shared by the C tests of mamba_ext/cpu/csrc (no framework). */
#ifndef MX_TEST_H
#define MX_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "mx_compat.h"

static int mx_test_failures = 0;

#define MX_CHECK(cond, ...)                                                    \
    do {                                                                       \
        if (!(cond)) {                                                         \
            mx_test_failures++;                                                \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
        }                                                                      \
    } while (0)

static MX_UNUSED float mx_test_from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static MX_UNUSED uint32_t mx_test_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Deterministic 64-bit LCG, uniform double in [0, 1). */
static uint64_t mx_test_rng = 0x9E3779B97F4A7C15ull;
static MX_UNUSED double mx_test_uniform(void) {
    mx_test_rng = mx_test_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(mx_test_rng >> 11) * (1.0 / 9007199254740992.0);
}

#endif /* MX_TEST_H */
