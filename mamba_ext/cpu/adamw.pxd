# AdamW step and gradient reductions on raw buffers (see types.pxd for idx_t).
#
# Every buffer is C-contiguous with n elements; w, m, v, g of one call have one
# dtype. All functions are callable without the GIL and never allocate.
# n_threads >= 1 is the OpenMP team size for large n (n < 65536 always runs on
# the calling thread); n_threads <= 0 means the OpenMP default.
from mamba_ext.cpu.types cimport floating, idx_t

# One AdamW step (PyTorch torch.optim.AdamW semantics) over n elements, in place:
#   gi    = g[i] * grad_scale                          (unscale / clip factor)
#   m'    = beta1 * m[i] + (1 - beta1) * gi
#   v'    = beta2 * v[i] + (1 - beta2) * gi^2
#   delta = lr * weight_decay * w[i]                    (decoupled, pre-update w)
#         + lr / (1 - beta1^step) * m' / (sqrt(v' / (1 - beta2^step)) + eps)
#   if max_delta > 0: delta = clamp(delta, -max_delta, max_delta)
#                     (the decay is INSIDE the clamp: |w' - w| <= max_delta)
#   w[i] -= delta; m[i] = m'; v[i] = v'
# NaN guard: an element whose delta or v' is not finite (NaN/Inf gradient,
# overflow) keeps w[i], m[i] and v[i] unchanged. `step` is the 1-based count
# of this step (bias corrections). Returns the number of such elements.
# Arithmetic is in the buffers' precision (hyper-parameters cast to it).
cdef idx_t adamw_step(floating* w, floating* m, floating* v, const floating* g, idx_t n,
                      double lr, double beta1, double beta2, double eps,
                      double weight_decay, double max_delta, long long step,
                      double grad_scale, int n_threads) noexcept nogil

# Sum over i of (x[i] * scale)^2, accumulated in double (Inf/NaN propagate).
cdef double sumsq(const floating* x, idx_t n, double scale, int n_threads) noexcept nogil

# Number of elements of x that are NaN or +-Inf.
cdef idx_t count_nonfinite(const floating* x, idx_t n, int n_threads) noexcept nogil
