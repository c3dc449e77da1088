/* mx_threads.h - OpenMP thread count, aligned scratch, and the per-thread workspace.
 *
 *   mx_threads(n): n if n > 0, else OpenMP's default team size; 1 without OpenMP.
 *   mx_team(n, work, min_work, parts): the team for one parallel region: mx_threads(n)
 *     threads, but no more than `parts` (the slices of the work) and none with less than
 *     `min_work` units of work: a region's fork and join cost microseconds per thread, far
 *     more on a busy or many-core host, and small calls ran slower on 16 threads than on 1.
 *   mx_aligned_alloc(nbytes) / mx_aligned_free(p): 64-byte aligned scratch (one AVX-512
 *     vector per lane group), size rounded up to 64; NULL when out of memory.
 *   mx_workspace(nbytes): this thread's scratch of at least nbytes (contents undefined),
 *     kept and grown across calls and freed when the thread exits; NULL when out of memory.
 *     A fresh 10-50 MB malloc per call is a fresh mmap, and faulting its pages in cost
 *     ~5% of a size-c forward+backward. POSIX threads keys; Windows fiber-local storage
 *     (its callback frees at thread exit).
 */
#ifndef MX_THREADS_H
#define MX_THREADS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "mx_compat.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static MX_UNUSED int mx_threads(int n) {
#ifdef _OPENMP
    return n > 0 ? n : omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

static MX_UNUSED int mx_team(int n, long long work, long long min_work, long long parts) {
    long long t = mx_threads(n), by_work = min_work > 0 ? work / min_work : t;
    if (t > by_work) t = by_work;
    if (t > parts) t = parts;
    return t < 1 ? 1 : (int)t;
}

/* One code path for every C runtime (C11 aligned_alloc is missing from MSVC's and from
   C99): malloc 64 bytes more, round the address up, keep malloc's pointer just before. */
static MX_UNUSED void* mx_aligned_alloc(size_t nbytes) {
    size_t n = ((nbytes + 63) / 64) * 64;
    char* raw = (char*)malloc((n > 0 ? n : 64) + 64 + sizeof(void*));
    char* p;
    if (raw == NULL) return NULL;
    p = raw + sizeof(void*);
    p += (64 - (size_t)((uintptr_t)p % 64)) % 64;
    memcpy(p - sizeof(void*), &raw, sizeof raw);
    return p;
}

static MX_UNUSED void mx_aligned_free(void* p) {
    void* raw;
    if (p == NULL) return;
    memcpy(&raw, (char*)p - sizeof(void*), sizeof raw);
    free(raw);
}

typedef struct { void* p; size_t n; } mx_ws_t;

static MX_UNUSED void mx_ws_free(void* v) {
    if (v) { free(((mx_ws_t*)v)->p); free(v); }
}

#if defined(_WIN32)
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
static DWORD mx_ws_key = FLS_OUT_OF_INDEXES;
static INIT_ONCE mx_ws_once = INIT_ONCE_STATIC_INIT;
static void WINAPI mx_ws_free_fls(void* v) { mx_ws_free(v); }
static BOOL CALLBACK mx_ws_init(PINIT_ONCE once, PVOID param, PVOID* ctx) {
    (void)once; (void)param; (void)ctx;
    mx_ws_key = FlsAlloc(mx_ws_free_fls);
    return TRUE;
}
static MX_UNUSED mx_ws_t* mx_ws_get(void) {
    mx_ws_t* w;
    InitOnceExecuteOnce(&mx_ws_once, mx_ws_init, NULL, NULL);
    if (mx_ws_key == FLS_OUT_OF_INDEXES) return NULL;
    w = (mx_ws_t*)FlsGetValue(mx_ws_key);
    if (w == NULL) {
        w = (mx_ws_t*)calloc(1, sizeof(mx_ws_t));
        if (w == NULL || !FlsSetValue(mx_ws_key, w)) { free(w); return NULL; }
    }
    return w;
}
#else
#include <pthread.h>
static pthread_key_t mx_ws_key;
static pthread_once_t mx_ws_once = PTHREAD_ONCE_INIT;
static int mx_ws_ok = 0;
static void mx_ws_init(void) { mx_ws_ok = pthread_key_create(&mx_ws_key, mx_ws_free) == 0; }
static MX_UNUSED mx_ws_t* mx_ws_get(void) {
    mx_ws_t* w;
    pthread_once(&mx_ws_once, mx_ws_init);
    if (!mx_ws_ok) return NULL;
    w = (mx_ws_t*)pthread_getspecific(mx_ws_key);
    if (w == NULL) {
        w = (mx_ws_t*)calloc(1, sizeof(mx_ws_t));
        if (w == NULL || pthread_setspecific(mx_ws_key, w) != 0) { free(w); return NULL; }
    }
    return w;
}
#endif

static MX_UNUSED void* mx_workspace(size_t nbytes) {
    mx_ws_t* w = mx_ws_get();
    if (w == NULL) return NULL;
    if (w->n < nbytes) {
        free(w->p);
        w->p = malloc(nbytes > 0 ? nbytes : 1);
        w->n = w->p ? nbytes : 0;
    }
    return w->p;
}

#endif /* MX_THREADS_H */
