# cython: language_level=3
"""Dense layers over BLAS (scipy.linalg.cython_blas), callable without the GIL.

Size letters: M rows (= B*L), IC input columns, OC output columns.

Design: one thread pool. Each product runs in one OpenMP region of ``n_threads``
threads, every thread calling a single-threaded BLAS on its own slice of the output
(rows of the batch, or columns when the rows are few); the BLAS library's own thread
pool is held at one thread for the duration (csrc/mx_blas.h) and restored afterwards.
So the core has one team of threads whose idle members spin only briefly between
regions, instead of two teams taking the cores from each other, and ``n_threads`` bounds
the BLAS too. A slice never splits the reduction dimension, and the bias gradient sums
each column over the rows in order.

The float32 GEMM is the BLAS's sgemm, or mamba_ext's own (csrc/mx_sgemm.h, AVX-512)
where the CPU has AVX-512 and OpenBLAS runs a kernel set without it (set_gemm, "auto"):
on an AMD Zen 5 OpenBLAS falls back to its Haswell kernels at half its own AVX-512
speed, and the choice cannot be changed from inside a running process. On an AMD CPU
whose OpenBLAS runs its AVX-512 kernels (Zen 4), ours takes the weight gradients of at
least DW_OWN_MIN_IC input columns and OpenBLAS the rest: per kind of product, the faster
there.

Bitwise results for any thread count: slices split only BLAS's n dimension, at multiples
of SPLIT_N (the rows of the batch; the output columns of dW). OpenBLAS computes a column
of C the same way whatever n is, once slices start at multiples of its kernel's n-unroll
(12 for the Haswell kernels, which also serve AMD Zen 1-3 and, in OpenBLAS 0.3.30, Zen 5;
16 for SkylakeX, which serves Intel's AVX-512 CPUs and AMD Zen 4); a split of m
changes the bits except at its own blocking boundaries, which depend on the shape. The
exception is a forward of 2 .. 2*SPLIT_N - 1 rows (small-batch generation), where the
output columns (BLAS's m) are split for speed; one row (gemv) stays bitwise. OpenBLAS's
AVX-512 kernel sets (SkylakeX and later) also run products of at most 10^6 multiply-adds
through a separate small-matrix kernel that sums in another order, so every slice of a
split product holds more than that many (its boundaries at multiples of blas_unit rows or
columns): a slice never takes another kernel than the whole product would.

BLAS is column-major: a row-major (rows, cols) buffer is the column-major
(cols, rows) matrix with leading dimension cols. So the row-major product
out (M, OC) = x (M, IC) @ W (OC, IC)^T is, column-major,
out^T (OC, M) = W^T (OC, IC) . x^T (IC, M) = gemm('T', 'N', OC, M, IC, W, IC, x, IC, out, OC).

BLAS takes 32-bit ``int`` sizes: the products are split into row blocks so
that no size passed to BLAS exceeds INT_MAX (callers validate that IC and OC
fit; see ``_validate.check_count``).
"""
from cython.parallel cimport prange
from scipy.linalg.cython_blas cimport sgemm, dgemm, sgemv, dgemv
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.activations cimport mx_add_f, mx_add_d

cdef extern from "limits.h":
    const int INT_MAX

from mamba_ext.cpu.threads cimport mx_team

cdef extern from "csrc/mx_blas.h" nogil:
    const char* mx_blas_bind(const char* path) noexcept
    int mx_blas_threads() noexcept
    const char* mx_blas_corename() noexcept
    const char* mx_blas_config() noexcept
    void mx_blas_single_begin() noexcept
    void mx_blas_single_end() noexcept

cdef extern from "csrc/mx_sgemm.h" nogil:
    int mx_sgemm_supported() noexcept
    int mx_sgemm_cpu_amd() noexcept
    int mx_sgemm(char transa, char transb, idx_t m, idx_t n, idx_t k, float alpha,
                 const float* A, idx_t lda, const float* B, idx_t ldb, float beta,
                 float* C, idx_t ldc) noexcept
    int mx_sgemm_bias(char transa, char transb, idx_t m, idx_t n, idx_t k, float alpha,
                      const float* A, idx_t lda, const float* B, idx_t ldb, float beta,
                      float* C, idx_t ldc, const float* bias) noexcept

