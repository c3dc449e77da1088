# distutils: extra_compile_args = -Werror=incompatible-pointer-types
# cython: language_level=3
"""C API of mamba_ext: a versioned, append-only table of kernel entry points.

The table type is declared in ``include/mamba_ext/mamba_ext.h`` (shipped in the
wheel; ``mamba_ext.get_include()``); this module fills one static instance and
exports a pointer to it as the capsule ``mamba_ext.cpu.capi._C_API``, the way
numpy exports its C API. C code gets it with ``import_mamba_ext()``.

Every entry is a thin wrapper over the Cython kernels (block.pxd, model.pxd,
adamw.pxd, scan.pxd): it checks the pointers and sizes it is given (so a NULL or a
zero size returns MAMBA_EXT_ERR_ARG instead of crashing), copies the header's
size structs into the kernels' own structs (so the kernels' structs may grow
without changing the C ABI), and maps the status codes.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, M = B*L, V vocab size.
"""
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t

from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.block cimport (mamba_dims, MAMBA_NPARAMS, block_cache_len,
                               block_forward, block_backward)
from mamba_ext.cpu.model cimport (model_dims, model_loss_and_grads, MODEL_OK,
                               MODEL_ERR_NOMEM, MODEL_ERR_TOKEN, MODEL_ERR_EMPTY)
from mamba_ext.cpu.adamw cimport adamw_step
from mamba_ext.cpu.scan cimport scan_nchunks, scan_forward, scan_backward

# The header is the single definition of the table; compiling this file
# against it makes the C compiler check every entry's type below.
cdef extern from *:
    """
    #define MAMBA_EXT_NO_IMPORT
    #include "mamba_ext/mamba_ext.h"
    """
    int MAMBA_EXT_ABI_VERSION
    int MAMBA_EXT_API_COUNT
    int MAMBA_EXT_NPARAMS
    int MAMBA_EXT_OK, MAMBA_EXT_ERR_NOMEM, MAMBA_EXT_ERR_TOKEN
    int MAMBA_EXT_ERR_EMPTY, MAMBA_EXT_ERR_ARG

    ctypedef struct mamba_ext_dims:
        Py_ssize_t B, L, Dm, D, N, K, R
        double eps
        int discretization

    ctypedef struct mamba_ext_model_dims:
        Py_ssize_t V
        Py_ssize_t n_layers
        mamba_ext_dims block

    ctypedef struct mamba_ext_api:
        int abi_version
        int count
        Py_ssize_t (*block_cache_len)(const mamba_ext_dims*) noexcept nogil
        int (*block_forward_f32)(float*, float*, const float*, const float* const*,
                                 const mamba_ext_dims*, int) noexcept nogil
        int (*block_backward_f32)(float*, float* const*, const float*, const float*,
                                  const float* const*, const mamba_ext_dims*, int) noexcept nogil
        int (*block_forward_f64)(double*, double*, const double*, const double* const*,
                                 const mamba_ext_dims*, int) noexcept nogil
        int (*block_backward_f64)(double*, double* const*, const double*, const double*,
                                  const double* const*, const mamba_ext_dims*, int) noexcept nogil
        int (*model_loss_and_grads_f32)(double*, float*, float*, float*, float* const*,
                                        const int64_t*, const int64_t*, const float*,
                                        const float*, const float*, const float* const*,
                                        const mamba_ext_model_dims*, double, int, int) noexcept nogil
        int (*model_loss_and_grads_f64)(double*, double*, double*, double*, double* const*,
                                        const int64_t*, const int64_t*, const double*,
                                        const double*, const double*, const double* const*,
                                        const mamba_ext_model_dims*, double, int, int) noexcept nogil
        Py_ssize_t (*adamw_step_f32)(float*, float*, float*, const float*, Py_ssize_t,
                                     double, double, double, double, double, double,
                                     long long, double, int) noexcept nogil
        Py_ssize_t (*adamw_step_f64)(double*, double*, double*, const double*, Py_ssize_t,
                                     double, double, double, double, double, double,
                                     long long, double, int) noexcept nogil
        Py_ssize_t (*scan_hstates_len)(Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t) noexcept nogil
        int (*scan_forward_f32)(float*, float*, const float*, const float*, const float*,
                                const float*, Py_ssize_t, const float*, const float*,
                                Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                int, int) noexcept nogil
        int (*scan_backward_f32)(float*, float*, float*, float*, float*, float*,
                                 const float*, const float*, const float*, const float*,
                                 const float*, const float*, Py_ssize_t, const float*,
                                 const float*, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                 int, int) noexcept nogil
        int (*scan_forward_f64)(double*, double*, const double*, const double*, const double*,
                                const double*, Py_ssize_t, const double*, const double*,
                                Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                int, int) noexcept nogil
        int (*scan_backward_f64)(double*, double*, double*, double*, double*, double*,
                                 const double*, const double*, const double*, const double*,
                                 const double*, const double*, Py_ssize_t, const double*,
                                 const double*, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                 int, int) noexcept nogil


