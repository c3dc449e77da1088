# Dense layers over BLAS (scipy.linalg.cython_blas), callable without the GIL.
from mamba_ext.cpu.types cimport floating, idx_t

# out (M, OC) = inp (M, C) @ weight (OC, C)^T + bias (OC,)   [bias may be NULL]
cdef void linear_forward(floating* out, const floating* inp, const floating* weight,
                         const floating* bias, idx_t M, idx_t C, idx_t OC) noexcept nogil

# dinp (M, C) += dout (M, OC) @ weight (OC, C)
# dweight (OC, C) += dout^T @ inp (M, C)
# dbias (OC,) += column sums of dout
# Any of dinp / dweight / dbias may be NULL to skip that product.
cdef void linear_backward(floating* dinp, floating* dweight, floating* dbias,
                          const floating* dout, const floating* inp, const floating* weight,
                          idx_t M, idx_t C, idx_t OC) noexcept nogil
