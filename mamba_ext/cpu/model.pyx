# cython: language_level=3
"""Whole Mamba-1 language model: forward, mean cross-entropy and backward.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, M = B*L rows, V vocab size.

Steps of the model beyond the blocks (declared in model.pxd): embedding_forward /
embedding_backward (the table lookup and its scatter-add) and
cross_entropy_forward_backward (mean loss and dLoss/dlogits in one pass, in place).

Workspace (this thread's reused buffer of `floating`, mx_workspace in csrc/mx_threads.h: kept
and grown across calls, freed when the thread exits, because a fresh malloc of a few
hundred MB per training step is a fresh mmap whose page faults cost ~15% of a 4 x 256
step; plus one small malloc of double), in this order:
  hs      ((n_layers+1), M, Dm)  every layer's input, then the last output
  caches  (n_caches, cache_len)  n_caches = n_layers, or 1 when checkpointing
  xn      (M, Dm)                final RMSNorm output
  rstd    (M,)                   final RMSNorm 1/rms
  logits  (M, V)                 logits, overwritten in place by dLoss/dlogits
  da, db  (M, Dm) each           gradient ping-pong buffers
  scratch (M, Dm)                output of recomputed forwards (checkpointing)
  row_loss (M,) double           per-row cross-entropy, summed in row order
The checkpointed backward recomputes layer i's cache from hs[i] with the same
kernel, thread count and inputs as the forward, so it reproduces the cache
bit for bit and the gradients are bit-identical. The last layer's cache is
still in the buffer after the forward, so it is not recomputed.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.math cimport log
from libc.stdint cimport int64_t
from cython.parallel cimport prange

cimport numpy as cnp
import numpy as np

from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.constants cimport DEFAULT_EPS
from mamba_ext.cpu.activations cimport (mx_exp_shift_d, mx_exp_shift_f, mx_row_max_d,
                                        mx_row_max_f, mx_row_sum_d, mx_row_sum_f)
from mamba_ext.cpu.block cimport (mamba_dims, MAMBA_NPARAMS, block_cache_len,
                               block_forward_state, block_backward_state,
                               flat_op, FLAT_ZERO)
from mamba_ext.cpu.linear cimport linear_forward, linear_backward_set
from mamba_ext.cpu.rmsnorm cimport rmsnorm_forward, rmsnorm_backward

cnp.import_array()

# mx_workspace: this thread's reused scratch of this module (static in the header: the
# blocks' own mx_workspace is a different one), or NULL; never freed by the caller
from mamba_ext.cpu.threads cimport mx_team, mx_workspace


cdef inline idx_t _n_caches(const model_dims* d, int checkpointing) noexcept nogil:
    if d.n_layers == 0:
        return 0
    return 1 if checkpointing else d.n_layers


cdef size_t model_workspace_bytes(const model_dims* d, int checkpointing,
                                  size_t itemsize) noexcept nogil:
    cdef idx_t M = d.block.B * d.block.L
    cdef idx_t Dm = d.block.Dm
    cdef size_t n = <size_t>((d.n_layers + 1) * M * Dm
                             + _n_caches(d, checkpointing) * block_cache_len(&d.block)
                             + M * Dm + M + M * d.V + 3 * M * Dm)
    return n * itemsize + <size_t>M * sizeof(double)


cdef int _check_ids(const int64_t* ids, idx_t M, idx_t V) noexcept nogil:
    cdef idx_t r
    for r in range(M):
        if ids[r] < 0 or ids[r] >= V:
            return MODEL_ERR_TOKEN
    return MODEL_OK


cdef void embedding_forward(floating* h, const int64_t* tokens, const floating* embedding,
                            idx_t M, idx_t Dm) noexcept nogil:
    # h (M, Dm) = embedding (V, Dm) [tokens (M,)]
    cdef idx_t r
    for r in range(M):
        memcpy(h + r * Dm, embedding + tokens[r] * Dm, Dm * sizeof(floating))


cdef void embedding_backward(floating* dembedding, const floating* dh, const int64_t* tokens,
                             idx_t M, idx_t Dm) noexcept nogil:
    # dembedding (V, Dm) [tokens[r]] += dh (M, Dm) [r]; sequential: rows may repeat a token
    cdef idx_t r, c
    for r in range(M):
        for c in range(Dm):
            dembedding[tokens[r] * Dm + c] += dh[r * Dm + c]


# State passing of the whole model: `states` is NULL (every layer starts from zeros, no
# state returned) or a table of 4 * n_layers pointers, layer i's at 4i + (STATE_H0,
# STATE_CONV, STATE_H_LAST, STATE_CONV_TAIL), each NULL or a buffer of block_forward_state:
# h0, h_last (B, D, N); conv_state, conv_tail (B, D, K-1) (block.pxd).
cdef enum:
    STATE_H0 = 0
    STATE_CONV = 1
    STATE_H_LAST = 2
    STATE_CONV_TAIL = 3


cdef inline void* _state(void** states, idx_t i, int k) noexcept nogil:
    return NULL if states == NULL else states[4 * i + k]


cdef int _forward_trunk(floating* hs, floating* caches, idx_t cache_stride,
                        floating* xn, floating* rstd, floating* logits,
                        const int64_t* tokens, const floating* embedding,
                        const floating* final_norm, const floating* lm_head_bias,
                        const floating** layer_params, void** states, const model_dims* d,
                        int n_threads) noexcept nogil:
    # hs ((n_layers+1), M, Dm); caches: layer i writes caches + i*cache_stride
    # (cache_stride 0: all layers share one buffer); xn (M, Dm); rstd (M,); logits (M, V)
    cdef idx_t M = d.block.B * d.block.L
    cdef idx_t Dm = d.block.Dm
    cdef idx_t i
    embedding_forward(hs, tokens, embedding, M, Dm)
    for i in range(d.n_layers):
        if block_forward_state(hs + (i + 1) * M * Dm, caches + i * cache_stride,
                               <floating*>_state(states, i, STATE_H_LAST),
                               <floating*>_state(states, i, STATE_CONV_TAIL), hs + i * M * Dm,
                               layer_params + i * MAMBA_NPARAMS,
                               <const floating*>_state(states, i, STATE_H0),
                               <const floating*>_state(states, i, STATE_CONV),
                               &d.block, n_threads) != 0:
            return MODEL_ERR_NOMEM
    rmsnorm_forward(xn, rstd, hs + d.n_layers * M * Dm, final_norm, M, Dm, d.block.eps,
                    n_threads)
    linear_forward(logits, xn, embedding, lm_head_bias, M, Dm, d.V, n_threads)
    return MODEL_OK


cdef int model_forward(floating* logits, const int64_t* tokens,
                       const floating* embedding, const floating* final_norm,
                       const floating* lm_head_bias, const floating** layer_params,
                       const model_dims* d, int n_threads) noexcept nogil:
    return model_forward_state(logits, tokens, embedding, final_norm, lm_head_bias,
                               layer_params, NULL, d, n_threads)


cdef int model_forward_state(floating* logits, const int64_t* tokens,
                             const floating* embedding, const floating* final_norm,
                             const floating* lm_head_bias, const floating** layer_params,
                             void** states, const model_dims* d, int n_threads) noexcept nogil:
    cdef idx_t M = d.block.B * d.block.L
    cdef idx_t Dm = d.block.Dm
    cdef idx_t cl = block_cache_len(&d.block) if d.n_layers > 0 else 0
    cdef int status
    if M == 0:
        return MODEL_OK
    if _check_ids(tokens, M, d.V) != MODEL_OK:
        return MODEL_ERR_TOKEN
    # hs ((n_layers+1), M, Dm), one shared cache (cl,), xn (M, Dm), rstd (M,)
    cdef floating* ws = <floating*>mx_workspace(((d.n_layers + 1) * M * Dm + cl + M * Dm + M)
                                                * sizeof(floating))
    if ws == NULL:
        return MODEL_ERR_NOMEM
    cdef floating* hs = ws
    cdef floating* cache = hs + (d.n_layers + 1) * M * Dm
    cdef floating* xn = cache + cl
    cdef floating* rstd = xn + M * Dm
    status = _forward_trunk(hs, cache, 0, xn, rstd, logits, tokens, embedding, final_norm,
                            lm_head_bias, layer_params, states, d, n_threads)
    return status


cdef void cross_entropy_forward_backward(double* row_loss, floating* logits,
                                         const int64_t* targets, idx_t M, idx_t V,
                                         double seed_scale, int n_threads) noexcept nogil:
    # logits (M, V) in, dLoss/dlogits * loss_scale out (in place); row_loss (M,) written;
    # targets (M,)
    # seed_scale = loss_scale / M. exp in the kernel's precision, sums in double.
    cdef idx_t r, v
    cdef floating* row
    cdef floating mx, picked
    cdef double s, scale
    cdef int nt = mx_team(n_threads, M * V, 1 << 15, M)
    for r in prange(M, schedule='static', num_threads=nt, nogil=True):
        row = logits + r * V
        picked = row[targets[r]]
        # row <- exp(row - max), summed in double (vectorised loops and fixed-order row
        # reductions, csrc/mx_activations.h)
        if floating is float:
            mx = mx_row_max_f(row, V)
            mx_exp_shift_f(row, mx, V)
            s = mx_row_sum_f(row, V)
        else:
            mx = mx_row_max_d(row, V)
            mx_exp_shift_d(row, mx, V)
            s = mx_row_sum_d(row, V)
        row_loss[r] = mx + log(s) - picked
        scale = seed_scale / s
        for v in range(V):          # (softmax - onehot) * loss_scale / M
            row[v] = <floating>(row[v] * scale)
        row[targets[r]] -= <floating>seed_scale


cdef int model_loss_and_grads(double* loss,
                              floating* g_embedding, floating* g_final_norm,
                              floating* g_lm_head_bias, floating** g_layer_params,
                              const int64_t* tokens, const int64_t* targets,
                              const floating* embedding, const floating* final_norm,
                              const floating* lm_head_bias, const floating** layer_params,
                              const model_dims* d, double loss_scale, int checkpointing,
                              int n_threads) noexcept nogil:
    return model_loss_and_grads_state(loss, g_embedding, g_final_norm, g_lm_head_bias,
                                      g_layer_params, tokens, targets, embedding, final_norm,
                                      lm_head_bias, layer_params, NULL, d, loss_scale,
                                      checkpointing, n_threads, NULL, NULL)


cdef int model_loss_and_grads_state(double* loss,
                                    floating* g_embedding, floating* g_final_norm,
                                    floating* g_lm_head_bias, floating** g_layer_params,
                                    const int64_t* tokens, const int64_t* targets,
                                    const floating* embedding, const floating* final_norm,
                                    const floating* lm_head_bias, const floating** layer_params,
                                    void** states, const model_dims* d, double loss_scale,
                                    int checkpointing, int n_threads,
                                    grads_done_fn grads_done, void* ctx) noexcept nogil:
    # states: as _forward_trunk; the gradients treat the carried state as a constant
    # (truncated backpropagation through time: no dLoss/dh0 is formed); grads_done: see
    # model.pxd
    cdef idx_t M = d.block.B * d.block.L
    cdef idx_t Dm = d.block.Dm
    cdef idx_t V = d.V
    cdef idx_t nl = d.n_layers
    cdef idx_t cl = block_cache_len(&d.block) if nl > 0 else 0
    cdef idx_t n_caches = _n_caches(d, checkpointing)
    cdef idx_t i, r
    cdef double total
    cdef int status = MODEL_OK
    if M == 0:
        return MODEL_ERR_EMPTY
    if _check_ids(tokens, M, V) != MODEL_OK or _check_ids(targets, M, V) != MODEL_OK:
        return MODEL_ERR_TOKEN

    cdef floating* ws = <floating*>mx_workspace(((nl + 1) * M * Dm + n_caches * cl + M * Dm + M
                                                 + M * V + 3 * M * Dm) * sizeof(floating))
    cdef double* row_loss = <double*>malloc(M * sizeof(double))
    if ws == NULL or row_loss == NULL:
        free(row_loss)
        return MODEL_ERR_NOMEM
    cdef floating* hs = ws                          # ((nl+1), M, Dm)
    cdef floating* caches = hs + (nl + 1) * M * Dm  # (n_caches, cl)
    cdef floating* xn = caches + n_caches * cl      # (M, Dm)
    cdef floating* rstd = xn + M * Dm               # (M,)
    cdef floating* logits = rstd + M                # (M, V), becomes dlogits
    cdef floating* da = logits + M * V              # (M, Dm) dLoss/d(current h)
    cdef floating* db = da + M * Dm                 # (M, Dm) dLoss/d(previous h)
    cdef floating* scratch = db + M * Dm            # (M, Dm)
    cdef floating* tmp
    cdef idx_t cache_stride = 0 if checkpointing else cl

    status = _forward_trunk(hs, caches, cache_stride, xn, rstd, logits, tokens, embedding,
                            final_norm, lm_head_bias, layer_params, states, d, n_threads)
    if status == MODEL_OK:
        cross_entropy_forward_backward(row_loss, logits, targets, M, V,
                                       loss_scale / <double>M, n_threads)
        total = 0.0
        for r in range(M):          # fixed order: deterministic loss
            total += row_loss[r]
        loss[0] = total / <double>M

        # head: dxn (scratch) = dlogits @ embedding; g_embedding += dlogits^T @ xn
        if linear_backward_set(scratch, g_embedding, g_lm_head_bias, logits, xn, embedding, M, Dm,
                           V, n_threads) != 0:
            free(row_loss)
            return MODEL_ERR_NOMEM
        flat_op(FLAT_ZERO, da, <floating*>NULL, M * Dm, n_threads)
        rmsnorm_backward(da, g_final_norm, scratch, hs + nl * M * Dm, final_norm, rstd, M, Dm,
                         n_threads)
        if grads_done != NULL:
            grads_done(ctx, nl)

        i = nl - 1
        while i >= 0:
            if checkpointing and i != nl - 1:
                # recompute layer i's cache from its kept input (output discarded)
                if block_forward_state(scratch, caches, NULL, NULL, hs + i * M * Dm,
                                       layer_params + i * MAMBA_NPARAMS,
                                       <const floating*>_state(states, i, STATE_H0),
                                       <const floating*>_state(states, i, STATE_CONV),
                                       &d.block, n_threads) != 0:
                    status = MODEL_ERR_NOMEM
                    break
            flat_op(FLAT_ZERO, db, <floating*>NULL, M * Dm, n_threads)
            if block_backward_state(db, g_layer_params + i * MAMBA_NPARAMS, NULL, NULL, da,
                                    NULL, NULL, caches + i * cache_stride,
                                    layer_params + i * MAMBA_NPARAMS,
                                    <const floating*>_state(states, i, STATE_CONV),
                                    &d.block, n_threads) != 0:
                status = MODEL_ERR_NOMEM
                break
            if grads_done != NULL:
                grads_done(ctx, i)
            tmp = da
            da = db
            db = tmp
            i -= 1

        if status == MODEL_OK:
            # lookup: g_embedding[tokens[r]] += dLoss/dh0[r]
            embedding_backward(g_embedding, da, tokens, M, Dm)
    free(row_loss)
    return status


# ---------------------------------------------------------------------------
# Python-level entry points used by mamba_ext/model.py (arguments validated
# there: C-contiguous arrays of one float dtype, int64 ids, golden shapes).

cdef model_dims _dims(object sizes, double eps, int discretization=0):
    # sizes: (V, n_layers, B, L, Dm, D, N, K, R); discretization 0 ZOH, 1 Euler
    cdef model_dims d
    d.V, d.n_layers = sizes[0], sizes[1]
    d.block.B, d.block.L, d.block.Dm, d.block.D = sizes[2], sizes[3], sizes[4], sizes[5]
    d.block.N, d.block.K, d.block.R = sizes[6], sizes[7], sizes[8]
    d.block.eps = eps
    d.block.discretization = discretization
    return d


cdef void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef void** _ptr_table(list layers) except NULL:
    # layers: list of n_layers lists of 13 arrays -> flat malloc'd pointer table
    cdef idx_t n = len(layers) * MAMBA_NPARAMS
    cdef void** t = <void**>malloc((n if n > 0 else 1) * sizeof(void*))
    cdef idx_t i, j
    if t == NULL:
        raise MemoryError("mamba_ext: cannot allocate the layer pointer table")
    for i in range(len(layers)):
        for j in range(MAMBA_NPARAMS):
            t[i * MAMBA_NPARAMS + j] = _ptr(layers[i][j])
    return t


def _raise_status(int status):
    if status == MODEL_ERR_NOMEM:
        raise MemoryError("mamba_ext: out of memory for the model workspace")
    if status == MODEL_ERR_TOKEN:
        raise ValueError("mamba_ext: a token or target id is outside [0, vocab_size)")
    if status == MODEL_ERR_EMPTY:
        raise ValueError("mamba_ext: the mean loss over zero positions is undefined")
    if status != MODEL_OK:
        raise RuntimeError(f"mamba_ext: model kernel failed with status {status}")


def workspace_bytes(sizes, bint checkpointing, size_t itemsize):
    """Bytes of the loss-and-grads workspace for sizes (V, n_layers, B, L, Dm, D, N, K, R)."""
    cdef model_dims d = _dims(sizes, DEFAULT_EPS)
    return model_workspace_bytes(&d, checkpointing, itemsize)


cdef void** _state_table(object states, idx_t n_layers) except? NULL:
    # states: None, or (h0, conv_state, h_last, conv_tail), each None or an array
    # (n_layers, B, D, N) / (n_layers, B, D, K-1), C-contiguous (checked by model.py)
    # -> malloc'd table of 4 * n_layers pointers (layer i's slices), or NULL
    cdef idx_t i
    cdef int k
    cdef void** t
    if states is None:
        return NULL
    t = <void**>malloc((4 * n_layers if n_layers > 0 else 1) * sizeof(void*))
    if t == NULL:
        raise MemoryError("mamba_ext: cannot allocate the state pointer table")
    for k in range(4):
        for i in range(n_layers):
            t[4 * i + k] = NULL if states[k] is None else _ptr(states[k][i])
    return t


def forward(cnp.ndarray logits, cnp.ndarray tokens, cnp.ndarray embedding,
            cnp.ndarray final_norm, cnp.ndarray lm_head_bias, list layers,
            sizes, double eps, int discretization, int n_threads, states=None):
    """logits (B, L, V) written in place; states: see _state_table (h_last, conv_tail
    written)."""
    cdef model_dims d = _dims(sizes, eps, discretization)
    cdef void** t = _ptr_table(layers)
    cdef void** st
    try:
        st = _state_table(states, d.n_layers)
    except MemoryError:
        free(t)
        raise
    cdef int status
    cdef bint is32 = embedding.dtype == np.float32
    cdef void* out = _ptr(logits)
    cdef const int64_t* tok = <const int64_t*>_ptr(tokens)
    cdef void* emb = _ptr(embedding)
    cdef void* fn = _ptr(final_norm)
    cdef void* bias = _ptr(lm_head_bias)
    with nogil:
        if is32:
            status = model_forward_state(<float*>out, tok, <const float*>emb, <const float*>fn,
                                         <const float*>bias, <const float**>t, st, &d, n_threads)
        else:
            status = model_forward_state(<double*>out, tok, <const double*>emb, <const double*>fn,
                                         <const double*>bias, <const double**>t, st, &d,
                                         n_threads)
    free(t)
    free(st)
    _raise_status(status)


cdef void _grads_done(void* ctx, idx_t i) noexcept nogil:
    # ctx: a list [callback, error]; an exception of the callback is kept (and later
    # calls skipped) for loss_and_grads to raise once the kernel has returned
    with gil:
        holder = <list>ctx
        if holder[1] is None:
            try:
                holder[0](i)
            except BaseException as e:
                holder[1] = e


def loss_and_grads(cnp.ndarray tokens, cnp.ndarray targets, cnp.ndarray embedding,
                   cnp.ndarray final_norm, cnp.ndarray lm_head_bias, list layers,
                   cnp.ndarray g_embedding, cnp.ndarray g_final_norm,
                   cnp.ndarray g_lm_head_bias, list g_layers,
                   sizes, double eps, int discretization, double loss_scale,
                   bint checkpointing, int n_threads, states=None, grads_done=None):
    """Returns the mean loss; the g_* arrays (zeroed by the caller) accumulate;
    states: see _state_table (h_last, conv_tail written); grads_done: None or a callable
    called with i as model.pxd's grads_done (an exception it raises is raised here, after
    the kernel has finished)."""
    cdef model_dims d = _dims(sizes, eps, discretization)
    cdef void** t = _ptr_table(layers)
    cdef void** gt
    cdef void** st = NULL
    try:
        gt = _ptr_table(g_layers)
    except MemoryError:
        free(t)
        raise
    try:
        st = _state_table(states, d.n_layers)
    except MemoryError:
        free(t)
        free(gt)
        raise
    cdef int status
    cdef double loss = 0.0
    cdef bint is32 = embedding.dtype == np.float32
    cdef const int64_t* tok = <const int64_t*>_ptr(tokens)
    cdef const int64_t* tgt = <const int64_t*>_ptr(targets)
    cdef void* emb = _ptr(embedding)
    cdef void* fn = _ptr(final_norm)
    cdef void* bias = _ptr(lm_head_bias)
    cdef void* gemb = _ptr(g_embedding)
    cdef void* gfn = _ptr(g_final_norm)
    cdef void* gbias = _ptr(g_lm_head_bias)
    cdef list holder = [grads_done, None]
    cdef grads_done_fn done = NULL
    if grads_done is not None:
        done = _grads_done
    cdef void* ctx = <void*>holder
    with nogil:
        if is32:
            status = model_loss_and_grads_state(&loss, <float*>gemb, <float*>gfn, <float*>gbias,
                                                <float**>gt, tok, tgt, <const float*>emb,
                                                <const float*>fn, <const float*>bias,
                                                <const float**>t, st, &d, loss_scale,
                                                checkpointing, n_threads, done, ctx)
        else:
            status = model_loss_and_grads_state(&loss, <double*>gemb, <double*>gfn,
                                                <double*>gbias, <double**>gt, tok, tgt,
                                                <const double*>emb, <const double*>fn,
                                                <const double*>bias, <const double**>t, st, &d,
                                                loss_scale, checkpointing, n_threads, done, ctx)
    free(t)
    free(gt)
    free(st)
    _raise_status(status)
    if holder[1] is not None:
        raise holder[1]
    return loss
