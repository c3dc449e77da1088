# RMSNorm: out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps), per row.
from mamba_ext.cpu.types cimport floating, idx_t

# out (M, C) and rstd (M,) written; inp (M, C), weight (C,) read.
cdef void rmsnorm_forward(floating* out, floating* rstd, const floating* inp,
                          const floating* weight, idx_t M, idx_t C, double eps) noexcept nogil

# dinp (M, C) += ; dweight (C,) += ; dout (M, C), inp, weight, rstd (M,) read.
cdef void rmsnorm_backward(floating* dinp, floating* dweight, const floating* dout,
                           const floating* inp, const floating* weight, const floating* rstd,
                           idx_t M, idx_t C) noexcept nogil
