# cython: language_level=3
"""Dense layers over BLAS (scipy.linalg.cython_blas), callable without the GIL.

Size letters: M rows (= B*L), C input columns, OC output columns.

BLAS is column-major: a row-major (rows, cols) buffer is the column-major
(cols, rows) matrix with leading dimension cols. So the row-major product
out (M, OC) = inp (M, C) @ W (OC, C)^T is, column-major,
out^T (OC, M) = W^T (OC, C) . inp^T (C, M) = gemm('T', 'N', OC, M, C, W, C, inp, C, out, OC).

BLAS takes 32-bit ``int`` sizes: the products are split into row blocks so
that no size passed to BLAS exceeds INT_MAX (callers validate that C and OC
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


cdef void linear_forward(floating* out, const floating* inp, const floating* weight,
                         const floating* bias, idx_t M, idx_t C, idx_t OC) noexcept nogil:
    # out (M, OC) = inp (M, C) @ weight (OC, C)^T + bias (OC,)
    cdef idx_t r, o, r0, mb, step = row_block(max(C, OC))
    cdef floating beta = 0, one = 1
    if bias != NULL:
        for r in range(M):
            for o in range(OC):
                out[r * OC + o] = bias[o]
        beta = 1
    if C == 0:
        if bias == NULL:
            for r in range(M * OC):
                out[r] = 0
        return
    r0 = 0
    while r0 < M:
        mb = min(step, M - r0)
        gemm(c'T', c'N', OC, mb, C, one, weight, C, inp + r0 * C, C,
             beta, out + r0 * OC, OC)
        r0 += mb


cdef void linear_backward(floating* dinp, floating* dweight, floating* dbias,
                          const floating* dout, const floating* inp, const floating* weight,
                          idx_t M, idx_t C, idx_t OC) noexcept nogil:
    cdef idx_t r, o, r0, mb, step = row_block(max(C, OC))
    cdef floating one = 1
    if C > 0:
        r0 = 0
        while r0 < M:
            mb = min(step, M - r0)
            if dinp != NULL:
                # dinp^T (C, mb) += W^T(col-major (C, OC)) . dout^T (OC, mb)
                gemm(c'N', c'N', C, mb, OC, one, weight, C, dout + r0 * OC, OC,
                     one, dinp + r0 * C, C)
            if dweight != NULL:
                # dW^T (C, OC) += inp^T (C, mb) . dout (mb, OC)
                gemm(c'N', c'T', C, OC, mb, one, inp + r0 * C, C, dout + r0 * OC, OC,
                     one, dweight, C)
            r0 += mb
    if dbias != NULL:
        for r in range(M):
            for o in range(OC):
                dbias[o] += dout[r * OC + o]
