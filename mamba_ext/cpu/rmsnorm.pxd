# RMSNorm: out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps), per row.
from mamba_ext.cpu.types cimport floating, idx_t

# n_threads: the OpenMP team (<= 0: OpenMP's default); results do not depend on it.
# out (M, Dm) and rstd (M,) written; x (M, Dm), weight (Dm,) read.
cdef void rmsnorm_forward(floating* out, floating* rstd, const floating* x,
                          const floating* weight, idx_t M, idx_t Dm, double eps,
                          int n_threads) noexcept nogil

# dx (M, Dm) += ; dweight (Dm,) += ; dout (M, Dm), x, weight, rstd (M,) read.
cdef void rmsnorm_backward(floating* dx, floating* dweight, const floating* dout,
                           const floating* x, const floating* weight, const floating* rstd,
                           idx_t M, idx_t Dm, int n_threads) noexcept nogil