# ---------------------------------------------------------------- checks

cdef bint _to_dims(mamba_dims* out, const mamba_ext_dims* e) noexcept nogil:
    """Copy the header's dims into the kernels' struct; False if unusable."""
    if e == NULL:
        return False
    if e.B < 1 or e.L < 1 or e.Dm < 1 or e.D < 1 or e.N < 1 or e.K < 1 or e.R < 1:
        return False
    if not (e.eps >= 0.0 and e.eps < 1e300):      # also rejects NaN
        return False
    if e.discretization != 0 and e.discretization != 1:
        return False
    out.B = e.B
    out.L = e.L
    out.Dm = e.Dm
    out.D = e.D
    out.N = e.N
    out.K = e.K
    out.R = e.R
    out.eps = e.eps
    out.discretization = e.discretization
    return True


cdef bint _all_set(const void* const* p, idx_t n) noexcept nogil:
    """True if p and its n pointers are all non-NULL."""
    cdef idx_t i
    if p == NULL:
        return False
    for i in range(n):
        if p[i] == NULL:
            return False
    return True


# ---------------------------------------------------------------- block

cdef Py_ssize_t _block_cache_len(const mamba_ext_dims* e) noexcept nogil:
    cdef mamba_dims d
    if not _to_dims(&d, e):
        return 0
    return block_cache_len(&d)


cdef int _block_forward(floating* out, floating* cache, const floating* x,
                        const floating* const* params, const mamba_ext_dims* e,
                        int n_threads) noexcept nogil:
    # out (B, L, Dm), cache (block_cache_len), x (B, L, Dm), params: 13 pointers
    cdef mamba_dims d
    if (not _to_dims(&d, e) or n_threads < 1 or out == NULL or cache == NULL
            or x == NULL or not _all_set(<const void* const*>params, MAMBA_NPARAMS)):
        return MAMBA_EXT_ERR_ARG
    if block_forward(out, cache, x, <const floating**>params, &d, n_threads) != 0:
        return MAMBA_EXT_ERR_NOMEM
    return MAMBA_EXT_OK


cdef int _block_backward(floating* dx, floating* const* grads, const floating* dout,
                         const floating* cache, const floating* const* params,
                         const mamba_ext_dims* e, int n_threads) noexcept nogil:
    # dx (B, L, Dm) +=, grads[i] (shape of params[i]) +=, dout (B, L, Dm), cache read
    cdef mamba_dims d
    if (not _to_dims(&d, e) or n_threads < 1 or dx == NULL or dout == NULL
            or cache == NULL or not _all_set(<const void* const*>grads, MAMBA_NPARAMS)
            or not _all_set(<const void* const*>params, MAMBA_NPARAMS)):
        return MAMBA_EXT_ERR_ARG
    if block_backward(dx, <floating**>grads, dout, cache, <const floating**>params,
                      &d, n_threads) != 0:
        return MAMBA_EXT_ERR_NOMEM
    return MAMBA_EXT_OK


