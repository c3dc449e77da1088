# cython: language_level=3
"""Dense layers over BLAS (scipy.linalg.cython_blas), callable without the GIL.

Size letters: M rows (= B*L), IC input columns, OC output columns.

BLAS is column-major: a row-major (rows, cols) buffer is the column-major
(cols, rows) matrix with leading dimension cols. So the row-major product
out (M, OC) = x (M, IC) @ W (OC, IC)^T is, column-major,
out^T (OC, M) = W^T (OC, IC) . x^T (IC, M) = gemm('T', 'N', OC, M, IC, W, IC, x, IC, out, OC).

BLAS takes 32-bit ``int`` sizes: the products are split into row blocks so
that no size passed to BLAS exceeds INT_MAX (callers validate that IC and OC
fit; see ``_validate.check_count``).
"""
from scipy.linalg.cython_blas cimport sgemm, dgemm
from mamba_ext.cpu.types cimport floating, idx_t

cdef extern from "limits.h":
    const int INT_MAX


cdef inline void gemm(char ta, char tb, idx_t m, idx_t n, idx_t k,
                      floating alpha, const floating* a, idx_t lda,
                      const floating* b, idx_t ldb, floating beta,
                      floating* c, idx_t ldc) noexcept nogil:
    """Column-major C (m, n) = alpha op(A) op(B) + beta C; sizes < INT_MAX."""
    cdef int im = <int>m, jn = <int>n, kk = <int>k
    cdef int ia = <int>lda, ib = <int>ldb, ic = <int>ldc
    if m == 0 or n == 0:
        return
    if floating is float:
        sgemm(&ta, &tb, &im, &jn, &kk, &alpha, <float*>a, &ia, <float*>b, &ib, &beta, c, &ic)
    else:
        dgemm(&ta, &tb, &im, &jn, &kk, &alpha, <double*>a, &ia, <double*>b, &ib, &beta, c, &ic)


cdef inline idx_t row_block(idx_t width) noexcept nogil:
    # Rows per BLAS call such that rows and rows*width stay below INT_MAX.
    cdef idx_t w = width if width > 0 else 1
    return max(<idx_t>1, min(<idx_t>INT_MAX, <idx_t>INT_MAX // w))


cdef void linear_forward(floating* out, const floating* x, const floating* weight,
                         const floating* bias, idx_t M, idx_t IC, idx_t OC) noexcept nogil:
    # out (M, OC) = x (M, IC) @ weight (OC, IC)^T + bias (OC,)
    cdef idx_t r, o, r0, mb, step = row_block(max(IC, OC))
    cdef floating beta = 0, one = 1
    if bias != NULL:
        for r in range(M):
            for o in range(OC):
                out[r * OC + o] = bias[o]
        beta = 1
    if IC == 0:
        if bias == NULL:
            for r in range(M * OC):
                out[r] = 0
        return
    r0 = 0
    while r0 < M:
        mb = min(step, M - r0)
        gemm(c'T', c'N', OC, mb, IC, one, weight, IC, x + r0 * IC, IC,
             beta, out + r0 * OC, OC)
        r0 += mb


cdef void linear_backward(floating* dx, floating* dweight, floating* dbias,
                          const floating* dout, const floating* x, const floating* weight,
                          idx_t M, idx_t IC, idx_t OC) noexcept nogil:
    cdef idx_t r, o, r0, mb, step = row_block(max(IC, OC))
    cdef floating one = 1
    if IC > 0:
        r0 = 0
        while r0 < M:
            mb = min(step, M - r0)
            if dx != NULL:
                # dx^T (IC, mb) += W^T(col-major (IC, OC)) . dout^T (OC, mb)
                gemm(c'N', c'N', IC, mb, OC, one, weight, IC, dout + r0 * OC, OC,
                     one, dx + r0 * IC, IC)
            if dweight != NULL:
                # dW^T (IC, OC) += x^T (IC, mb) . dout (mb, OC)
                gemm(c'N', c'T', IC, OC, mb, one, x + r0 * IC, IC, dout + r0 * OC, OC,
                     one, dweight, IC)
            r0 += mb
    if dbias != NULL:
        for r in range(M):
            for o in range(OC):
                dbias[o] += dout[r * OC + o]