cdef enum:
    # multiply-adds per thread below which another thread costs more than it saves (a
    # region's wake-up is microseconds; 2^17 multiply-adds take ~5 us on one core)
    MIN_WORK_PER_THREAD = 1 << 17
    # slice boundaries along BLAS's m and n dimensions (module docstring): n at multiples
    # of every kernel n-unroll of OpenBLAS (4, 8, 12, 16, 24); m for few rows only
    SPLIT_M = 64
    SPLIT_N = 48
    # linear_backward forms dW^T in scratch and adds it transposed only below this many
    # output columns: a split of fewer OC leaves threads idle, while for more the strided
    # add costs more than it saves (docs/performance.md)
    DWT_MAX_OC = 4 * SPLIT_N
    # the weight gradients that "auto" may give mamba_ext's sgemm while the other products
    # stay on OpenBLAS's AVX-512 kernels: those of at least this many input columns (at
    # IC 256-1536 ours ran at 1.05-1.5x OpenBLAS's rate; at IC 16 at 0.7x, at 128 with OC
    # 64 at 0.9x: docs/performance.md)
    DW_OWN_MIN_IC = 256

# multiply-adds (m*n*k) up to which OpenBLAS's AVX-512 kernel sets (SkylakeX, Cooper Lake,
# Sapphire Rapids) take their small-matrix kernel (its *_small_kernel_permit_skylakex.c)
cdef long long BLAS_SMALL_GEMM = 1000000


# The thread-count controls of SciPy's BLAS, found once among the libraries that
# scipy.linalg.cython_blas (loaded by the cimport above) links: "openblas", "mkl", "blis"
# or "none".
import os as _os
import scipy.linalg.cython_blas as _cython_blas

BLAS_CONTROLS = mx_blas_bind(_os.fsencode(_cython_blas.__file__)).decode()


def blas_threads():
    """The thread count of SciPy's BLAS now (-1 if it has no control we know)."""
    return mx_blas_threads()


# Which float32 GEMM the products call: 1 = csrc/mx_sgemm.h (AVX-512), 0 = the BLAS's
# sgemm; own_sgemm for the forward and dX products, own_sgemm_dw for the weight gradients
# of at least DW_OWN_MIN_IC input columns (the others follow own_sgemm). "auto" takes ours for all of them where the CPU
# has AVX-512 and OpenBLAS runs a kernel set without it (its detection falls back to AVX2
# kernels on CPUs it does not know, e.g. AMD Zen 5: half its own AVX-512 speed there),
# and for those weight gradients on an AMD CPU whose OpenBLAS runs its AVX-512 kernels
# (Zen 4: there OpenBLAS's dW = x^T dout, a contraction over all M rows, ran at 0.75-0.9x
# of ours, its other products as fast as ours or faster; docs/performance.md, "Weight
# gradients on mamba_ext's sgemm"). float64 always goes to the BLAS.
GEMM_KINDS = ("auto", "blas", "avx512")
# OpenBLAS's kernel sets that use AVX-512 (openblas_get_corename, lower-cased); any
# other runs without it (the bench's BLAS line reads the same list)
AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids")
cdef int own_sgemm = 0
cdef int own_sgemm_dw = 0
_gemm_kind = "auto"


cdef bint auto_own_sgemm():
    # "auto": ours on a CPU with AVX-512 whose OpenBLAS runs a kernel set without it
    core = blas_corename().lower()      # "" unless the BLAS is OpenBLAS
    return bool(mx_sgemm_supported()) and core != "" and core not in AVX512_CORES


cdef bint auto_own_sgemm_dw():
    # "auto", weight gradients: ours for all products (above), or on an AMD CPU with
    # AVX-512 under OpenBLAS (faster on Zen 4; mixed on an Intel Xeon, which keeps the BLAS:
    # docs/performance.md)
    return auto_own_sgemm() or (bool(mx_sgemm_supported()) and bool(mx_sgemm_cpu_amd())
                                and blas_corename() != "")


