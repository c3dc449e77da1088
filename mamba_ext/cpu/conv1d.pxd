# Depthwise causal conv1d over time.
# Size letters: B batch, L seqLen, D channels (dInner), K taps (dConv), M = B*L rows.
# conv[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * xc[b,t-k,d]
# (tap k = 0 multiplies the current step, zero history before t = 0).
# n_threads: the OpenMP team (<= 0: OpenMP's default), parallel over blocks of rows and
# channels.
from mamba_ext.cpu.types cimport floating, idx_t

# conv (B, L, D) contiguous written; xc rows (B*L of them) start ld_xc elements apart
# (ld_xc >= D, e.g. the xc half of the in_proj output with ld_xc = 2D).
cdef void conv1d_forward(floating* conv, const floating* xc, idx_t ld_xc,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil

# dxc (rows ld_dxc apart) +=, dweight (D, K) +=, dbias (D,) +=;
# dconv (B, L, D) contiguous, xc (rows ld_xc apart) read. Returns 0, or -1 when its scratch
# (the partial sums of the weight and bias gradients) cannot be allocated.
cdef int conv1d_backward(floating* dxc, idx_t ld_dxc, floating* dweight, floating* dbias,
                         const floating* dconv, const floating* xc, idx_t ld_xc,
                         const floating* weight,
                         idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil

# The same with dxc written, not added to (not read: the sums into zeros).
cdef int conv1d_backward_set(floating* dxc, idx_t ld_dxc, floating* dweight, floating* dbias,
                             const floating* dconv, const floating* xc, idx_t ld_xc,
                             const floating* weight,
                             idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil
