/*
 * mamba_ext C API: call the Mamba-1 kernels of an installed mamba_ext from C.
 *
 * Build:  cc -I"$(python -c 'import mamba_ext; print(mamba_ext.get_include())')" ...
 *         #include <mamba_ext/mamba_ext.h>
 * Use:    in the module init function (with the GIL held) call
 *             if (import_mamba_ext() < 0) return NULL;
 *         then call through the table, from any thread, without the GIL:
 *             mamba_ext_API->block_forward_f32(out, cache, x, params, &dims, 1);
 *
 * The table is exported by the extension module mamba_ext.cpu.capi as the capsule
 * `mamba_ext.cpu.capi._C_API`. It is versioned and APPEND-ONLY: entries are never
 * removed, reordered or changed; new entries are added at the end and raise
 * `count`. MAMBA_EXT_ABI_VERSION changes only for an incompatible change (then
 * import_mamba_ext() refuses with a clear ImportError instead of crashing).
 * A table with a larger `count` than this header knows is compatible.
 *
 * Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
 * R dtRank, P = R + 2N, M = B*L (rows, row r = b*L + t), V vocab size.
 *
 * Buffers: every array is a C-contiguous, row-major buffer of float (the *_f32
 * entries) or double (the *_f64 entries) with the shape written next to it;
 * token ids are int64. Parameters of one block are passed as an array of
 * MAMBA_EXT_NPARAMS = 13 pointers in the order of the MAMBA_EXT_P_* enum (the
 * order of mamba_ext.BLOCK_PARAM_NAMES), shapes in the enum's comments.
 *
 * Ownership: the CALLER allocates and frees every buffer: outputs, gradients
 * and the block forward cache. The cache holds block_cache_len(&dims)
 * elements of the entry's float type (the same count for f32 and f64); it is
 * written by block_forward_* and read by block_backward_* with the same
 * params and dims, and must not be modified in between. The library keeps no
 * pointer after a call returns. Only internal scratch is allocated (and freed)
 * inside a call; the model entry allocates its own workspace the same way.
 *
 * Gradients ACCUMULATE (+=): zero them first for a plain gradient.
 * Return value of the int entries: MAMBA_EXT_OK (0) or an error code below.
 * Arguments are checked first (NULL pointers, sizes < 1, bad options): on
 * MAMBA_EXT_ERR_ARG nothing has been read or written. Buffer LENGTHS cannot be
 * checked through a pointer: they are the caller's responsibility.
 * n_threads: OpenMP threads for this call (>= 1; builds without OpenMP run
 * single-threaded whatever is asked).
 */
#ifndef MAMBA_EXT_MAMBA_EXT_H
#define MAMBA_EXT_MAMBA_EXT_H

#include <Python.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MAMBA_EXT_ABI_VERSION 2
/* Number of function pointers in the table this header declares. */
#define MAMBA_EXT_API_COUNT 14
#define MAMBA_EXT_CAPSULE_NAME "mamba_ext.cpu.capi._C_API"

#define MAMBA_EXT_NPARAMS 13
enum {                            /* index into the 13-pointer parameter arrays */
    MAMBA_EXT_P_wInProj = 0,      /* (2D, Dm) */
    MAMBA_EXT_P_bInProj = 1,      /* (2D,) */
    MAMBA_EXT_P_wConv = 2,        /* (D, K)   tap k multiplies x[t-k] */
    MAMBA_EXT_P_bConv = 3,        /* (D,) */
    MAMBA_EXT_P_wXProj = 4,       /* (P, D) */
    MAMBA_EXT_P_bXProj = 5,       /* (P,) */
    MAMBA_EXT_P_wDtProj = 6,      /* (D, R) */
    MAMBA_EXT_P_bDtProj = 7,      /* (D,) */
    MAMBA_EXT_P_A_log = 8,        /* (D, N) */
    MAMBA_EXT_P_D_vec = 9,        /* (D,) */
    MAMBA_EXT_P_wOutProj = 10,    /* (Dm, D) */
    MAMBA_EXT_P_bOutProj = 11,    /* (Dm,) */
    MAMBA_EXT_P_normWeight = 12   /* (Dm,) */
};

enum {                            /* return codes of the int entries */
    MAMBA_EXT_OK = 0,
    MAMBA_EXT_ERR_NOMEM = 1,      /* internal scratch allocation failed */
    MAMBA_EXT_ERR_TOKEN = 2,      /* model: a token or target id outside [0, V) */
    MAMBA_EXT_ERR_EMPTY = 3,      /* model: loss over zero positions */
    MAMBA_EXT_ERR_ARG = 4         /* NULL pointer, size < 1 or bad option */
};

/* Sizes of one block; every size >= 1. */
typedef struct mamba_ext_dims {
    Py_ssize_t B, L, Dm, D, N, K, R;
    double eps;           /* RMSNorm epsilon (1e-6 in the reference semantics) */
    int discretization;   /* 0: exact zero-order hold; 1: Euler (b_bar = delta*Bs) */
} mamba_ext_dims;

/* Sizes of the language model: n_layers blocks sharing `block` (V >= 1). */
typedef struct mamba_ext_model_dims {
    Py_ssize_t V;
    Py_ssize_t n_layers;
    mamba_ext_dims block;
} mamba_ext_model_dims;

/*
 * The function table. Entry semantics (T = float for *_f32, double for *_f64):
 *
 * block_cache_len(d): elements of T in the block forward cache; 0 if d is
 *   NULL or a size is < 1.
 * block_forward_T(out, cache, x, params, d, n_threads):
 *   out (B, L, Dm) and cache (block_cache_len) written; x (B, L, Dm) read.
 * block_backward_T(dx, grads, dout, cache, params, d, n_threads):
 *   dx (B, L, Dm) += dLoss/dx; grads[i] (shape of params[i]) += dLoss/dparams[i];
 *   dout (B, L, Dm) = dLoss/dout and cache (from block_forward_T) read.
 * model_loss_and_grads_T(loss, g_embedding, g_final_norm, g_lm_head_bias,
 *                        g_layer_params, tokens, targets, embedding,
 *                        final_norm, lm_head_bias, layer_params, d,
 *                        loss_scale, checkpointing, n_threads):
 *   *loss = mean cross-entropy over the B*L positions (double, unscaled);
 *   tokens, targets (B, L) int64; embedding (V, Dm) tied with the output head;
 *   final_norm (Dm,); lm_head_bias (V,); layer_params: n_layers*13 pointers,
 *   layer i parameter j at [i*13 + j]; gradients (same shapes/layout) +=
 *   dLoss/d* times loss_scale (1.0 for a plain gradient); checkpointing != 0
 *   recomputes block caches in the backward (less memory, same result).
 * adamw_step_T(w, m, v, g, n, lr, beta1, beta2, eps, weight_decay, max_delta,
 *              step, grad_scale, n_threads):
 *   one torch.optim.AdamW step in place on w, m, v (n,) with gradient
 *   g (n,) * grad_scale; step = 1-based step count (bias corrections);
 *   weight decay is decoupled; max_delta > 0 clamps |w' - w| (decay included).
 *   An element whose update is not finite keeps w, m, v unchanged. Returns the
 *   number of such elements (>= 0), or -MAMBA_EXT_ERR_ARG on bad arguments.
 * scan_hstates_len(B, L, D, N): elements of T in the scan's saved states
 *   hstate (B, C, D, N), C = number of time chunks; 0 if a size is < 1.
 * scan_forward_T(y, hstate, u, delta, Bs, Cs, ld_bc, A_log, D_vec, B, L, D, N,
 *                discretization, n_threads): the selective scan alone,
 *   h[t] = a_bar*h[t-1] + b_bar*u[t] (h[-1] = 0), y[t] = Cs[t].h[t] + D_vec*u[t],
 *   a_bar = exp(delta*A), A = -exp(clamp(A_log, -10, 5)), b_bar = (a_bar-1)/A*Bs
 *   (discretization 0) or delta*Bs (1). y (B, L, D) and hstate
 *   (scan_hstates_len, caller-allocated) written; u, delta (B, L, D);
 *   Bs, Cs: B*L rows of N values, ld_bc (>= N) elements from one row to the
 *   next (e.g. column slices of x_proj's output); A_log (D, N); D_vec (D,).
 * scan_backward_T(du, ddelta, dBs, dCs, dA_log, dD_vec, dy, hstate, <forward
 *                 inputs>, ...): += the gradients (dBs, dCs with the same ld_bc
 *   row stride) given dy (B, L, D) and the forward's hstate.
 */
