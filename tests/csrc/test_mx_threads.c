/* test_mx_threads.c - mx_threads.h, mx_adamw.h and mx_constants.h.
 *   mx_threads(n > 0) = n, mx_threads(0) >= 1 with OpenMP; always 1 without it.
 *   mx_aligned_alloc: 64-byte aligned, size rounded up to 64.
 *   mx_workspace: same buffer while big enough, grown on demand, writable, per thread.
 *   mx_select_f/d: bitwise select, NaN and -0 kept.
 *   constants: the values documented in docs/semantics.md.
 */
#include <stdlib.h>
#include "mx_threads.h"
#include "mx_adamw.h"
#include "mx_constants.h"
#include "mx_test.h"

int main(void) {
    char* p;
    char* q;
#ifdef _OPENMP
    MX_CHECK(mx_threads(3) == 3, "mx_threads(3) = %d", mx_threads(3));
    MX_CHECK(mx_threads(0) >= 1, "mx_threads(0) = %d", mx_threads(0));
#else
    MX_CHECK(mx_threads(3) == 1 && mx_threads(0) == 1, "without OpenMP: %d, %d",
             mx_threads(3), mx_threads(0));
#endif
    p = (char*)mx_workspace(1000);
    MX_CHECK(p != NULL, "mx_workspace(1000) = NULL");
    memset(p, 1, 1000);
    MX_CHECK(mx_workspace(10) == p, "a smaller request must reuse the buffer");
    q = (char*)mx_workspace(1 << 20);
    MX_CHECK(q != NULL, "mx_workspace(1 MiB) = NULL");
    memset(q, 2, 1 << 20);
    MX_CHECK(mx_workspace(1 << 19) == q, "the grown buffer must be reused");

    p = (char*)mx_aligned_alloc(100);
    MX_CHECK(p != NULL && ((uintptr_t)p % 64) == 0, "mx_aligned_alloc(100) not 64-byte aligned");
    memset(p, 3, 128);                              /* rounded up to 64-byte multiples */
    mx_aligned_free(p);
    MX_CHECK(mx_select_f(1, 2.0f, 3.0f) == 2.0f && mx_select_f(0, 2.0f, 3.0f) == 3.0f, "select_f");
    MX_CHECK(mx_select_d(7, -0.0, 1.0) == 0.0 && signbit(mx_select_d(7, -0.0, 1.0)), "select_d -0");
    MX_CHECK(isnan(mx_select_f(1, NAN, 1.0f)) && mx_select_d(0, NAN, 1.0) == 1.0, "select NaN");

    MX_CHECK(MX_A_LOG_MIN == -10.0 && MX_A_LOG_MAX == 5.0, "A_log clamp bounds");
    MX_CHECK(MX_DEFAULT_EPS == 1e-6, "default eps");
    MX_CHECK(MX_SCAN_CHUNK >= 1, "SCAN_CHUNK");
    printf("workspace reused, selects exact; SCAN_CHUNK %d\n", MX_SCAN_CHUNK);
    printf("%s (%d failure%s)\n", mx_test_failures ? "FAILED" : "OK", mx_test_failures,
           mx_test_failures == 1 ? "" : "s");
    return mx_test_failures ? 1 : 0;
}
