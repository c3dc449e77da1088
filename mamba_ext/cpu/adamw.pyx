# AdamW step and gradient reductions (contract and exact maths: adamw.pxd).
#
# Size letter: n elements. Every buffer is flat: w, m, v, g, x (n,) C-contiguous, one
# dtype per call.
# Large buffers are cut into CHUNK-element pieces handed to OpenMP threads;
# each piece runs a branch-free loop the compiler vectorises (csrc/mx_adamw.h, compiled
# for AVX-512 / AVX2 / baseline with runtime dispatch where the compiler supports it).
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.threads cimport mx_team
from libc.math cimport sqrt, INFINITY
from libc.stdlib cimport malloc, free
cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef enum:
    CHUNK = 16384          # elements per OpenMP work item
    PAR_MIN = 65536        # below this, threads cost more than they save


# the element loop of the AdamW step (csrc/mx_adamw.h)
cdef extern from "csrc/mx_adamw.h" nogil:
    idx_t mx_adamw_range_f(float* w, float* m, float* v, const float* g, idx_t lo, idx_t hi,
                           float gs, float omb1, float b2, float omb2, float decay,
                           float step_size, float sqrt_bc2, float eps, float md) noexcept
    idx_t mx_adamw_range_d(double* w, double* m, double* v, const double* g, idx_t lo,
                           idx_t hi, double gs, double omb1, double b2, double omb2,
                           double decay, double step_size, double sqrt_bc2, double eps,
                           double md) noexcept


cdef inline idx_t _nchunks(idx_t n) noexcept nogil:
    return (n + CHUNK - 1) // CHUNK


cdef inline idx_t _chunk_end(idx_t c, idx_t n) noexcept nogil:
    return n if (c + 1) * CHUNK > n else (c + 1) * CHUNK


ctypedef struct hyper:
    # the scalars of one AdamW step, computed once in double (adamw_hyper); each is cast
    # to the buffers' precision where a range runs (_adamw_range)
    double lr, gs, omb1, b2, omb2, step_size, sqrt_bc2, eps, md


cdef inline hyper adamw_hyper(double lr, double beta1, double beta2, double eps,
                              double max_delta, long long step,
                              double grad_scale) noexcept nogil:
    # gs the gradient scale, omb1 = 1 - beta1, omb2 = 1 - beta2, step_size = lr / (1 -
    # beta1^t), sqrt_bc2 = sqrt(1 - beta2^t), md the clamp (+inf when off)
    cdef hyper h
    h.lr = lr
    h.gs = grad_scale
    h.omb1 = 1.0 - beta1
    h.b2 = beta2
    h.omb2 = 1.0 - beta2
    h.step_size = lr / (1.0 - beta1 ** <double>step)
    h.sqrt_bc2 = sqrt(1.0 - beta2 ** <double>step)
    h.eps = eps
    h.md = max_delta if max_delta > 0 else INFINITY
    return h


cdef inline idx_t _adamw_range(floating* w, floating* m, floating* v, const floating* g,
                               idx_t lo, idx_t hi, const hyper* h,
                               double weight_decay) noexcept nogil:
    """Elements [lo, hi) of adamw_step (csrc/mx_adamw.h) with decay lr * weight_decay."""
    if floating is float:
        return mx_adamw_range_f(w, m, v, g, lo, hi, <float>h.gs, <float>h.omb1, <float>h.b2,
                                <float>h.omb2, <float>(h.lr * weight_decay),
                                <float>h.step_size, <float>h.sqrt_bc2, <float>h.eps,
                                <float>h.md)
    else:
        return mx_adamw_range_d(w, m, v, g, lo, hi, h.gs, h.omb1, h.b2, h.omb2,
                                h.lr * weight_decay, h.step_size, h.sqrt_bc2, h.eps, h.md)