typedef struct mamba_ext_api {
    int abi_version;      /* MAMBA_EXT_ABI_VERSION of the library */
    int count;            /* number of function pointers that follow */
    /* 0 */ Py_ssize_t (*block_cache_len)(const mamba_ext_dims *d);
    /* 1 */ int (*block_forward_f32)(float *out, float *cache, const float *x, const float *const *params, const mamba_ext_dims *d, int n_threads);
    /* 2 */ int (*block_backward_f32)(float *dx, float *const *grads, const float *dout, const float *cache, const float *const *params, const mamba_ext_dims *d, int n_threads);
    /* 3 */ int (*block_forward_f64)(double *out, double *cache, const double *x, const double *const *params, const mamba_ext_dims *d, int n_threads);
    /* 4 */ int (*block_backward_f64)(double *dx, double *const *grads, const double *dout, const double *cache, const double *const *params, const mamba_ext_dims *d, int n_threads);
    /* 5 */ int (*model_loss_and_grads_f32)(double *loss, float *g_embedding, float *g_final_norm, float *g_lm_head_bias, float *const *g_layer_params, const int64_t *tokens, const int64_t *targets, const float *embedding, const float *final_norm, const float *lm_head_bias, const float *const *layer_params, const mamba_ext_model_dims *d, double loss_scale, int checkpointing, int n_threads);
    /* 6 */ int (*model_loss_and_grads_f64)(double *loss, double *g_embedding, double *g_final_norm, double *g_lm_head_bias, double *const *g_layer_params, const int64_t *tokens, const int64_t *targets, const double *embedding, const double *final_norm, const double *lm_head_bias, const double *const *layer_params, const mamba_ext_model_dims *d, double loss_scale, int checkpointing, int n_threads);
    /* 7 */ Py_ssize_t (*adamw_step_f32)(float *w, float *m, float *v, const float *g, Py_ssize_t n, double lr, double beta1, double beta2, double eps, double weight_decay, double max_delta, long long step, double grad_scale, int n_threads);
    /* 8 */ Py_ssize_t (*adamw_step_f64)(double *w, double *m, double *v, const double *g, Py_ssize_t n, double lr, double beta1, double beta2, double eps, double weight_decay, double max_delta, long long step, double grad_scale, int n_threads);
    /* 9 */ Py_ssize_t (*scan_hstates_len)(Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N);
    /* 10 */ int (*scan_forward_f32)(float *y, float *hstate, const float *u, const float *delta, const float *Bs, const float *Cs, Py_ssize_t ld_bc, const float *A_log, const float *D_vec, Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N, int discretization, int n_threads);
    /* 11 */ int (*scan_backward_f32)(float *du, float *ddelta, float *dBs, float *dCs, float *dA_log, float *dD_vec, const float *dy, const float *hstate, const float *u, const float *delta, const float *Bs, const float *Cs, Py_ssize_t ld_bc, const float *A_log, const float *D_vec, Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N, int discretization, int n_threads);
    /* 12 */ int (*scan_forward_f64)(double *y, double *hstate, const double *u, const double *delta, const double *Bs, const double *Cs, Py_ssize_t ld_bc, const double *A_log, const double *D_vec, Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N, int discretization, int n_threads);
    /* 13 */ int (*scan_backward_f64)(double *du, double *ddelta, double *dBs, double *dCs, double *dA_log, double *dD_vec, const double *dy, const double *hstate, const double *u, const double *delta, const double *Bs, const double *Cs, Py_ssize_t ld_bc, const double *A_log, const double *D_vec, Py_ssize_t B, Py_ssize_t L, Py_ssize_t D, Py_ssize_t N, int discretization, int n_threads);
} mamba_ext_api;

/* The table after import_mamba_ext(); one copy per translation unit. Other
 * translation units can call mamba_ext_load_api() themselves (cheap). */
#ifndef MAMBA_EXT_NO_IMPORT
static const mamba_ext_api *mamba_ext_API = NULL;
#endif

/* Import mamba_ext.cpu.capi and return its table if it has ABI version
 * `abi_version` and at least `min_count` entries; else set ImportError (or the
 * import's own error) and return NULL. Needs the GIL. */
static inline const mamba_ext_api *mamba_ext_load_api(int abi_version, int min_count)
{
    /* PyCapsule_Import imports only the top-level package and then looks the rest
     * of the name up as attributes, so the module defining the capsule is imported
     * first (otherwise this fails in a process that has not imported it yet). */
    PyObject *module = PyImport_ImportModule("mamba_ext.cpu.capi");
    if (module == NULL)
        return NULL;
    Py_DECREF(module);
    const mamba_ext_api *api =
        (const mamba_ext_api *)PyCapsule_Import(MAMBA_EXT_CAPSULE_NAME, 0);
    if (api == NULL)
        return NULL;
    if (api->abi_version != abi_version) {
        PyErr_Format(PyExc_ImportError,
                     "mamba_ext C API version mismatch: this extension needs ABI "
                     "version %d but the installed mamba_ext provides ABI version %d; "
                     "rebuild it against the installed mamba_ext "
                     "(include dir: mamba_ext.get_include())",
                     abi_version, api->abi_version);
        return NULL;
    }
    if (api->count < min_count) {
        PyErr_Format(PyExc_ImportError,
                     "mamba_ext C API too old: this extension needs %d table "
                     "entries but the installed mamba_ext provides %d (ABI version "
                     "%d); upgrade mamba_ext",
                     min_count, api->count, abi_version);
        return NULL;
    }
    return api;
}

#ifndef MAMBA_EXT_NO_IMPORT
/* Fill mamba_ext_API; 0 on success, -1 with a Python exception set. */
static inline int import_mamba_ext(void)
{
    mamba_ext_API = mamba_ext_load_api(MAMBA_EXT_ABI_VERSION, MAMBA_EXT_API_COUNT);
    return mamba_ext_API == NULL ? -1 : 0;
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* MAMBA_EXT_MAMBA_EXT_H */
