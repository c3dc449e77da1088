# cython: language_level=3
"""RMSNorm forward/backward (size letters: M rows, Dm columns (dModel)).

out = x * rstd * weight with rstd = 1/sqrt(mean(x^2) + eps) per row.
Backward, with g = dout * weight and xhat = x * rstd:
dx = rstd * (g - xhat * mean(g * xhat)),  dweight = sum over rows of dout * xhat.
Row sums are accumulated in double for both precisions.
"""
from libc.math cimport sqrt
from mamba_ext.cpu.types cimport floating, idx_t


cdef void rmsnorm_forward(floating* out, floating* rstd, const floating* x,
                          const floating* weight, idx_t M, idx_t Dm, double eps) noexcept nogil:
    # out (M, Dm), rstd (M,) written; x (M, Dm), weight (Dm,) read
    cdef idx_t r, i
    cdef double ss, s
    cdef const floating* xr
    for r in range(M):
        xr = x + r * Dm
        ss = 0.0
        for i in range(Dm):
            ss += <double>xr[i] * xr[i]
        s = 1.0 / sqrt(ss / Dm + eps) if Dm > 0 else 1.0 / sqrt(eps)
        rstd[r] = <floating>s
        for i in range(Dm):
            out[r * Dm + i] = <floating>(xr[i] * s * weight[i])


cdef void rmsnorm_backward(floating* dx, floating* dweight, const floating* dout,
                           const floating* x, const floating* weight, const floating* rstd,
                           idx_t M, idx_t Dm) noexcept nogil:
    # dx (M, Dm) +=, dweight (Dm,) +=; dout (M, Dm), x (M, Dm), weight (Dm,), rstd (M,) read
    cdef idx_t r, i
    cdef double s, dot, xh
    cdef const floating* xr
    cdef const floating* gr
    for r in range(M):
        xr = x + r * Dm
        gr = dout + r * Dm
        s = rstd[r]
        dot = 0.0
        for i in range(Dm):
            xh = xr[i] * s
            dot += <double>gr[i] * weight[i] * xh
            dweight[i] += <floating>(gr[i] * xh)
        dot = dot / Dm if Dm > 0 else 0.0
        for i in range(Dm):
            dx[r * Dm + i] += <floating>(s * (<double>gr[i] * weight[i] - xr[i] * s * dot))
