/* mx_compat.h - one C dialect for GCC, Clang, Apple Clang and MSVC.
 *
 * Every compiler-specific spelling the kernels use is a macro here, each with a
 * fallback that any C99/C11 compiler accepts (then the construct is simply off):
 *
 *   MX_RESTRICT       restrict qualifier (C99 `restrict`, `__restrict__`, MSVC `__restrict`)
 *   MX_UNUSED         "may be unused" for static functions of a header
 *   MX_INLINE         static inline helper (always inlined where the compiler allows)
 *   MX_NO_TRAPPING    per-function "FP operations do not trap": lets GCC if-convert, hence
 *                     vectorise, the selects of the branch-free math (GCC only; Clang
 *                     and MSVC if-convert without it); scoped to the functions below that
 *                     carry it, never to the including translation unit
 *   MX_DISPATCH       runtime dispatch to AVX-512 / AVX2 / baseline clones (target_clones,
 *                     GCC and Clang >= 14 on x86_64 Linux; elsewhere one baseline version,
 *                     e.g. NEON on arm64, whose vector width needs no dispatch)
 *   MX_KERNEL         = static MX_DISPATCH MX_NO_TRAPPING MX_UNUSED: a vectorised hot loop
 *   MX_KERNELS_BEGIN / MX_KERNELS_END   around the MX_KERNEL definitions of a header
 *   MX_PRAGMA(x)      _Pragma("x") (C99), __pragma(x) on MSVC
 *   MX_OMP_SIMD       `#pragma omp simd` when OpenMP is on or the build passes -fopenmp-simd
 *                     with -DMX_OPENMP_SIMD (the SIMD directives alone, no runtime: setup.py
 *                     does so whenever the compiler accepts it), nothing otherwise
 *   MX_SIMD_IF(v)     MX_OMP_SIMD for v = 1, nothing for v = 0: kernels written once for float
 *                     and double pass 0 for loops that call libm (double math), which no
 *                     compiler vectorises (Clang warns when `omp simd` cannot be honoured).
 *                     A 0/1 token, not the pragma itself, goes through the macro arguments:
 *                     _Pragma inside macro arguments is mis-placed by some GCC versions.
 *
 * MX_NO_DISPATCH (define before including) turns the runtime dispatch off.
 * This header includes nothing and needs nothing but a C99 compiler.
 */
#ifndef MX_COMPAT_H
#define MX_COMPAT_H

#if defined(__GNUC__) || defined(__clang__)
#define MX_GNUC_LIKE 1                 /* GCC, Clang, Apple Clang, clang-cl (GNU mode) */
#else
#define MX_GNUC_LIKE 0
#endif
#if defined(__GNUC__) && !defined(__clang__)
#define MX_GCC 1
#else
#define MX_GCC 0
#endif

/* restrict */
#if MX_GNUC_LIKE
#define MX_RESTRICT __restrict__
#elif defined(_MSC_VER)
#define MX_RESTRICT __restrict
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 199901L
#define MX_RESTRICT restrict
#else
#define MX_RESTRICT
#endif

/* unused static functions of a header */
#if MX_GNUC_LIKE
#define MX_UNUSED __attribute__((unused))
#else
#define MX_UNUSED
#endif

/* FP operations never trap in these kernels (no FP exceptions are used). */
#if MX_GCC
#define MX_NO_TRAPPING __attribute__((optimize("no-trapping-math")))
#else
#define MX_NO_TRAPPING
#endif

/* static inline helper, inlined into every kernel (helpers carry MX_NO_TRAPPING
   too: GCC does not inline across differing FP-trapping options). */
#if MX_GNUC_LIKE
#define MX_INLINE static inline __attribute__((always_inline, unused)) MX_NO_TRAPPING
#elif defined(_MSC_VER)
#define MX_INLINE static __forceinline
#else
#define MX_INLINE static inline
#endif

/* runtime dispatch of the hot loops: target_clones needs ifunc (ELF, glibc or musl loader
   with IRELATIVE relocations: Linux); Clang supports it on x86 from version 14 */
#if !defined(MX_NO_DISPATCH) && defined(__x86_64__) && defined(__linux__) && \
    (MX_GCC || (defined(__clang__) && __clang_major__ >= 14))
#define MX_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#define MX_DISPATCH_ON 1
#else
#define MX_DISPATCH
#endif

/* Clang refuses `unused` on a target_clones function: there MX_KERNELS_BEGIN / _END
   silence -Wunused-function around the kernels of a header instead. */
#if defined(MX_DISPATCH_ON) && defined(__clang__)
#define MX_KERNEL static MX_DISPATCH
#define MX_KERNELS_BEGIN _Pragma("clang diagnostic push") \
    _Pragma("clang diagnostic ignored \"-Wunused-function\"")
#define MX_KERNELS_END _Pragma("clang diagnostic pop")
#else
#define MX_KERNEL static MX_DISPATCH MX_NO_TRAPPING MX_UNUSED
#define MX_KERNELS_BEGIN
#define MX_KERNELS_END
#endif

/* pragmas from macros */
#if defined(_MSC_VER) && !defined(__clang__)
#define MX_PRAGMA(x) __pragma(x)
#else
#define MX_PRAGMA(x) _Pragma(#x)
#endif

/* `omp simd`: only where OpenMP (or its SIMD subset) is on and understands it (MSVC's
   OpenMP 2.0 does not). */
#if (defined(_OPENMP) || defined(MX_OPENMP_SIMD)) && !(defined(_MSC_VER) && !defined(__clang__))
#define MX_OMP_SIMD MX_PRAGMA(omp simd)
#else
#define MX_OMP_SIMD
#endif
#define MX_SIMD_IF(v) MX_SIMD_IF_##v
#define MX_SIMD_IF_1 MX_OMP_SIMD
#define MX_SIMD_IF_0

#endif /* MX_COMPAT_H */
