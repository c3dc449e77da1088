/* mx_adamw.h - bitwise selects of the AdamW step (mamba_ext/cpu/adamw.pyx).
 *
 * mx_select_f / mx_select_d(c, a, b) = c ? a : b chosen on the bits. GCC turns a float
 * ternary whose one side is the old value back into a branch (then no vectorisation);
 * integer masks don't.
 */
#ifndef MX_ADAMW_H
#define MX_ADAMW_H

#include <stdint.h>
#include <string.h>
#include "mx_compat.h"

MX_INLINE float mx_select_f(int c, float a, float b) {
    uint32_t x, y, k = -(uint32_t)(c != 0);
    memcpy(&x, &a, 4); memcpy(&y, &b, 4); x = (x & k) | (y & ~k); memcpy(&a, &x, 4);
    return a;
}

MX_INLINE double mx_select_d(int c, double a, double b) {
    uint64_t x, y, k = -(uint64_t)(c != 0);
    memcpy(&x, &a, 8); memcpy(&y, &b, 8); x = (x & k) | (y & ~k); memcpy(&a, &x, 8);
    return a;
}

#endif /* MX_ADAMW_H */