def set_gemm(kind="auto"):
    """Choose the float32 GEMM of every product (process-wide; set it before calls, not
    while a product runs): "auto" (the default: per kind of product, the faster where
    measured; gemm_kernel says which), "blas" (SciPy's sgemm) or "avx512" (mamba_ext's,
    csrc/mx_sgemm.h; needs a CPU with AVX-512F). Returns the previous kind.
    The two differ in rounding (float32 sums in another order); every choice gives
    bitwise the same results for any thread count."""
    global own_sgemm, own_sgemm_dw, _gemm_kind
    if not isinstance(kind, str) or kind not in GEMM_KINDS:
        raise ValueError(f"kind must be one of {', '.join(GEMM_KINDS)}; got {kind!r}")
    if kind == "avx512" and not mx_sgemm_supported():
        raise ValueError('kind "avx512" needs an x86-64 CPU with AVX-512F (and a build with '
                         'GCC or Clang); this one has not')
    prev = _gemm_kind
    own_sgemm = 1 if kind == "avx512" or (kind == "auto" and auto_own_sgemm()) else 0
    own_sgemm_dw = 1 if kind == "avx512" or (kind == "auto" and auto_own_sgemm_dw()) else 0
    _gemm_kind = kind
    return prev


def gemm_kernel(weight_gradient=False):
    """The float32 GEMM that the forward and dX products call now (weight_gradient=True:
    the weight gradients of at least DW_OWN_MIN_IC input columns): "avx512" (mamba_ext's)
    or "blas"."""
    return "avx512" if (own_sgemm_dw if weight_gradient else own_sgemm) else "blas"


def blas_corename():
    """OpenBLAS's name for the kernel set it runs ("" for another BLAS)."""
    return mx_blas_corename().decode("ascii", "replace")


def blas_config():
    """OpenBLAS's description of its build, e.g. "OpenBLAS 0.3.30 DYNAMIC_ARCH NO_AFFINITY
    Haswell MAX_THREADS=64" ("" for another BLAS)."""
    return mx_blas_config().decode("ascii", "replace")


set_gemm("auto")


def product(x, weight, n_threads=None, out=None):
    """out (M, OC) = x (M, IC) @ weight (OC, IC)^T through the core's product (the GEMM
    ``gemm_kernel()`` names, on ``n_threads`` threads): what every linear layer runs.
    x, weight: C-contiguous 2-D arrays of one dtype, float32 or float64; out: None (a new
    array), or a writeable C-contiguous (M, OC) array of that dtype to write and return
    (a timing loop then measures the product, not the fresh pages of a new array)."""
    import numpy as np
    from mamba_ext._validate import check_n_threads
    cdef int nt = check_n_threads(n_threads)    # the limits every n_threads of the API has
    for name, a in (("x", x), ("weight", weight)):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name} must be a 2-D float32 or float64 numpy array; got "
                            f"{type(a).__name__} {getattr(a, 'dtype', '')} "
                            f"{getattr(a, 'shape', '')}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight must have one dtype; got {x.dtype} and {weight.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"weight must be (OC, {x.shape[1]}) for x of shape {x.shape}; got "
                         f"{weight.shape}")
    cdef idx_t M = x.shape[0], IC = x.shape[1], OC = weight.shape[0]
    if out is None:
        out = np.empty((M, OC), x.dtype)
    elif not isinstance(out, np.ndarray) or out.dtype != x.dtype or out.shape != (M, OC):
        raise TypeError(f"out must be None or a {x.dtype} numpy array of shape ({M}, {OC}); "
                        f"got {type(out).__name__} {getattr(out, 'dtype', '')} "
                        f"{getattr(out, 'shape', '')}")
    elif not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    elif np.shares_memory(out, x) or np.shares_memory(out, weight):
        raise ValueError("out must not overlap x or weight")
    cdef float[:, ::1] of, xf, wf
    cdef double[:, ::1] od, xd, wd
    if M == 0 or OC == 0:
        return out
    if IC == 0:
        out[...] = 0
        return out
    if x.dtype == np.float32:
        of, xf, wf = out, x, weight
        with nogil:
            linear_forward(&of[0, 0], &xf[0, 0], &wf[0, 0], <float*>NULL, M, IC, OC, nt)
    else:
        od, xd, wd = out, x, weight
        with nogil:
            linear_forward(&od[0, 0], &xd[0, 0], &wd[0, 0], <double*>NULL, M, IC, OC, nt)
    return out


