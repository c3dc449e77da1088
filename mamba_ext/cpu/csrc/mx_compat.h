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
 *   MX_DISPATCH       runtime dispatch to AVX-512 / AVX2 / baseline clones (GCC
 *                     target_clones on x86_64 Linux; elsewhere one baseline version)
 *   MX_KERNEL         = static MX_DISPATCH MX_NO_TRAPPING MX_UNUSED: a vectorised hot loop
 *   MX_PRAGMA(x)      _Pragma("x") (C99), __pragma(x) on MSVC
 *   MX_OMP_SIMD       `#pragma omp simd` when OpenMP is on, nothing otherwise
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

/* runtime dispatch of the hot loops */
#if !defined(MX_NO_DISPATCH) && MX_GCC && defined(__x86_64__) && defined(__linux__)
#define MX_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MX_DISPATCH
#endif

#define MX_KERNEL static MX_DISPATCH MX_NO_TRAPPING MX_UNUSED

/* pragmas from macros */
#if defined(_MSC_VER) && !defined(__clang__)
#define MX_PRAGMA(x) __pragma(x)
#else
#define MX_PRAGMA(x) _Pragma(#x)
#endif

/* `omp simd`: only where OpenMP is on and understands it (MSVC's OpenMP 2.0 does not). */
#if defined(_OPENMP) && !(defined(_MSC_VER) && !defined(__clang__))
#define MX_OMP_SIMD MX_PRAGMA(omp simd)
#else
#define MX_OMP_SIMD
#endif

#endif /* MX_COMPAT_H */
