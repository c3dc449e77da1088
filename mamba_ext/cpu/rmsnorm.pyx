# cython: language_level=3
"""RMSNorm forward/backward (size letters: M rows, C columns).

out = inp * rstd * weight with rstd = 1/sqrt(mean(inp^2) + eps) per row.
Backward, with g = dout * weight and xhat = inp * rstd:
dinp = rstd * (g - xhat * mean(g * xhat)),  dweight = sum over rows of dout * xhat.
Row sums are accumulated in double for both precisions.
"""
from libc.math cimport sqrt
from mamba_ext.cpu.types cimport floating, idx_t


cdef void rmsnorm_forward(floating* out, floating* rstd, const floating* inp,
                          const floating* weight, idx_t M, idx_t C, double eps) noexcept nogil:
    # out (M, C), rstd (M,) written; inp (M, C), weight (C,) read
    cdef idx_t r, i
    cdef double ss, s
    cdef const floating* xr
    for r in range(M):
        xr = inp + r * C
        ss = 0.0
        for i in range(C):
            ss += <double>xr[i] * xr[i]
        s = 1.0 / sqrt(ss / C + eps) if C > 0 else 1.0 / sqrt(eps)
        rstd[r] = <floating>s
        for i in range(C):
            out[r * C + i] = <floating>(xr[i] * s * weight[i])


cdef void rmsnorm_backward(floating* dinp, floating* dweight, const floating* dout,
                           const floating* inp, const floating* weight, const floating* rstd,
                           idx_t M, idx_t C) noexcept nogil:
    # dinp (M, C) +=, dweight (C,) +=; dout (M, C), inp (M, C), weight (C,), rstd (M,) read
    cdef idx_t r, i
    cdef double s, dot, xh
    cdef const floating* xr
    cdef const floating* gr
    for r in range(M):
        xr = inp + r * C
        gr = dout + r * C
        s = rstd[r]
        dot = 0.0
        for i in range(C):
            xh = xr[i] * s
            dot += <double>gr[i] * weight[i] * xh
            dweight[i] += <floating>(gr[i] * xh)
        dot = dot / C if C > 0 else 0.0
        for i in range(C):
            dinp[r * C + i] += <floating>(s * (<double>gr[i] * weight[i] - xr[i] * s * dot))