# ---------------------------------------------------------------- model

cdef int _model_loss_and_grads(double* loss, floating* g_embedding, floating* g_final_norm,
                               floating* g_lm_head_bias, floating* const* g_layer_params,
                               const int64_t* tokens, const int64_t* targets,
                               const floating* embedding, const floating* final_norm,
                               const floating* lm_head_bias,
                               const floating* const* layer_params,
                               const mamba_ext_model_dims* e, double loss_scale,
                               int checkpointing, int n_threads) noexcept nogil:
    # tokens, targets (B, L) int64; embedding (V, Dm); final_norm (Dm,);
    # lm_head_bias (V,); layer_params / g_layer_params: n_layers * 13 pointers
    cdef model_dims d
    cdef int r
    if e == NULL or e.V < 1 or e.n_layers < 0 or not _to_dims(&d.block, &e.block):
        return MAMBA_EXT_ERR_ARG
    d.V = e.V
    d.n_layers = e.n_layers
    cdef idx_t n_ptr = e.n_layers * MAMBA_NPARAMS
    if (n_threads < 1 or not (loss_scale == loss_scale) or loss == NULL
            or g_embedding == NULL or g_final_norm == NULL or g_lm_head_bias == NULL
            or tokens == NULL or targets == NULL or embedding == NULL
            or final_norm == NULL or lm_head_bias == NULL
            or (n_ptr > 0 and not (_all_set(<const void* const*>g_layer_params, n_ptr)
                                   and _all_set(<const void* const*>layer_params, n_ptr)))):
        return MAMBA_EXT_ERR_ARG
    r = model_loss_and_grads(loss, g_embedding, g_final_norm, g_lm_head_bias,
                             <floating**>g_layer_params, tokens, targets, embedding,
                             final_norm, lm_head_bias, <const floating**>layer_params,
                             &d, loss_scale, checkpointing, n_threads)
    if r == MODEL_OK:
        return MAMBA_EXT_OK
    if r == MODEL_ERR_TOKEN:
        return MAMBA_EXT_ERR_TOKEN
    if r == MODEL_ERR_EMPTY:
        return MAMBA_EXT_ERR_EMPTY
    return MAMBA_EXT_ERR_NOMEM


# ---------------------------------------------------------------- AdamW

cdef Py_ssize_t _adamw_step(floating* w, floating* m, floating* v, const floating* g,
                            Py_ssize_t n, double lr, double beta1, double beta2,
                            double eps, double weight_decay, double max_delta,
                            long long step, double grad_scale, int n_threads) noexcept nogil:
    # w, m, v (n,) updated in place; g (n,) read. Returns the number of skipped
    # (non-finite) elements, or -MAMBA_EXT_ERR_ARG.
    if (n < 0 or step < 1 or n_threads < 1
            or (n > 0 and (w == NULL or m == NULL or v == NULL or g == NULL))):
        return -MAMBA_EXT_ERR_ARG
    return adamw_step(w, m, v, g, n, lr, beta1, beta2, eps, weight_decay, max_delta,
                      step, grad_scale, n_threads)


# ---------------------------------------------------------------- scan

cdef Py_ssize_t _scan_hstates_len(Py_ssize_t B, Py_ssize_t L, Py_ssize_t D,
                                  Py_ssize_t N) noexcept nogil:
    if B < 1 or L < 1 or D < 1 or N < 1:
        return 0
    return B * scan_nchunks(L) * D * N          # hstate (B, C, D, N)


cdef inline bint _scan_args_ok(Py_ssize_t ld_bc, Py_ssize_t B, Py_ssize_t L, Py_ssize_t D,
                               Py_ssize_t N, int discretization,
                               int n_threads) noexcept nogil:
    return (B >= 1 and L >= 1 and D >= 1 and N >= 1 and ld_bc >= N and n_threads >= 1
            and (discretization == 0 or discretization == 1))


