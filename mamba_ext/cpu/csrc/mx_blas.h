/* mx_blas.h - the BLAS library's own thread pool, held at one thread while our kernels run.
 *
 * Design: one thread pool. Every product of the core is driven by our OpenMP team: each
 * thread calls a single-threaded BLAS on its slice of the output (linear.pyx). A BLAS with
 * a pool of its own (OpenBLAS, MKL, BLIS) would otherwise start a second team beside
 * ours, and the idle threads of either team spin on the cores the other needs (a plain
 * library call ran 6-8x slower at size b than with both pools told to sleep through
 * environment variables, docs/performance.md). The BLAS's thread count is a process-wide
 * setting, so it is lowered to 1 for the duration of our calls only and then restored:
 * the user's own BLAS calls keep the threads they had, and nothing in the environment
 * changes.
 *
 *   mx_blas_bind(path): find the thread-count controls of the BLAS library that the
 *     loaded shared library at path links (path: scipy.linalg.cython_blas's own file,
 *     which links SciPy's BLAS; dlsym on its handle searches the libraries it links;
 *     on Windows every module of the process is searched and path is not used). Returns a
 *     name for the controls found ("openblas", "mkl", "blis"), or "none" (a BLAS without
 *     a pool of its own, such as the reference BLAS; then the scope below does nothing).
 *   mx_blas_single_begin() / mx_blas_single_end(): a scope in which the BLAS runs on the
 *     calling thread only. Scopes nest and may be entered from several threads at once:
 *     the first to enter saves and lowers the count, the last to leave restores it.
 *   mx_blas_threads(): the BLAS's current thread count (1 inside a scope; -1 if unknown).
 *   mx_blas_corename(), mx_blas_config(): OpenBLAS's name for the kernel set it runs
 *     ("Haswell", "Zen", "SkylakeX", ...: openblas_get_corename) and its description of
 *     its build ("OpenBLAS 0.3.30 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64":
 *     openblas_get_config), both found by mx_blas_bind; "" for another BLAS or before.
 */
#ifndef MX_BLAS_H
#define MX_BLAS_H

#include <stddef.h>
#include <string.h>
#include "mx_compat.h"

#if defined(_WIN32)
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#include <psapi.h>             /* K32EnumProcessModules (kernel32 since Windows 7) */
#else
#include <dlfcn.h>
#include <pthread.h>
#endif

typedef void (*mx_blas_set_int_t)(int);
typedef int (*mx_blas_get_int_t)(void);
typedef void (*mx_blas_set_i64_t)(long long);   /* BLIS: dim_t is 64-bit */
typedef long long (*mx_blas_get_i64_t)(void);
typedef char* (*mx_blas_describe_t)(void);

static struct {
    const char* name;          /* "none" until bound */
    mx_blas_set_int_t set;     /* one of set / set64 and get / get64 is non-NULL */
    mx_blas_get_int_t get;
    mx_blas_set_i64_t set64;
    mx_blas_get_i64_t get64;
    int depth;                 /* scopes open, over all threads */
    long long saved;           /* the count before the outermost scope */
    mx_blas_describe_t corename;   /* OpenBLAS only, as config */
    mx_blas_describe_t config;
} mx_blas = {"none", NULL, NULL, NULL, NULL, 0, 0, NULL, NULL};

/* OpenBLAS's self-descriptions under the prefixes and suffixes of its builds */
static const char* const mx_blas_corename_syms[] = {
    "scipy_openblas_get_corename", "scipy_openblas_get_corename64_",
    "openblas_get_corename", "openblas_get_corename64_"};
static const char* const mx_blas_config_syms[] = {
    "scipy_openblas_get_config", "scipy_openblas_get_config64_",
    "openblas_get_config", "openblas_get_config64_"};

#if defined(_WIN32)
static SRWLOCK mx_blas_lock = SRWLOCK_INIT;
#define MX_BLAS_LOCK() AcquireSRWLockExclusive(&mx_blas_lock)
#define MX_BLAS_UNLOCK() ReleaseSRWLockExclusive(&mx_blas_lock)
#else
static pthread_mutex_t mx_blas_lock = PTHREAD_MUTEX_INITIALIZER;
#define MX_BLAS_LOCK() pthread_mutex_lock(&mx_blas_lock)
#define MX_BLAS_UNLOCK() pthread_mutex_unlock(&mx_blas_lock)
#endif

/* (set, get) symbol pairs, first match wins; kind 1: int, 2: 64-bit (BLIS) */
static const struct { const char* name; const char* set; const char* get; int kind; }
mx_blas_controls[] = {
    {"openblas", "scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads", 1},
    {"openblas", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_", 1},
    {"openblas", "openblas_set_num_threads", "openblas_get_num_threads", 1},
    {"openblas", "openblas_set_num_threads64_", "openblas_get_num_threads64_", 1},
    {"mkl", "MKL_Set_Num_Threads", "MKL_Get_Max_Threads", 1},
    {"blis", "bli_thread_set_num_threads", "bli_thread_get_num_threads", 2},
};

#if defined(_WIN32)
/* GetProcAddress searches one module: look in every module of the process. */
static MX_UNUSED void* mx_blas_sym(void* handle, const char* name) {
    HMODULE mods[1024];
    DWORD nbytes = 0, i;
    (void)handle;
    if (!K32EnumProcessModules(GetCurrentProcess(), mods, sizeof mods, &nbytes)) return NULL;
    for (i = 0; i < nbytes / sizeof(HMODULE) && i < 1024; i++) {
        FARPROC f = GetProcAddress(mods[i], name);
        void* p;
        if (f == NULL) continue;
        memcpy(&p, &f, sizeof p);   /* ISO C has no cast between function and object pointers */
        return p;
    }
    return NULL;
}
#else
/* dlsym on a library's handle searches that library and the libraries it links. */
static MX_UNUSED void* mx_blas_sym(void* handle, const char* name) {
    return handle != NULL ? dlsym(handle, name) : NULL;
}
#endif

/* *fn = the first of the four symbols `names` that the library has (left as is if none) */
static MX_UNUSED void mx_blas_describer(void* handle, const char* const names[4],
                                        mx_blas_describe_t* fn) {
    size_t i;
    for (i = 0; i < 4; i++) {
        void* c = mx_blas_sym(handle, names[i]);
        if (c == NULL) continue;
        memcpy(fn, &c, sizeof c);
        return;
    }
}

static MX_UNUSED const char* mx_blas_bind(const char* path) {
    void* handle = NULL;
    size_t i;
#if !defined(_WIN32)
    if (path == NULL) return mx_blas.name;
    handle = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);   /* already loaded: no new load */
    if (handle == NULL) return mx_blas.name;
#else
    (void)path;
#endif
    MX_BLAS_LOCK();
    for (i = 0; i < sizeof mx_blas_controls / sizeof mx_blas_controls[0]; i++) {
        void* s = mx_blas_sym(handle, mx_blas_controls[i].set);
        void* g = mx_blas_sym(handle, mx_blas_controls[i].get);
        if (s == NULL || g == NULL) continue;
        mx_blas.name = mx_blas_controls[i].name;
        /* dlsym's object pointers to function pointers: memcpy (ISO C has no such cast) */
        if (mx_blas_controls[i].kind == 1) {
            memcpy(&mx_blas.set, &s, sizeof s);
            memcpy(&mx_blas.get, &g, sizeof g);
        } else {
            memcpy(&mx_blas.set64, &s, sizeof s);
            memcpy(&mx_blas.get64, &g, sizeof g);
        }
        break;
    }
    mx_blas_describer(handle, mx_blas_corename_syms, &mx_blas.corename);
    mx_blas_describer(handle, mx_blas_config_syms, &mx_blas.config);
    MX_BLAS_UNLOCK();
#if !defined(_WIN32)
    dlclose(handle);           /* drops the reference dlopen added; the library stays loaded */
#endif
    return mx_blas.name;
}

static MX_UNUSED long long mx_blas_get_count(void) {
    if (mx_blas.get != NULL) return mx_blas.get();
    if (mx_blas.get64 != NULL) return mx_blas.get64();
    return -1;
}

static MX_UNUSED void mx_blas_set_count(long long n) {
    if (mx_blas.set != NULL) mx_blas.set((int)n);
    else if (mx_blas.set64 != NULL) mx_blas.set64(n);
}

static MX_UNUSED int mx_blas_threads(void) {
    long long n;
    MX_BLAS_LOCK();
    n = mx_blas_get_count();
    MX_BLAS_UNLOCK();
    return (int)n;
}

static MX_UNUSED const char* mx_blas_describe(mx_blas_describe_t fn) {
    const char* text = fn != NULL ? fn() : NULL;
    return text != NULL ? text : "";
}

static MX_UNUSED const char* mx_blas_corename(void) { return mx_blas_describe(mx_blas.corename); }
static MX_UNUSED const char* mx_blas_config(void) { return mx_blas_describe(mx_blas.config); }

static MX_UNUSED void mx_blas_single_begin(void) {
    MX_BLAS_LOCK();
    if (mx_blas.depth++ == 0) {
        mx_blas.saved = mx_blas_get_count();
        if (mx_blas.saved > 1) mx_blas_set_count(1);
    }
    MX_BLAS_UNLOCK();
}

static MX_UNUSED void mx_blas_single_end(void) {
    MX_BLAS_LOCK();
    if (mx_blas.depth > 0 && --mx_blas.depth == 0 && mx_blas.saved > 1)
        mx_blas_set_count(mx_blas.saved);
    MX_BLAS_UNLOCK();
}

#endif /* MX_BLAS_H */
