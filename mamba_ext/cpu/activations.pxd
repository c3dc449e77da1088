# Scalar activation helpers shared by the kernels, inline, for float and double.
#
# silu(x) = x * sigmoid(x); softplus(x) = max(x, 0) + log1p(exp(-|x|)) (no overflow
# for any x); softplus'(x) = sigmoid(x).
# float32 uses the branch-free C functions below instead of libm's scalar expf /
# log1pf, so that loops over them vectorise (libm is not vectorised here and was
# the largest cost outside BLAS and the scan); double uses libm.
from libc.math cimport exp, log1p, expm1, fabs, fabsf
from mamba_ext.cpu.types cimport floating

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifndef MX_ACTIVATIONS_C
    #define MX_ACTIVATIONS_C
    #if defined(__GNUC__) && !defined(__clang__)
    /* FP operations never trap here (no FP exceptions are used); without this GCC
       refuses to if-convert, hence to vectorise, the selects of the functions below
       in every loop of the including module defined after this point. */
    #pragma GCC optimize ("no-trapping-math")
    #endif
    /* exp(x) = 2^k e^r, |r| <= ln2/2, k by the 1.5*2^23 rounding trick (x clamped to
       [-87, 88] so 2^k stays a normal float), e^r by Cephes' expf polynomial.
       Returns e^r in *er and 2^k in *scale. */
    static inline void mx_exp_parts(float x, float* er, float* scale) {
        float xs = x > -87.0f ? x : -87.0f;          /* NaN -> -87; callers keep NaN */
        xs = xs < 88.0f ? xs : 88.0f;
        float kf = (xs * 1.44269504f + 12582912.0f) - 12582912.0f;
        float r = (xs - kf * 0.693359375f) + kf * 2.12194440e-4f;
        *er = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
               + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * r * r
               + r + 1.0f;
        int32_t bits = ((int32_t)kf + 127) << 23;
        memcpy(scale, &bits, sizeof bits);
    }
    /* expf, a few ulp (tested against exp in double). */
    static inline float mx_expf(float x) {
        float er, s;
        mx_exp_parts(x, &er, &s);
        /* below e^-87 (results near or under FLT_MIN) flush to 0; above e^88, inf */
        return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : (x == x ? er * s : x));
    }
    /* expm1f, a few ulp on [-87, 88]: with x = k ln2 + r, expm1(x) = 2^k (e^r - 1)
       + (2^k - 1), e^r - 1 = r + r^2 P(r) by the same polynomial as mx_exp_parts
       (no cancellation: k = 0 for |x| < ln2/2, and 2^k - 1 is exact). One polynomial
       per value, not two: the scan computes one expm1 per (t, d, n). */
    static inline float mx_expm1f(float x) {
        float xs = x > -87.0f ? x : -87.0f;          /* NaN -> -87; NaN kept below */
        xs = xs < 88.0f ? xs : 88.0f;
        float kf = (xs * 1.44269504f + 12582912.0f) - 12582912.0f;
        float r = (xs - kf * 0.693359375f) + kf * 2.12194440e-4f;
        float pm1 = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
                    + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * r * r
                    + r;
        float s;
        int32_t bits = ((int32_t)kf + 127) << 23;
        memcpy(&s, &bits, sizeof bits);
        float v = s * pm1 + (s - 1.0f);
        v = x == 0.0f ? x : v;                        /* expm1(-0) = -0 */
        return x > 88.0f ? INFINITY : (x == x ? v : x);
    }
    /* log1p(y) for y in [0, 1]: w = 1 + y rounded, c = (y - (w - 1)) / w restores
       the rounding, log(w) with w = m 2^e, m in [sqrt(1/2), sqrt(2)) by Cephes'
       logf polynomial. */
    static inline float mx_log1pf_unit(float y) {
        float w = 1.0f + y;
        float c = (y - (w - 1.0f)) / w;
        float e = w > 1.41421356f ? 1.0f : 0.0f;
        float x = (w > 1.41421356f ? 0.5f * w : w) - 1.0f;
        float z = x * x;
        float p = ((((((((7.0376836292e-2f * x - 1.1514610310e-1f) * x + 1.1676998740e-1f) * x
                  - 1.2420140846e-1f) * x + 1.4249322787e-1f) * x - 1.6668057665e-1f) * x
                  + 2.0000714765e-1f) * x - 2.4999993993e-1f) * x + 3.3333331174e-1f) * x * z;
        p += e * -2.12194440e-4f;
        p += -0.5f * z;
        return x + p + e * 0.693359375f + c;
    }
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    /* Runtime dispatch to AVX-512 / AVX2 clones of the hot loops (wider vectors). */
    #define MX_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), unused))
    #else
    #define MX_CLONES __attribute__((unused))
    #endif
    #ifdef _OPENMP
    #define MX_PRAGMA(x) _Pragma(#x)
    #else
    #define MX_PRAGMA(x)
    #endif

    /* Elementwise block kernels over n contiguous values (one row), float and double:
       silu, softplus, the gate y * silu(z) and their backward factors. */
    #define MX_ELEMENTWISE(T, SFX, EXP, EXPM1, LOG1P_UNIT, FABS)                         \
    static inline T mx_sigmoid_##SFX(T x) { return 1 / (1 + EXP(-x)); }                 \
    static MX_CLONES void mx_silu_##SFX(T* out, const T* in, /* may alias */           \
                                        Py_ssize_t n) {                                  \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = in[i] * mx_sigmoid_##SFX(in[i]);     \
    }                                                                                    \
    static MX_CLONES void mx_softplus_##SFX(T* restrict a, Py_ssize_t n) {              \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++)                                               \
            a[i] = (a[i] > 0 ? a[i] : 0) + LOG1P_UNIT(EXP(-FABS(a[i])));                 \
    }                                                                                    \
    /* g = y * silu(z) */                                                                \
    static MX_CLONES void mx_gate_fwd_##SFX(T* restrict g, const T* restrict y,         \
                                            const T* restrict z, Py_ssize_t n) {         \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++) g[i] = y[i] * z[i] * mx_sigmoid_##SFX(z[i]);  \
    }                                                                                    \
    /* dy = dg * silu(z); dz = dg * y * silu'(z), silu' = s (1 + z (1 - s)) */           \
    static MX_CLONES void mx_gate_bwd_##SFX(T* restrict dy, T* restrict dz,             \
            const T* restrict dg, const T* restrict y, const T* restrict z,              \
            Py_ssize_t n) {                                                              \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            T s = mx_sigmoid_##SFX(z[i]);                                                \
            dy[i] = dg[i] * z[i] * s;                                                    \
            dz[i] = dg[i] * y[i] * s * (1 + z[i] * (1 - s));                             \
        }                                                                                \
    }                                                                                    \
    /* d *= silu'(c) */                                                                  \
    static MX_CLONES void mx_silu_bwd_##SFX(T* restrict d, const T* restrict c,         \
                                            Py_ssize_t n) {                              \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            T s = mx_sigmoid_##SFX(c[i]);                                                \
            d[i] *= s * (1 + c[i] * (1 - s));                                            \
        }                                                                                \
    }                                                                                    \
    /* d *= softplus'(x) = sigmoid(x) = -expm1(-sp), from sp = softplus(x) */            \
    static MX_CLONES void mx_softplus_bwd_##SFX(T* restrict d, const T* restrict sp,    \
                                                Py_ssize_t n) {                          \
        MX_PRAGMA(omp simd)                                                              \
        for (Py_ssize_t i = 0; i < n; i++) d[i] *= -EXPM1(-sp[i]);                       \
    }
    MX_ELEMENTWISE(float, f, mx_expf, mx_expm1f, mx_log1pf_unit, fabsf)
    MX_ELEMENTWISE(double, d, exp, expm1, log1p, fabs)
    #endif
    """
    float mx_expf(float x) noexcept nogil
    float mx_expm1f(float x) noexcept nogil
    float mx_log1pf_unit(float y) noexcept nogil
    void mx_silu_f(float*, const float*, Py_ssize_t) noexcept nogil
    void mx_silu_d(double*, const double*, Py_ssize_t) noexcept nogil
    void mx_softplus_f(float*, Py_ssize_t) noexcept nogil
    void mx_softplus_d(double*, Py_ssize_t) noexcept nogil
    void mx_gate_fwd_f(float*, const float*, const float*, Py_ssize_t) noexcept nogil
    void mx_gate_fwd_d(double*, const double*, const double*, Py_ssize_t) noexcept nogil
    void mx_gate_bwd_f(float*, float*, const float*, const float*, const float*, Py_ssize_t) noexcept nogil
    void mx_gate_bwd_d(double*, double*, const double*, const double*, const double*, Py_ssize_t) noexcept nogil
    void mx_silu_bwd_f(float*, const float*, Py_ssize_t) noexcept nogil
    void mx_silu_bwd_d(double*, const double*, Py_ssize_t) noexcept nogil
    void mx_softplus_bwd_f(float*, const float*, Py_ssize_t) noexcept nogil
    void mx_softplus_bwd_d(double*, const double*, Py_ssize_t) noexcept nogil


cdef inline floating exp_(floating x) noexcept nogil:
    if floating is float:
        return mx_expf(x)
    else:
        return exp(x)


cdef inline floating expm1_(floating x) noexcept nogil:
    if floating is float:
        return mx_expm1f(x)
    else:
        return expm1(x)


cdef inline floating sigmoid(floating x) noexcept nogil:
    # exp(-x) may be huge for x << 0: 1/(1+huge) -> 0, the right limit.
    return 1 / (1 + exp_(-x))


cdef inline floating silu(floating x) noexcept nogil:
    return x * sigmoid(x)


cdef inline floating silu_grad(floating x) noexcept nogil:
    # d/dx x*s(x) = s(x) * (1 + x * (1 - s(x)))
    cdef floating s = sigmoid(x)
    return s * (1 + x * (1 - s))


cdef inline floating softplus(floating x) noexcept nogil:
    if floating is float:
        return (x if x > 0 else 0) + mx_log1pf_unit(mx_expf(-fabsf(x)))
    else:
        return (x if x > 0 else 0) + log1p(exp(-fabs(x)))


cdef inline floating softplus_grad_from_output(floating sp) noexcept nogil:
    # sigmoid(x) from sp = softplus(x): exp(sp) = 1 + exp(x), so
    # sigmoid(x) = 1 - exp(-sp) = -expm1(-sp), accurate for tiny sp as well.
    return -expm1_(-sp)