cdef idx_t adamw_step(floating* w, floating* m, floating* v, const floating* g, idx_t n,
                      double lr, double beta1, double beta2, double eps,
                      double weight_decay, double max_delta, long long step,
                      double grad_scale, int n_threads) noexcept nogil:
    cdef hyper h = adamw_hyper(lr, beta1, beta2, eps, max_delta, step, grad_scale)
    cdef idx_t c, bad = 0, nch = _nchunks(n)
    if n <= 0:
        return 0
    if n < PAR_MIN or n_threads == 1:
        return _adamw_range(w, m, v, g, 0, n, &h, weight_decay)
    if n_threads > 0:
        for c in prange(nch, schedule='static', num_threads=n_threads):
            bad += _adamw_range(w, m, v, g, c * CHUNK, _chunk_end(c, n), &h, weight_decay)
    else:
        for c in prange(nch, schedule='static'):
            bad += _adamw_range(w, m, v, g, c * CHUNK, _chunk_end(c, n), &h, weight_decay)
    return bad


cdef inline double _sumsq_range(const floating* x, idx_t lo, idx_t hi, double scale) noexcept nogil:
    cdef idx_t i
    cdef double s = 0.0, xi
    for i in range(lo, hi):
        xi = <double>x[i] * scale
        s += xi * xi
    return s


cdef double sumsq(const floating* x, idx_t n, double scale, int n_threads) noexcept nogil:
    cdef idx_t c, nch = _nchunks(n)
    cdef double s = 0.0
    if n < PAR_MIN or n_threads == 1:
        return _sumsq_range(x, 0, n, scale) if n > 0 else 0.0
    if n_threads > 0:
        for c in prange(nch, schedule='static', num_threads=n_threads):
            s += _sumsq_range(x, c * CHUNK, _chunk_end(c, n), scale)
    else:
        for c in prange(nch, schedule='static'):
            s += _sumsq_range(x, c * CHUNK, _chunk_end(c, n), scale)
    return s


cdef inline idx_t _nonfinite_range(const floating* x, idx_t lo, idx_t hi) noexcept nogil:
    cdef idx_t i, bad = 0
    for i in range(lo, hi):
        bad += (x[i] - x[i]) != 0          # NaN for NaN and +-Inf
    return bad


cdef idx_t count_nonfinite(const floating* x, idx_t n, int n_threads) noexcept nogil:
    cdef idx_t c, bad = 0, nch = _nchunks(n)
    if n < PAR_MIN or n_threads == 1:
        return _nonfinite_range(x, 0, n) if n > 0 else 0
    if n_threads > 0:
        for c in prange(nch, schedule='static', num_threads=n_threads):
            bad += _nonfinite_range(x, c * CHUNK, _chunk_end(c, n))
    else:
        for c in prange(nch, schedule='static'):
            bad += _nonfinite_range(x, c * CHUNK, _chunk_end(c, n))
    return bad


# ---- Python entry points over flat arrays (used by mamba_ext.optim) --------
# Callers validate dtypes and sizes; a dtype mix raises here, a size mismatch
# is refused below, so no call reads or writes out of bounds.

def adamw_update_array(floating[::1] w, floating[::1] m, floating[::1] v,
                       const floating[::1] g, double lr, double beta1, double beta2,
                       double eps, double weight_decay, double max_delta, long long step,
                       double grad_scale=1.0, int n_threads=0):
    """In-place AdamW step on flat arrays w, m, v with gradient g (see adamw.pxd).

    Returns the number of elements left unchanged by the NaN guard.
    """
    cdef idx_t n = w.shape[0], bad
    if m.shape[0] != n or v.shape[0] != n or g.shape[0] != n:
        raise ValueError(f"adamw_update_array: sizes differ: w {n}, m {m.shape[0]}, "
                         f"v {v.shape[0]}, g {g.shape[0]}")
    if step < 1:
        raise ValueError(f"adamw_update_array: step must be >= 1, got {step}")
    if n == 0:
        return 0
    with nogil:
        bad = adamw_step(&w[0], &m[0], &v[0], &g[0], n, lr, beta1, beta2, eps,
                         weight_decay, max_delta, step, grad_scale, n_threads)
    return bad


def sumsq_array(const floating[::1] x, double scale=1.0, int n_threads=0):
    """Sum of (x * scale)^2 over a flat array, accumulated in float64."""
    cdef double s
    if x.shape[0] == 0:
        return 0.0
    with nogil:
        s = sumsq(&x[0], x.shape[0], scale, n_threads)
    return s


