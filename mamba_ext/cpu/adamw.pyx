# AdamW step and gradient reductions (contract and exact maths: adamw.pxd).
#
# Size letter: n elements. Every buffer is flat: w, m, v, g, x (n,) C-contiguous, one
# dtype per call.
# Large buffers are cut into CHUNK-element pieces handed to OpenMP threads;
# each piece runs a branch-free loop the compiler can vectorise (checked with
# gcc -fopt-info-vec: the float32 AdamW loop vectorises on baseline x86-64
# SSE2; the float64 one needs AVX2 for its 64-bit compare masks, else scalar).
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t
from libc.math cimport sqrt, sqrtf, INFINITY

cdef enum:
    CHUNK = 16384          # elements per OpenMP work item
    PAR_MIN = 65536        # below this, threads cost more than they save


# c ? a : b on the bits, so the loop stays vectorisable (why: csrc/mx_adamw.h)
cdef extern from "csrc/mx_adamw.h" nogil:
    float mx_select_f(int c, float a, float b) noexcept
    double mx_select_d(int c, double a, double b) noexcept


cdef inline floating _select(bint c, floating a, floating b) noexcept nogil:
    if floating is float:
        return mx_select_f(c, a, b)
    else:
        return mx_select_d(c, a, b)


cdef inline floating _sqrt(floating x) noexcept nogil:
    if floating is float:
        return sqrtf(x)        # stay in float32: no double round trip per element
    else:
        return sqrt(x)


cdef inline idx_t _nchunks(idx_t n) noexcept nogil:
    return (n + CHUNK - 1) // CHUNK


cdef inline idx_t _chunk_end(idx_t c, idx_t n) noexcept nogil:
    return n if (c + 1) * CHUNK > n else (c + 1) * CHUNK


cdef inline idx_t _adamw_range(floating* w, floating* m, floating* v, const floating* g,
                               idx_t lo, idx_t hi, floating gs, floating omb1,
                               floating b2, floating omb2, floating decay,
                               floating step_size, floating sqrt_bc2, floating eps,
                               floating md) noexcept nogil:
    """Elements [lo, hi) of adamw_step; md is +inf when the clamp is off."""
    cdef idx_t i, bad = 0
    cdef floating gi, wi, mo, vo, mi, vi, d
    cdef bint ok
    for i in range(lo, hi):
        # Load once into locals: the selects below then need no reload.
        gi = g[i] * gs
        wi = w[i]
        mo = m[i]
        vo = v[i]
        mi = mo + omb1 * (gi - mo)                # PyTorch's lerp form of b1*m + (1-b1)*g
        vi = b2 * vo + omb2 * gi * gi
        d = decay * wi + step_size * mi / (_sqrt(vi) / sqrt_bc2 + eps)
        # x - x is 0 for finite x and NaN otherwise: one test for both values.
        ok = (d - d) + (vi - vi) == 0
        d = md if d > md else d
        d = -md if d < -md else d
        # Selects, not branches, so the loop stays vectorisable.
        w[i] = _select(ok, wi - d, wi)
        m[i] = _select(ok, mi, mo)
        v[i] = _select(ok, vi, vo)
        bad += not ok
    return bad


cdef idx_t adamw_step(floating* w, floating* m, floating* v, const floating* g, idx_t n,
                      double lr, double beta1, double beta2, double eps,
                      double weight_decay, double max_delta, long long step,
                      double grad_scale, int n_threads) noexcept nogil:
    # Scalars once, in double, then cast to the buffers' precision.
    cdef double bc1 = 1.0 - beta1 ** <double>step
    cdef double bc2 = 1.0 - beta2 ** <double>step
    cdef floating gs = <floating>grad_scale
    cdef floating omb1 = <floating>(1.0 - beta1)
    cdef floating b2 = <floating>beta2
    cdef floating omb2 = <floating>(1.0 - beta2)
    cdef floating decay = <floating>(lr * weight_decay)
    cdef floating step_size = <floating>(lr / bc1)
    cdef floating sqrt_bc2 = <floating>sqrt(bc2)
    cdef floating e = <floating>eps
    cdef floating md = <floating>max_delta if max_delta > 0 else <floating>INFINITY
    cdef idx_t c, bad = 0, nch = _nchunks(n)
    if n <= 0:
        return 0
    if n < PAR_MIN or n_threads == 1:
        return _adamw_range(w, m, v, g, 0, n, gs, omb1, b2, omb2, decay, step_size,
                            sqrt_bc2, e, md)
    if n_threads > 0:
        for c in prange(nch, schedule='static', num_threads=n_threads):
            bad += _adamw_range(w, m, v, g, c * CHUNK, _chunk_end(c, n), gs, omb1, b2, omb2,
                                decay, step_size, sqrt_bc2, e, md)
    else:
        for c in prange(nch, schedule='static'):
            bad += _adamw_range(w, m, v, g, c * CHUNK, _chunk_end(c, n), gs, omb1, b2, omb2,
                                decay, step_size, sqrt_bc2, e, md)
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
