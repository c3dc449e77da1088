# Dense layers over BLAS (scipy.linalg.cython_blas), callable without the GIL.
# Size letters: M rows, IC input columns, OC output columns.
# n_threads: the OpenMP team that runs the product (<= 0: OpenMP's default); each thread
# calls a single-threaded BLAS on its slice (linear.pyx, Design).
from mamba_ext.cpu.types cimport floating, idx_t

# out (M, OC) = x (M, IC) @ weight (OC, IC)^T + bias (OC,)   [bias may be NULL]
cdef void linear_forward(floating* out, const floating* x, const floating* weight,
                         const floating* bias, idx_t M, idx_t IC, idx_t OC,
                         int n_threads) noexcept nogil

# dx (M, IC) += dout (M, OC) @ weight (OC, IC)
# dweight (OC, IC) += dout^T @ x (M, IC)
# dbias (OC,) += column sums of dout
# Any of dx / dweight / dbias may be NULL to skip that product.
# Returns 0, or -1 when its scratch (dweight with OC < IC) cannot be allocated.
cdef int linear_backward(floating* dx, floating* dweight, floating* dbias,
                         const floating* dout, const floating* x, const floating* weight,
                         idx_t M, idx_t IC, idx_t OC, int n_threads) noexcept nogil

# The same, with dx (M, IC) = dout @ weight: written, not added to (its input is not read,
# so it needs no zeroing); the sums are the same as linear_backward's into zeros.
cdef int linear_backward_set(floating* dx, floating* dweight, floating* dbias,
                             const floating* dout, const floating* x, const floating* weight,
                             idx_t M, idx_t IC, idx_t OC, int n_threads) noexcept nogil