def count_nonfinite_array(const floating[::1] x, int n_threads=0):
    """Number of NaN / +-Inf elements of a flat array."""
    cdef idx_t c
    if x.shape[0] == 0:
        return 0
    with nogil:
        c = count_nonfinite(&x[0], x.shape[0], n_threads)
    return c


# ---- Many arrays in one call (mamba_ext.optim.AdamW.step) ---------------------------
# A model's parameters are dozens of small arrays; one call per array spent more time in
# Python and in acquiring buffers than in the arithmetic, on the calling thread alone.
# These take lists of flat arrays of one dtype, cut them into pieces of at most CHUNK
# elements (one array per piece) and run the pieces in one parallel region.


ctypedef struct piece:
    idx_t a, lo, hi          # array a, elements [lo, hi)


cdef piece* _pieces(const idx_t* sizes, idx_t count, idx_t* npieces) noexcept nogil:
    # the pieces of `count` arrays of sizes[a] elements, in array order (malloc'd, or NULL)
    cdef idx_t a, lo, k = 0, total = 0
    cdef piece* p
    for a in range(count):
        total += _nchunks(sizes[a])
    p = <piece*>malloc(max(total, <idx_t>1) * sizeof(piece))
    if p != NULL:
        for a in range(count):
            lo = 0
            while lo < sizes[a]:
                p[k].a, p[k].lo = a, lo
                p[k].hi = min(lo + CHUNK, sizes[a])
                lo = p[k].hi
                k += 1
    npieces[0] = total
    return p


cdef idx_t _count_many(floating** x, const piece* p, idx_t np_, idx_t total,
                       int n_threads) noexcept nogil:
    cdef idx_t k, bad = 0
    for k in prange(np_, schedule='static',
                    num_threads=mx_team(n_threads, total, PAR_MIN // 2, np_)):
        bad += _nonfinite_range(x[p[k].a], p[k].lo, p[k].hi)
    return bad


cdef idx_t _update_many(floating** w, floating** m, floating** v, floating** g,
                        const double* weight_decay, const piece* p, idx_t np_, idx_t total,
                        double lr, double beta1, double beta2, double eps,
                        double max_delta, long long step, double grad_scale,
                        int n_threads) noexcept nogil:
    # adamw_step over every piece, weight_decay[a] for array a: the same scalars, so the
    # same bits as one adamw_step call per array
    cdef hyper h = adamw_hyper(lr, beta1, beta2, eps, max_delta, step, grad_scale)
    cdef idx_t k, a, bad = 0
    for k in prange(np_, schedule='static',
                    num_threads=mx_team(n_threads, total, PAR_MIN // 2, np_)):
        a = p[k].a
        bad += _adamw_range(w[a], m[a], v[a], g[a], p[k].lo, p[k].hi, &h, weight_decay[a])
    return bad


cdef int _float_kind(object arrays, str what) except -1:
    # 0 float32, 1 float64: the one dtype of a list of flat C-contiguous arrays
    kinds = set()
    for x in arrays:
        if (not isinstance(x, cnp.ndarray) or x.ndim != 1 or not x.flags.c_contiguous
                or x.dtype not in (np.float32, np.float64)):
            raise TypeError(f"{what}: expected flat C-contiguous float32 or float64 arrays, got "
                            f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
        kinds.add(x.dtype == np.float64)
    if len(kinds) > 1:
        raise TypeError(f"{what}: the arrays must share one dtype")
    return 1 if kinds == {True} else 0


def count_nonfinite_arrays(arrays, int n_threads=0):
    """Number of NaN / +-Inf elements over a list of flat C-contiguous arrays of one dtype
    (float32 or float64), in one parallel region."""
    cdef idx_t count = len(arrays), a, np_ = 0, total = 0, bad
    cdef int kind = _float_kind(arrays, "count_nonfinite_arrays")
    cdef idx_t* sizes = <idx_t*>malloc(max(count, <idx_t>1) * sizeof(idx_t))
    cdef void** ptr = <void**>malloc(max(count, <idx_t>1) * sizeof(void*))
    cdef piece* p = NULL
    try:
        if sizes == NULL or ptr == NULL:
            raise MemoryError()
        for a in range(count):
            sizes[a] = arrays[a].shape[0]
            ptr[a] = cnp.PyArray_DATA(arrays[a])
            total += sizes[a]
        p = _pieces(sizes, count, &np_)
        if p == NULL:
            raise MemoryError()
        with nogil:
            if kind == 0:
                bad = _count_many(<float**>ptr, p, np_, total, n_threads)
            else:
                bad = _count_many(<double**>ptr, p, np_, total, n_threads)
        return bad
    finally:
        free(sizes)
        free(ptr)
        free(p)


def adamw_update_arrays(ws, ms, vs, gs, weight_decays, double lr, double beta1,
                        double beta2, double eps, double max_delta, long long step,
                        double grad_scale=1.0, int n_threads=0):
    """adamw_update_array over lists of flat arrays (ws[i], ms[i], vs[i], gs[i] of one size;
    all of one dtype), each with its own weight decay, in one parallel region; the same
    bits as one adamw_update_array call per array. Returns the number of elements left
    unchanged by the NaN guard."""
    cdef idx_t count = len(ws), a, np_ = 0, total = 0, bad
    cdef int kind
    cdef idx_t* sizes
    cdef void** ptr
    cdef double* wd
    cdef piece* p = NULL
    if not (len(ms) == len(vs) == len(gs) == len(weight_decays) == count):
        raise ValueError("adamw_update_arrays: ws, ms, vs, gs and weight_decays must have "
                         "one length")
    if step < 1:
        raise ValueError(f"adamw_update_arrays: step must be >= 1, got {step}")
    kind = _float_kind(list(ws) + list(ms) + list(vs) + list(gs), "adamw_update_arrays")
    for a in range(count):
        n = ws[a].shape[0]
        if ms[a].shape[0] != n or vs[a].shape[0] != n or gs[a].shape[0] != n:
            raise ValueError(f"adamw_update_arrays: sizes differ in array {a}: w {n}, "
                             f"m {ms[a].shape[0]}, v {vs[a].shape[0]}, g {gs[a].shape[0]}")
        for x in (ws[a], ms[a], vs[a]):
            if not x.flags.writeable:
                raise ValueError(f"adamw_update_arrays: array {a} is read-only")
    sizes = <idx_t*>malloc(max(count, <idx_t>1) * sizeof(idx_t))
    ptr = <void**>malloc(4 * max(count, <idx_t>1) * sizeof(void*))
    wd = <double*>malloc(max(count, <idx_t>1) * sizeof(double))
    try:
        if sizes == NULL or ptr == NULL or wd == NULL:
            raise MemoryError()
        for a in range(count):
            sizes[a] = ws[a].shape[0]
            total += sizes[a]
            ptr[a] = cnp.PyArray_DATA(ws[a])
            ptr[count + a] = cnp.PyArray_DATA(ms[a])
            ptr[2 * count + a] = cnp.PyArray_DATA(vs[a])
            ptr[3 * count + a] = cnp.PyArray_DATA(gs[a])
            wd[a] = float(weight_decays[a])
        p = _pieces(sizes, count, &np_)
        if p == NULL:
            raise MemoryError()
        with nogil:
            if kind == 0:
                bad = _update_many(<float**>ptr, <float**>ptr + count, <float**>ptr + 2 * count,
                                   <float**>ptr + 3 * count, wd, p, np_, total, lr, beta1,
                                   beta2, eps, max_delta, step, grad_scale, n_threads)
            else:
                bad = _update_many(<double**>ptr, <double**>ptr + count,
                                   <double**>ptr + 2 * count, <double**>ptr + 3 * count, wd,
                                   p, np_, total, lr, beta1, beta2, eps, max_delta, step,
                                   grad_scale, n_threads)
        return bad
    finally:
        free(sizes)
        free(ptr)
        free(wd)
        free(p)