cdef inline void gemm(char ta, char tb, idx_t m, idx_t n, idx_t k,
                      floating alpha, const floating* a, idx_t lda,
                      const floating* b, idx_t ldb, floating beta,
                      floating* c, idx_t ldc) noexcept nogil:
    """Column-major C (m, n) = alpha op(A) op(B) + beta C; sizes < INT_MAX."""
    gemm_on(own_sgemm, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)


cdef inline void gemm_on(int own, char ta, char tb, idx_t m, idx_t n, idx_t k,
                         floating alpha, const floating* a, idx_t lda,
                         const floating* b, idx_t ldb, floating beta,
                         floating* c, idx_t ldc) noexcept nogil:
    # gemm on mamba_ext's sgemm where own (float32), else on the BLAS
    cdef int im = <int>m, jn = <int>n, kk = <int>k
    cdef int ia = <int>lda, ib = <int>ldb, ic = <int>ldc
    if m == 0 or n == 0:
        return
    if floating is float:
        if own and mx_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0:
            return     # (-1: no workspace for its packed panels; the BLAS then)
        sgemm(&ta, &tb, &im, &jn, &kk, &alpha, <float*>a, &ia, <float*>b, &ib, &beta, c, &ic)
    else:
        dgemm(&ta, &tb, &im, &jn, &kk, &alpha, <double*>a, &ia, <double*>b, &ib, &beta, c, &ic)


