# Depthwise causal conv1d over time (size letters in _types.pxd).
# out[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * inp[b,t-k,d]
# (tap k = 0 multiplies the current step, zero history before t = 0).
from mamba_ext.cpu.types cimport floating, idx_t

# out (B, L, D) contiguous written; inp rows (B*L of them) start ld_in elements apart
# (ld_in >= D, e.g. the xc half of the in_proj output with ld_in = 2D).
cdef void conv1d_forward(floating* out, const floating* inp, idx_t ld_in,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil

# dinp (rows ld_dinp apart) +=, dweight (D, K) +=, dbias (D,) +=;
# dout (B, L, D) contiguous, inp (rows ld_in apart) read.
cdef void conv1d_backward(floating* dinp, idx_t ld_dinp, floating* dweight, floating* dbias,
                          const floating* dout, const floating* inp, idx_t ld_in,
                          const floating* weight,
                          idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil
