# cython: language_level=3
"""RMSNorm forward/backward (size letters: M rows, Dm columns (dModel)).

out = x * rstd * weight with rstd = 1/sqrt(mean(x^2) + eps) per row.
Backward, with g = dout * weight and xhat = x * rstd:
dx = rstd * (g - xhat * mean(g * xhat)),  dweight = sum over rows of dout * xhat.
Row sums are accumulated in double for both precisions, in a fixed order
(csrc/mx_activations.h, mx_row_dot2/3: eight partial sums, not one chain of dependent adds).

Threads: one region each. Rows are split among the threads (out, rstd, dx); dweight is
split by columns, each thread summing its columns over all rows in row order, so every
result is the same for any thread count.
"""
from libc.math cimport sqrt
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.threads cimport mx_team
from mamba_ext.cpu.activations cimport (
    mx_row_dot2_d, mx_row_dot2_f, mx_row_dot3_d, mx_row_dot3_f, mx_rmsnorm_row_f,
    mx_rmsnorm_row_d, mx_rmsnorm_dx_row_f, mx_rmsnorm_dx_row_d, mx_rmsnorm_dw_row_f,
    mx_rmsnorm_dw_row_d)

cdef enum:
    # values per thread below which another thread costs more than it saves
    MIN_WORK_PER_THREAD = 1 << 15
    # dweight column slices start at multiples of this (a cache line of floats)
    COL_ALIGN = 16


cdef inline void forward_row(floating* out, floating* rstd, const floating* x,
                             const floating* weight, idx_t r, idx_t Dm, double eps) noexcept nogil:
    cdef const floating* xr = x + r * Dm
    cdef double ss, s
    if floating is float:
        ss = mx_row_dot2_f(xr, xr, Dm)
    else:
        ss = mx_row_dot2_d(xr, xr, Dm)
    s = 1.0 / sqrt(ss / Dm + eps) if Dm > 0 else 1.0 / sqrt(eps)
    rstd[r] = <floating>s
    if floating is float:
        mx_rmsnorm_row_f(out + r * Dm, xr, weight, s, Dm)
    else:
        mx_rmsnorm_row_d(out + r * Dm, xr, weight, s, Dm)


cdef void rmsnorm_forward(floating* out, floating* rstd, const floating* x,
                          const floating* weight, idx_t M, idx_t Dm, double eps,
                          int n_threads) noexcept nogil:
    # out (M, Dm), rstd (M,) written; x (M, Dm), weight (Dm,) read
    cdef idx_t r
    cdef int nt = mx_team(n_threads, M * Dm, MIN_WORK_PER_THREAD, M)
    if nt == 1:         # no parallel region (the recurrent step's few rows, every token)
        for r in range(M):
            forward_row(out, rstd, x, weight, r, Dm, eps)
        return
    for r in prange(M, schedule='static', num_threads=nt):
        forward_row(out, rstd, x, weight, r, Dm, eps)


cdef inline void backward_row(floating* dx, const floating* dout, const floating* x,
                              const floating* weight, const floating* rstd, idx_t r,
                              idx_t Dm) noexcept nogil:
    cdef const floating* xr = x + r * Dm
    cdef const floating* gr = dout + r * Dm
    cdef double s = rstd[r], dot
    # mean(g * xhat) = rstd * mean(dout * weight * x)
    if floating is float:
        dot = mx_row_dot3_f(gr, weight, xr, Dm)
    else:
        dot = mx_row_dot3_d(gr, weight, xr, Dm)
    dot = dot * s / Dm if Dm > 0 else 0.0
    if floating is float:
        mx_rmsnorm_dx_row_f(dx + r * Dm, gr, weight, xr, s, dot, Dm)
    else:
        mx_rmsnorm_dx_row_d(dx + r * Dm, gr, weight, xr, s, dot, Dm)


cdef inline void dweight_cols(floating* dweight, const floating* dout, const floating* x,
                              const floating* rstd, idx_t M, idx_t Dm, idx_t lo,
                              idx_t hi) noexcept nogil:
    # dweight[lo:hi] += sum over rows, in row order, of dout * x * rstd
    cdef idx_t r
    for r in range(M):
        if floating is float:
            mx_rmsnorm_dw_row_f(dweight + lo, dout + r * Dm + lo, x + r * Dm + lo, rstd[r], hi - lo)
        else:
            mx_rmsnorm_dw_row_d(dweight + lo, dout + r * Dm + lo, x + r * Dm + lo, rstd[r], hi - lo)


cdef void rmsnorm_backward(floating* dx, floating* dweight, const floating* dout,
                           const floating* x, const floating* weight, const floating* rstd,
                           idx_t M, idx_t Dm, int n_threads) noexcept nogil:
    # dx (M, Dm) +=, dweight (Dm,) +=; dout (M, Dm), x (M, Dm), weight (Dm,), rstd (M,) read
    cdef idx_t r, t, q, lo, hi
    cdef int nt = mx_team(n_threads, M * Dm, MIN_WORK_PER_THREAD, M)
    # thread t's dweight columns: [t*q, (t+1)*q) (dweight reads no dx: no barrier needed)
    q = ((Dm + nt - 1) // nt + COL_ALIGN - 1) // COL_ALIGN * COL_ALIGN
    for t in prange(nt, schedule='static', num_threads=nt):
        lo = t * M // nt
        hi = (t + 1) * M // nt
        for r in range(lo, hi):
            backward_row(dx, dout, x, weight, rstd, r, Dm)
        lo = min(Dm, t * q)
        hi = min(Dm, lo + q)
        if hi > lo:
            dweight_cols(dweight, dout, x, rstd, M, Dm, lo, hi)