cdef int _scan_forward(floating* y, floating* hstate, const floating* u,
                       const floating* delta, const floating* Bs, const floating* Cs,
                       Py_ssize_t ld_bc, const floating* A_log, const floating* D_vec,
                       Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N,
                       int discretization, int n_threads) noexcept nogil:
    # y (B, L, D), hstate (B, C, D, N) written; u, delta (B, L, D);
    # Bs, Cs (B*L rows, ld_bc apart); A_log (D, N); D_vec (D,)
    if (not _scan_args_ok(ld_bc, B, L, D, N, discretization, n_threads)
            or y == NULL or hstate == NULL or u == NULL or delta == NULL or Bs == NULL
            or Cs == NULL or A_log == NULL or D_vec == NULL):
        return MAMBA_EXT_ERR_ARG
    if scan_forward(y, hstate, u, delta, Bs, Cs, ld_bc, A_log, D_vec, B, L, D, N,
                    discretization, n_threads) != 0:
        return MAMBA_EXT_ERR_NOMEM
    return MAMBA_EXT_OK


cdef int _scan_backward(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                        floating* dA_log, floating* dD_vec, const floating* dy,
                        const floating* hstate, const floating* u, const floating* delta,
                        const floating* Bs, const floating* Cs, Py_ssize_t ld_bc,
                        const floating* A_log, const floating* D_vec,
                        Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N,
                        int discretization, int n_threads) noexcept nogil:
    # gradients += (shapes of the forward's inputs); dy (B, L, D), hstate read
    if (not _scan_args_ok(ld_bc, B, L, D, N, discretization, n_threads)
            or du == NULL or ddelta == NULL or dBs == NULL or dCs == NULL
            or dA_log == NULL or dD_vec == NULL or dy == NULL or hstate == NULL
            or u == NULL or delta == NULL or Bs == NULL or Cs == NULL or A_log == NULL
            or D_vec == NULL):
        return MAMBA_EXT_ERR_ARG
    if scan_backward(du, ddelta, dBs, dCs, dA_log, dD_vec, dy, hstate, u, delta, Bs, Cs,
                     ld_bc, A_log, D_vec, B, L, D, N, discretization, n_threads) != 0:
        return MAMBA_EXT_ERR_NOMEM
    return MAMBA_EXT_OK


# ---------------------------------------------------------------- the table

cdef mamba_ext_api _table
_table.abi_version = MAMBA_EXT_ABI_VERSION
_table.count = MAMBA_EXT_API_COUNT
_table.block_cache_len = _block_cache_len
_table.block_forward_f32 = _block_forward[float]
_table.block_backward_f32 = _block_backward[float]
_table.block_forward_f64 = _block_forward[double]
_table.block_backward_f64 = _block_backward[double]
_table.model_loss_and_grads_f32 = _model_loss_and_grads[float]
_table.model_loss_and_grads_f64 = _model_loss_and_grads[double]
_table.adamw_step_f32 = _adamw_step[float]
_table.adamw_step_f64 = _adamw_step[double]
_table.scan_hstates_len = _scan_hstates_len
_table.scan_forward_f32 = _scan_forward[float]
_table.scan_backward_f32 = _scan_backward[float]
_table.scan_forward_f64 = _scan_forward[double]
_table.scan_backward_f64 = _scan_backward[double]

_C_API = PyCapsule_New(<void*>&_table, b"mamba_ext.cpu.capi._C_API", NULL)

ABI_VERSION = MAMBA_EXT_ABI_VERSION
API_COUNT = MAMBA_EXT_API_COUNT


def abi_version():
    """ABI version of the exported table (``MAMBA_EXT_ABI_VERSION``)."""
    return _table.abi_version


def api_count():
    """Number of function pointers in the exported table."""
    return _table.count