cdef inline idx_t row_block(idx_t width) noexcept nogil:
    # Rows per BLAS call such that rows and rows*width stay below INT_MAX.
    cdef idx_t w = width if width > 0 else 1
    return max(<idx_t>1, min(<idx_t>INT_MAX, <idx_t>INT_MAX // w))


cdef inline int team_size(idx_t work, idx_t parts, int n_threads) noexcept nogil:
    # threads for `work` multiply-adds split into at most `parts` slices
    return mx_team(n_threads, work, MIN_WORK_PER_THREAD, parts)


cdef inline idx_t blas_unit(idx_t per_slot) noexcept nogil:
    # rows (or columns) of a slice unit of a product whose rows (columns) cost per_slot
    # multiply-adds each: a multiple of SPLIT_N holding more than BLAS_SMALL_GEMM of them
    cdef idx_t need = BLAS_SMALL_GEMM // max(per_slot, <idx_t>1) + 1
    return (need + SPLIT_N - 1) // SPLIT_N * SPLIT_N


cdef inline idx_t cut(idx_t n, idx_t align, idx_t b) noexcept nogil:
    # slice boundary b of range(n), or n where fewer than align elements would follow it
    return b if b == 0 or b <= n - align else n


cdef inline void part(idx_t n, int nt, int t, idx_t align, idx_t* lo, idx_t* hi) noexcept nogil:
    # slice t of nt of range(n): [lo, hi), boundaries at multiples of align (cut); the
    # ceil(n / align) units dealt out as evenly as they go, so a non-empty slice has at
    # least align elements (or all n)
    cdef idx_t units = (n + align - 1) // align
    lo[0] = cut(n, align, min(n, (t * units // nt) * align))
    hi[0] = cut(n, align, min(n, ((t + 1) * units // nt) * align))


cdef inline idx_t dx_start(idx_t M, idx_t wn, idx_t row_unit, idx_t col_unit, int nt,
                           int t) noexcept nogil:
    # first dx row of thread t when the threads also share the dW product's wn split
    # columns (part(wn, nt, t, col_unit)): a dx row and a dW column cost IC*OC and
    # M*IC*OC/wn multiply-adds, so thread t starts where the rows and columns before it
    # hold t/nt of the region's 2*M*IC*OC, at a multiple of row_unit (dx rows are BLAS's
    # n: any such split is bitwise), never before an earlier thread's start, and at M
    # where fewer than row_unit rows would follow (no slice below blas_unit's size)
    cdef idx_t s, start = 0, lo, hi, raw
    if t == 0:
        return 0
    if t >= nt:
        return M
    for s in range(1, t + 1):
        part(wn, nt, s, col_unit, &lo, &hi)
        raw = (2 * M * s) // nt - (M * lo) // wn
        raw = (raw + row_unit // 2) // row_unit * row_unit
        start = min(M, max(start, raw))
    return cut(M, row_unit, start)


cdef void forward_rows(floating* out, const floating* x, const floating* weight,
                       const floating* bias, idx_t r0, idx_t r1, idx_t IC,
                       idx_t OC) noexcept nogil:
    # out[r0:r1] (rows, OC) = x[r0:r1] (rows, IC) @ weight (OC, IC)^T + bias
    cdef idx_t r, mb, step = row_block(max(IC, OC))
    cdef floating beta = 1 if bias != NULL else 0, one = 1
    cdef bint done
    if IC == 0:                         # out = the bias rows, or zeros
        for r in range(r0, r1):
            if bias != NULL:
                memcpy(out + r * OC, bias, OC * sizeof(floating))
            else:
                memset(out + r * OC, 0, OC * sizeof(floating))
        return
    while r0 < r1:
        mb = min(step, r1 - r0)
        # our sgemm adds the bias in its epilogue (the bits of the bias copied into the
        # rows first and beta 1, which the BLAS, or ours without workspace, does instead)
        done = False
        if floating is float:
            done = own_sgemm and bias != NULL and mx_sgemm_bias(
                c'T', c'N', OC, mb, IC, one, weight, IC, x + r0 * IC, IC, 0, out + r0 * OC,
                OC, bias) == 0
        if not done:
            if bias != NULL:
                for r in range(r0, r0 + mb):
                    memcpy(out + r * OC, bias, OC * sizeof(floating))
            gemm(c'T', c'N', OC, mb, IC, one, weight, IC, x + r0 * IC, IC,
                 beta, out + r0 * OC, OC)
        r0 += mb


cdef void forward_cols(floating* out, const floating* x, const floating* weight,
                       const floating* bias, idx_t M, idx_t IC, idx_t OC, idx_t o0,
                       idx_t o1) noexcept nogil:
    # out[:, o0:o1] (M, cols) = x (M, IC) @ weight[o0:o1] (cols, IC)^T + bias[o0:o1];
    # M < INT_MAX / IC (few rows: the column split is chosen only then)
    cdef idx_t r, o, n = o1 - o0
    cdef floating beta = 0, one = 1
    cdef char t = c'T'
    cdef int m_, n_, lda, inc = 1
    if n <= 0:
        return
    if bias != NULL:
        for r in range(M):
            memcpy(out + r * OC + o0, bias + o0, n * sizeof(floating))
        beta = 1
    if IC == 0:
        if bias == NULL:
            for r in range(M):
                for o in range(o0, o1):
                    out[r * OC + o] = 0
        return
    if M == 1:
        # out (cols,) = w_cm^T x: a gemm with one column is not always forwarded to gemv by
        # the BLAS, and gemv is the memory-bound kernel
        m_, n_, lda = <int>IC, <int>n, <int>IC
        if floating is float:
            sgemv(&t, &m_, &n_, &one, <float*>weight + o0 * IC, &lda, <float*>x, &inc,
                  &beta, out + o0, &inc)
        else:
            dgemv(&t, &m_, &n_, &one, <double*>weight + o0 * IC, &lda, <double*>x, &inc,
                  &beta, out + o0, &inc)
        return
    gemm(c'T', c'N', n, M, IC, one, weight + o0 * IC, IC, x, IC, beta, out + o0, OC)


cdef inline void dx_rows(idx_t M, idx_t wn, idx_t row_unit, idx_t col_unit, bint with_dw,
                         int nt, int t, idx_t* lo, idx_t* hi) noexcept nogil:
    # thread t's dx rows [lo, hi) in linear_backward: balanced against its dW columns
    # (wn of them) when dW is formed too, else an even split
    if with_dw:
        lo[0] = dx_start(M, wn, row_unit, col_unit, nt, t)
        hi[0] = dx_start(M, wn, row_unit, col_unit, nt, t + 1)
    else:
        part(M, nt, t, row_unit, lo, hi)


cdef void forward_slice(floating* out, const floating* x, const floating* weight,
                        const floating* bias, idx_t M, idx_t IC, idx_t OC, bint by_rows,
                        idx_t unit, int nt, int t) noexcept nogil:
    # thread t of nt: its rows, or its columns, of out (boundaries at multiples of unit)
    cdef idx_t lo, hi
    part(M if by_rows else OC, nt, t, unit, &lo, &hi)
    if by_rows:
        forward_rows(out, x, weight, bias, lo, hi, IC, OC)
    else:
        forward_cols(out, x, weight, bias, M, IC, OC, lo, hi)


cdef void linear_forward(floating* out, const floating* x, const floating* weight,
                         const floating* bias, idx_t M, idx_t IC, idx_t OC,
                         int n_threads) noexcept nogil:
    # out (M, OC) = x (M, IC) @ weight (OC, IC)^T + bias (OC,); slices of rows, or of
    # columns when the rows are fewer than the columns and 2*SPLIT_N (then
    # M * max(IC, OC) fits an int)
    cdef int nt, t
    cdef bint by_rows = M >= min(OC, <idx_t>(2 * SPLIT_N)) or M * max(IC, OC) >= <idx_t>INT_MAX
    cdef idx_t unit = blas_unit(IC * OC) if by_rows else SPLIT_M
    nt = team_size(M * max(IC, <idx_t>1) * OC, M // unit if by_rows else OC, n_threads)
    mx_blas_single_begin()
    for t in prange(nt, schedule='static', num_threads=nt):
        forward_slice(out, x, weight, bias, M, IC, OC, by_rows, unit, nt, t)
    mx_blas_single_end()


cdef void backward_slice(floating* dx, floating* dweight, floating* dwt, floating* dbias,
                         const floating* dout, const floating* x, const floating* weight,
                         idx_t M, idx_t IC, idx_t OC, bint by_ic, idx_t row_unit,
                         idx_t col_unit, floating dx_beta, int nt, int t) noexcept nogil:
    # thread t of nt: dx rows, dweight rows of OC, or with by_ic its columns of IC (through
    # dwt on the BLAS, directly on our sgemm where dwt is NULL), dbias columns (BLAS's n
    # only: the module docstring); see backward.
    # dx rows and dW's split columns in units of row_unit, col_unit;
    # dx_beta 1: dx added to, 0: dx written (not read)
    cdef idx_t wn = IC if by_ic else OC
    cdef idx_t r, o, i, r0, mb, lo, hi, step = row_block(max(IC, OC))
    cdef floating one = 1, beta
    if IC > 0 and dx != NULL:
        dx_rows(M, wn, row_unit, col_unit, dweight != NULL, nt, t, &lo, &hi)
        r0 = lo
        while r0 < hi:
            mb = min(step, hi - r0)
            # dx^T (IC, mb) (+)= W^T(col-major (IC, OC)) . dout^T (OC, mb)
            gemm(c'N', c'N', IC, mb, OC, one, weight, IC, dout + r0 * OC, OC,
                 dx_beta, dx + r0 * IC, IC)
            r0 += mb
    if IC > 0 and dweight != NULL and by_ic and dwt == NULL:
        part(IC, nt, t, col_unit, &lo, &hi)
        r0 = 0
        while r0 < M and hi > lo:
            mb = min(step, M - r0)
            # dW^T[lo:hi] (cols, OC) += x[:, lo:hi]^T (cols, mb) . dout (mb, OC): our
            # sgemm, whose sums do not depend on a split of its m
            gemm_on(1, c'N', c'T', hi - lo, OC, mb, one, x + r0 * IC + lo, IC,
                    dout + r0 * OC, OC, one, dweight + lo, IC)
            r0 += mb
    elif IC > 0 and dweight != NULL and by_ic:
        part(IC, nt, t, col_unit, &lo, &hi)
        r0 = 0
        beta = 0
        while r0 < M and hi > lo:
            mb = min(step, M - r0)
            # dwt[lo:hi] (cols, OC) = sum over the row blocks of x[:, lo:hi]^T . dout:
            # column-major dW (OC, cols) = dout^T (OC, mb) . x[:, lo:hi] (mb, cols)
            gemm(c'N', c'T', OC, hi - lo, mb, one, dout + r0 * OC, OC, x + r0 * IC + lo, IC,
                 beta, dwt + lo * OC, OC)
            beta = 1
            r0 += mb
        for o in range(OC):
            for i in range(lo, hi):
                dweight[o * IC + i] += dwt[i * OC + o]
    elif IC > 0 and dweight != NULL:
        part(OC, nt, t, col_unit, &lo, &hi)
        r0 = 0
        while r0 < M and hi > lo:
            mb = min(step, M - r0)
            # dW^T[:, lo:hi] (IC, cols) += x^T (IC, mb) . dout[:, lo:hi] (mb, cols)
            gemm_on(own_sgemm_dw if IC >= DW_OWN_MIN_IC else own_sgemm, c'N', c'T', IC,
                    hi - lo, mb, one, x + r0 * IC, IC, dout + r0 * OC + lo, OC, one,
                    dweight + lo * IC, IC)
            r0 += mb
    if dbias != NULL:
        part(OC, nt, t, 16, &lo, &hi)       # our own loop: any split is bitwise
        if hi > lo:
            for r in range(M):      # each column summed over the rows in order
                if floating is float:
                    mx_add_f(dbias + lo, dout + r * OC + lo, hi - lo)
                else:
                    mx_add_d(dbias + lo, dout + r * OC + lo, hi - lo)


cdef int backward(floating* dx, floating dx_beta, floating* dweight, floating* dbias,
                  const floating* dout, const floating* x, const floating* weight,
                  idx_t M, idx_t IC, idx_t OC, int n_threads) noexcept nogil:
    # dx (M, IC) = dx_beta * dx + dout (M, OC) @ weight (OC, IC) (dx_beta 1 or 0: dx not
    # read); dweight (OC, IC) += dout^T @ x; dbias (OC,) += column sums of dout; one
    # region, each thread on its slices.
    # dweight with few rows and more columns (OC < IC and OC < DWT_MAX_OC, e.g. x_proj) is
    # split by its IC columns (a split of OC would leave threads idle): on our sgemm
    # directly (IC is its m, and its sums do not depend on a split of m), on the BLAS,
    # which is bitwise only under a split of its n, formed transposed in scratch dwt
    # (IC, OC) and added transposed. The choices depend on the shape and the GEMM only,
    # so results stay bitwise for any n_threads.
    # Returns 0, or -1 when that scratch cannot be allocated (nothing written then).
    cdef int nt, t
    cdef floating* dwt = NULL
    cdef bint by_ic = dweight != NULL and IC > 0 and OC < IC and OC < DWT_MAX_OC and M > 0
    cdef bint own_dw = floating is float and (own_sgemm_dw if IC >= DW_OWN_MIN_IC else own_sgemm)
    if by_ic and not own_dw:       # (M 0: nothing to add)
        dwt = <floating*>malloc(IC * OC * sizeof(floating))
        if dwt == NULL:
            return -1
    # slices: dx rows and dW's wn split columns (backward_slice), in units of blas_unit
    cdef idx_t wn = IC if by_ic else OC
    cdef idx_t row_unit = blas_unit(IC * OC)
    cdef idx_t col_unit = blas_unit(M * IC * OC // max(wn, <idx_t>1))
    nt = team_size(M * max(IC, <idx_t>1) * OC, max(M // row_unit, wn // col_unit, <idx_t>1),
                   n_threads)
    mx_blas_single_begin()
    for t in prange(nt, schedule='static', num_threads=nt):
        backward_slice(dx, dweight, dwt, dbias, dout, x, weight, M, IC, OC, by_ic, row_unit,
                       col_unit, dx_beta, nt, t)
    mx_blas_single_end()
    free(dwt)
    return 0


cdef int linear_backward(floating* dx, floating* dweight, floating* dbias,
                         const floating* dout, const floating* x, const floating* weight,
                         idx_t M, idx_t IC, idx_t OC, int n_threads) noexcept nogil:
    return backward(dx, 1, dweight, dbias, dout, x, weight, M, IC, OC, n_threads)


cdef int linear_backward_set(floating* dx, floating* dweight, floating* dbias,
                             const floating* dout, const floating* x, const floating* weight,
                             idx_t M, idx_t IC, idx_t OC, int n_threads) noexcept nogil:
    return backward(dx, 0, dweight, dbias, dout, x, weight, M, IC, OC, n_threads)
