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
step): one region per sequence group (`region` below: layer inputs, block caches, xn,
rstd, logits, gradient ping-pong buffers, scratch; one group unless the batch runs as
sequence groups, "Sequence groups"); plus small mallocs: row_loss (M,) double (per-row
cross-entropy, summed in row order), and with groups their gradient slots.
The checkpointed backward recomputes layer i's cache from hs[i] with the same
kernel, thread count and inputs as the forward, so it reproduces the cache
bit for bit and the gradients are bit-identical. The last layer's cache is
still in the buffer after the forward, so it is not recomputed.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.math cimport log
from libc.stdint cimport int64_t
from cython.parallel cimport prange

cimport numpy as cnp
import numpy as np

from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.constants cimport DEFAULT_EPS
from mamba_ext.cpu.activations cimport (mx_add_d, mx_add_f, mx_exp_shift_d, mx_exp_shift_f,
                                        mx_row_max_d, mx_row_max_f, mx_row_sum_d,
                                        mx_row_sum_f)
from mamba_ext.cpu.block cimport (mamba_dims, MAMBA_NPARAMS, block_cache_len, block_param_len,
                               block_forward_state, block_backward_state,
                               flat_op, FLAT_ZERO)
from mamba_ext.cpu.linear cimport linear_forward, linear_backward_set
from mamba_ext.cpu.rmsnorm cimport rmsnorm_forward, rmsnorm_backward

cnp.import_array()

# mx_workspace: this thread's reused scratch of this module (static in the header: the
# blocks' own mx_workspace is a different one), or NULL; never freed by the caller
from mamba_ext.cpu.threads cimport mx_team, mx_threads, mx_workspace


cdef inline idx_t _n_caches(const model_dims* d, int checkpointing) noexcept nogil:
    if d.n_layers == 0:
        return 0
    return 1 if checkpointing else d.n_layers


cdef size_t model_workspace_bytes(const model_dims* d, int checkpointing,
                                  size_t itemsize) noexcept nogil:
    # what model_loss_and_grads_state allocates without states: G group workspaces (the
    # calling thread's buffer), G gradient slots (_slot_values) when G > 1, and row_loss
    # (M doubles)
    cdef idx_t M = d.block.B * d.block.L
    cdef idx_t k, G
    cdef region r
    if M == 0:
        return 0
    k = group_seqs(d, checkpointing)
    G = n_of_groups(d, k)
    r = _region(d, k, checkpointing)
    return (<size_t>(G * r.size + (G * _slot_values(d) if G > 1 else 0)) * itemsize
            + <size_t>M * sizeof(double))


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


# Sequence groups. Design: a small model's step was ~60 parallel regions of a few
# microseconds of work per thread, and at each one the team waited for its slowest member
# and for the calling thread's serial stretches (the embedding's scatter-add, the loss
# sum): ~10% of a 2 x 64 step in docs/performance.md. Where the batch holds enough whole
# sequences, the step runs as G groups of whole sequences instead: in each phase (the
# forward with the head's backward, each layer's backward, the lookup's backward) the
# groups run side by side, each on one thread (_run_phase's waves), each into a gradient
# slot of its own, and between the phases the calling thread sums the slots of the
# gradients that are final in group order and hands them to grads_done. So a step has
# ~n_layers + 2 regions, and the all-reduce of data parallelism still overlaps the
# backward. The groups are fixed by the sizes alone (group_seqs), never by the thread count,
# and a group computes the same bits on any thread count, so the results stay bitwise the
# same for any n_threads and with or without grads_done; against one pass over the whole
# batch (G = 1: the same code, the caller's gradients the only slot) they differ by the
# order of the sums over rows.

cdef enum:
    GROUP_ROWS = 256            # rows of a sequence group at least (the default)
    GROUP_MAX_DM = 256          # the largest d_model whose steps run as groups
    REDUCE_PIECE = 1 << 12      # values per piece of the slots' sum
    REDUCE_BLOCK = 256          # values summed over the slots as one vector run
    MIN_REDUCE_VALUES = 1 << 15 # values read per thread of the slots' sum at least

# the rows of a group in use; tests change it (_set_group_rows)
cdef idx_t group_rows = GROUP_ROWS


cdef enum:
    SLOT_HEAD = 3                       # the head's arrays in a slot: embedding, norm, bias
    SLOT_ARRAYS = 3 + MAMBA_NPARAMS     # all arrays of a slot


cdef void _slot_starts(const model_dims* d, idx_t* starts) noexcept nogil:
    # starts (SLOT_ARRAYS + 1,): the offsets of a group's gradient slot's arrays: the
    # head's (embedding (V, Dm), final norm (Dm,), head bias (V,)), then one layer's
    # MAMBA_NPARAMS (each layer's phase reuses them; empty without layers);
    # starts[SLOT_HEAD] is the head's size, starts[SLOT_ARRAYS] the slot's
    cdef idx_t j
    starts[0] = 0
    starts[1] = d.V * d.block.Dm
    starts[2] = starts[1] + d.block.Dm
    starts[SLOT_HEAD] = starts[2] + d.V
    for j in range(MAMBA_NPARAMS):
        starts[SLOT_HEAD + 1 + j] = starts[SLOT_HEAD + j] + (
            block_param_len(&d.block, j) if d.n_layers > 0 else 0)


cdef idx_t _slot_values(const model_dims* d) noexcept nogil:
    # elements of a group's gradient slot
    cdef idx_t starts[SLOT_ARRAYS + 1]
    _slot_starts(d, starts)
    return starts[SLOT_ARRAYS]


# One group's workspace (`floating` offsets from its start) for `rows` rows:
#   hs      ((n_layers+1), rows, Dm)  every layer's input, then the last output
#   caches  (n_caches, cache_len)     n_caches = n_layers, or 1 when checkpointing;
#                                     layer i's at i * cache_stride (0 when checkpointing)
#   xn      (rows, Dm)                final RMSNorm output
#   rstd    (rows,)                   final RMSNorm 1/rms
#   logits  (rows, V)                 logits, overwritten in place by dLoss/dlogits
#   da, db  (rows, Dm) each           gradient ping-pong buffers
#   scratch (rows, Dm)                output of recomputed forwards (checkpointing)
ctypedef struct region:
    idx_t hs, caches, xn, rstd, logits, da, db, scratch, size, cache_stride


cdef region _region(const model_dims* d, idx_t seqs, int checkpointing) noexcept nogil:
    # the workspace of a group of seqs sequences
    cdef region r
    cdef mamba_dims b = d.block
    cdef idx_t Dm = d.block.Dm, rows = seqs * d.block.L
    cdef idx_t cl
    b.B = seqs
    cl = block_cache_len(&b) if d.n_layers > 0 else 0
    r.hs = 0
    r.caches = (d.n_layers + 1) * rows * Dm
    r.xn = r.caches + _n_caches(d, checkpointing) * cl
    r.rstd = r.xn + rows * Dm
    r.logits = r.rstd + rows
    r.da = r.logits + rows * d.V
    r.db = r.da + rows * Dm
    r.scratch = r.db + rows * Dm
    r.size = r.scratch + rows * Dm
    r.cache_stride = 0 if checkpointing else cl
    return r


cdef idx_t group_seqs(const model_dims* d, int checkpointing) noexcept nogil:
    # sequences a group of a step of these sizes (B: one pass over the batch): for models
    # of d_model <= GROUP_MAX_DM, the batch split into as many groups as have group_rows
    # rows each, while their gradient slots take at most a quarter of the one pass's
    # workspace
    cdef idx_t B = d.block.B, ng
    if d.block.Dm > GROUP_MAX_DM or B == 0:
        return B
    ng = min(B, B * d.block.L // group_rows,
             _region(d, B, checkpointing).size // 4 // _slot_values(d))
    return (B + ng - 1) // ng if ng > 1 else B


cdef inline idx_t n_of_groups(const model_dims* d, idx_t k) noexcept nogil:
    # groups of k sequences (the last may hold fewer); one for an empty batch
    return (d.block.B + k - 1) // k if k > 0 else 1


# What every phase of a step needs; one struct per step (see "Sequence groups").
ctypedef struct step_ctx:
    idx_t G, k                  # groups, sequences a group (the last may hold fewer)
    idx_t nv                    # gradient values a slot (_slot_starts)
    idx_t head_values           # of them, the head's; the rest one layer's
    int checkpointing
    double seed_scale
    void** states               # the caller's (G = 1 only)
    double* row_loss            # (M,)
    int* status                 # (G,)


cdef inline idx_t _group_rows_of(const model_dims* d, const step_ctx* c, idx_t g) noexcept nogil:
    return min(c.k, d.block.B - g * c.k) * d.block.L


cdef inline floating* _buf(floating* ws, const region* r, idx_t g, idx_t off) noexcept nogil:
    return ws + g * r.size + off


cdef int _group_forward(floating* ws, const region* r, floating** slot, const step_ctx* c,
                        const int64_t* tokens, const int64_t* targets,
                        const floating* embedding, const floating* final_norm,
                        const floating* lm_head_bias, const floating** layer_params,
                        const model_dims* d, idx_t g, int inner) noexcept nogil:
    # group g's forward, cross-entropy and the head's backward: slot[0..2] (its embedding,
    # final norm and head bias gradients) accumulate, its da holds dLoss/d(last output)
    cdef model_dims dg = d[0]
    cdef idx_t M = _group_rows_of(d, c, g), Dm = d.block.Dm, nl = d.n_layers
    cdef idx_t r0 = g * c.k * d.block.L
    cdef floating* hs = _buf(ws, r, g, r.hs)
    cdef floating* xn = _buf(ws, r, g, r.xn)
    cdef floating* rstd = _buf(ws, r, g, r.rstd)
    cdef floating* logits = _buf(ws, r, g, r.logits)
    cdef floating* da = _buf(ws, r, g, r.da)
    cdef floating* scratch = _buf(ws, r, g, r.scratch)
    cdef int status
    dg.block.B = M // d.block.L
    if c.G > 1:                    # the slot's head part
        memset(slot[0], 0, c.head_values * sizeof(floating))
    status = _forward_trunk(hs, _buf(ws, r, g, r.caches), r.cache_stride, xn, rstd, logits,
                            tokens + r0, embedding, final_norm, lm_head_bias, layer_params,
                            c.states, &dg, inner)
    if status != MODEL_OK:
        return status
    cross_entropy_forward_backward(c.row_loss + r0, logits, targets + r0, M, d.V, c.seed_scale,
                                   inner)
    # head: dxn (scratch) = dlogits @ embedding; g_embedding += dlogits^T @ xn
    if linear_backward_set(scratch, slot[0], slot[2], logits, xn, embedding, M, Dm, d.V,
                           inner) != 0:
        return MODEL_ERR_NOMEM
    flat_op(FLAT_ZERO, da, <floating*>NULL, M * Dm, inner)
    rmsnorm_backward(da, slot[1], scratch, hs + nl * M * Dm, final_norm, rstd, M, Dm, inner)
    return MODEL_OK


cdef int _group_layer_backward(floating* ws, const region* r, floating** slot,
                               const step_ctx* c, const floating** layer_params,
                               const model_dims* d, idx_t g, idx_t i, int inner) noexcept nogil:
    # layer i's backward of group g: its layer-i gradients (slot[SLOT_HEAD + i*MAMBA_NPARAMS ..])
    # accumulate; dLoss/d(layer i's output) in da or db by the parity of the layers done
    # (da first), dLoss/d(its input) written to the other
    cdef model_dims dg = d[0]
    cdef idx_t M = _group_rows_of(d, c, g), Dm = d.block.Dm, nl = d.n_layers
    cdef floating* hs = _buf(ws, r, g, r.hs)
    cdef floating* caches = _buf(ws, r, g, r.caches)
    cdef floating* dout = _buf(ws, r, g, r.da if (nl - 1 - i) % 2 == 0 else r.db)
    cdef floating* dx = _buf(ws, r, g, r.db if (nl - 1 - i) % 2 == 0 else r.da)
    dg.block.B = M // d.block.L
    if c.G > 1:                    # the slot's layer part, reused by every layer
        memset(slot[SLOT_HEAD + i * MAMBA_NPARAMS], 0, (c.nv - c.head_values) * sizeof(floating))
    if c.checkpointing and i != nl - 1:
        # recompute layer i's cache from its kept input (output discarded)
        if block_forward_state(_buf(ws, r, g, r.scratch), caches, NULL, NULL, hs + i * M * Dm,
                               layer_params + i * MAMBA_NPARAMS,
                               <const floating*>_state(c.states, i, STATE_H0),
                               <const floating*>_state(c.states, i, STATE_CONV),
                               &dg.block, inner) != 0:
            return MODEL_ERR_NOMEM
    flat_op(FLAT_ZERO, dx, <floating*>NULL, M * Dm, inner)
    if block_backward_state(dx, slot + SLOT_HEAD + i * MAMBA_NPARAMS, NULL, NULL, dout, NULL, NULL,
                            caches + i * r.cache_stride,
                            layer_params + i * MAMBA_NPARAMS,
                            <const floating*>_state(c.states, i, STATE_CONV),
                            &dg.block, inner) != 0:
        return MODEL_ERR_NOMEM
    return MODEL_OK


cdef int _group_embedding_backward(floating* ws, const region* r, floating** slot,
                                   const step_ctx* c, const int64_t* tokens,
                                   const model_dims* d, idx_t g) noexcept nogil:
    # lookup: slot's g_embedding[tokens[r]] += dLoss/dh0[r] (in da or db by the parity of
    # n_layers)
    cdef idx_t M = _group_rows_of(d, c, g)
    if c.G > 1:                    # the slot's embedding part, summed after the head's
        memset(slot[0], 0, d.V * d.block.Dm * sizeof(floating))
    embedding_backward(slot[0], _buf(ws, r, g, r.da if d.n_layers % 2 == 0 else r.db),
                       tokens + g * c.k * d.block.L, M, d.block.Dm)
    return MODEL_OK


cdef inline int _first_error(const int* status, idx_t G) noexcept nogil:
    cdef idx_t g
    for g in range(G):
        if status[g] != MODEL_OK:
            return status[g]
    return MODEL_OK


cdef enum:                 # the phases of a step (_phase)
    PHASE_FORWARD = 0      # forward, loss, head's backward
    PHASE_LAYER = 1        # layer i's backward
    PHASE_LOOKUP = 2       # the lookup's backward


cdef inline int _phase(int phase, floating* ws, const region* r, floating** ptrs, idx_t na,
                       const step_ctx* c, const int64_t* tokens, const int64_t* targets,
                       const floating* embedding, const floating* final_norm,
                       const floating* lm_head_bias, const floating** layer_params,
                       const model_dims* d, idx_t g, idx_t i, int inner) noexcept nogil:
    # group g's part of a phase, on `inner` threads
    if phase == PHASE_FORWARD:
        return _group_forward(ws, r, ptrs + g * na, c, tokens, targets, embedding, final_norm,
                              lm_head_bias, layer_params, d, g, inner)
    if phase == PHASE_LAYER:
        return _group_layer_backward(ws, r, ptrs + g * na, c, layer_params, d, g, i, inner)
    return _group_embedding_backward(ws, r, ptrs + g * na, c, tokens, d, g)


cdef int _run_phase(int phase, floating* ws, const region* r, floating** ptrs, idx_t na,
                    const step_ctx* c, const int64_t* tokens, const int64_t* targets,
                    const floating* embedding, const floating* final_norm,
                    const floating* lm_head_bias, const floating** layer_params,
                    const model_dims* d, idx_t i, int nt) noexcept nogil:
    # every group's part of a phase on nt threads, in waves: as many rounds of nt groups on
    # a thread each as fill all threads; then the rest, each on a thread of its own if they
    # fill at least half the threads, else one after another on all of them (nested teams
    # ran slower than either on a 16-core host, docs/performance.md); returns the first
    # group's error, else MODEL_OK
    cdef idx_t G = c.G, g, g0 = 0, g1
    cdef int outer
    while g0 < G:
        g1 = G if G - g0 < nt else g0 + (G - g0) // nt * nt
        outer = <int>min(<idx_t>nt, g1 - g0) if 2 * (g1 - g0) >= nt else 1
        if outer == 1:
            for g in range(g0, g1):
                c.status[g] = _phase(phase, ws, r, ptrs, na, c, tokens, targets, embedding,
                                     final_norm, lm_head_bias, layer_params, d, g, i, nt)
        else:
            for g in prange(g0, g1, schedule='static', num_threads=outer):
                c.status[g] = _phase(phase, ws, r, ptrs, na, c, tokens, targets, embedding,
                                     final_norm, lm_head_bias, layer_params, d, g, i, 1)
        g0 = g1
    return _first_error(c.status, G)


cdef void _reduce_run(floating* out, const floating* slots, idx_t nv, idx_t G,
                      idx_t n) noexcept nogil:
    # out (n,) += the sum of the G slots' values (slots + g nv, n each) in group order:
    # acc = slot 0 + slot 1 + ... + slot G-1, then out + acc, element by element, in
    # blocks of REDUCE_BLOCK values added as vectors (the same sums as one value at a time)
    cdef floating acc[REDUCE_BLOCK]
    cdef idx_t b0 = 0, nb, g
    while b0 < n:
        nb = min(<idx_t>REDUCE_BLOCK, n - b0)
        memcpy(acc, slots + b0, nb * sizeof(floating))
        for g in range(1, G):
            if floating is float:
                mx_add_f(acc, slots + g * nv + b0, nb)
            else:
                mx_add_d(acc, slots + g * nv + b0, nb)
        if floating is float:
            mx_add_f(out + b0, acc, nb)
        else:
            mx_add_d(out + b0, acc, nb)
        b0 += nb


cdef void _reduce_slots(floating** dst, const idx_t* starts, idx_t j0, idx_t j1,
                        const floating* slots, const step_ctx* c, int nt) noexcept nogil:
    # dst[j] += the sum of the G slots' array j (slots (G, nv), array j at starts[j]) in
    # group order, for arrays j0 .. j1-1, in pieces of REDUCE_PIECE values
    cdef idx_t lo0 = starts[j0], n = starts[j1] - lo0, G = c.G, nv = c.nv
    cdef idx_t nchunks = (n + REDUCE_PIECE - 1) // REDUCE_PIECE
    cdef idx_t ch, lo, hi, j, end
    for ch in prange(nchunks, schedule='static',
                     num_threads=mx_team(nt, n * G, MIN_REDUCE_VALUES, nchunks)):
        lo = lo0 + ch * REDUCE_PIECE
        hi = min(lo + REDUCE_PIECE, lo0 + n)
        j = j0
        while starts[j + 1] <= lo:
            j = j + 1
        while lo < hi:
            end = min(hi, starts[j + 1])
            _reduce_run(dst[j] + (lo - starts[j]), slots + lo, nv, G, end - lo)
            lo = end
            j = j + 1


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
    # model.pxd. The work runs as step_ctx.G sequence groups (above); the buffers:
    #   ws      (G, region.size)   each group's workspace (this thread's reused buffer)
    #   slots   (G, nv)            each group's gradients (G > 1 only): the head's arrays,
    #                              then one layer's, laid out as dst
    #   ptrs    (G, na)            each group's gradient arrays, na = 3 + n_layers x
    #                              MAMBA_NPARAMS: into its slot (every layer's into the
    #                              same layer part), or the caller's when G = 1
    #   dst     (SLOT_ARRAYS,)     the caller's head arrays, then the layer's being
    #                              summed; starts (SLOT_ARRAYS + 1,) their offsets in a slot
    #   row_loss (M,) double; status (G,)
    cdef idx_t M = d.block.B * d.block.L, nl = d.n_layers
    cdef idx_t na = SLOT_HEAD + nl * MAMBA_NPARAMS
    cdef idx_t g, i, j, r
    cdef idx_t starts[SLOT_ARRAYS + 1]
    cdef int nt = mx_threads(n_threads), status = MODEL_OK
    cdef double total
    cdef step_ctx c
    cdef region rg
    if M == 0:
        return MODEL_ERR_EMPTY
    if _check_ids(tokens, M, d.V) != MODEL_OK or _check_ids(targets, M, d.V) != MODEL_OK:
        return MODEL_ERR_TOKEN
    c.k = d.block.B if states != NULL else group_seqs(d, checkpointing)
    c.G = n_of_groups(d, c.k)
    _slot_starts(d, starts)
    c.nv = starts[SLOT_ARRAYS]
    c.head_values = starts[SLOT_HEAD]
    c.checkpointing = checkpointing
    c.seed_scale = loss_scale / <double>M
    c.states = states
    rg = _region(d, c.k, checkpointing)

    cdef floating* ws = <floating*>mx_workspace(c.G * rg.size * sizeof(floating))
    c.row_loss = <double*>malloc(M * sizeof(double))
    c.status = <int*>malloc(c.G * sizeof(int))
    cdef floating** ptrs = <floating**>malloc((c.G * na + SLOT_ARRAYS) * sizeof(floating*))
    cdef floating* slots = <floating*>malloc(c.G * c.nv * sizeof(floating)) if c.G > 1 else NULL
    cdef floating** dst
    if (ws == NULL or c.row_loss == NULL or c.status == NULL or ptrs == NULL
            or (c.G > 1 and slots == NULL)):
        free(c.row_loss)
        free(c.status)
        free(ptrs)
        free(slots)
        return MODEL_ERR_NOMEM
    dst = ptrs + c.G * na
    dst[0] = g_embedding
    dst[1] = g_final_norm
    dst[2] = g_lm_head_bias
    for g in range(c.G):
        for j in range(na):
            if c.G == 1:
                ptrs[j] = dst[j] if j < SLOT_HEAD else g_layer_params[j - SLOT_HEAD]
            else:
                ptrs[g * na + j] = slots + g * c.nv + starts[
                    j if j < SLOT_HEAD else SLOT_HEAD + (j - SLOT_HEAD) % MAMBA_NPARAMS]
    # the forward, the loss and the head's backward
    status = _run_phase(PHASE_FORWARD, ws, &rg, ptrs, na, &c, tokens, targets, embedding,
                        final_norm, lm_head_bias, layer_params, d, 0, nt)
    if status == MODEL_OK:
        total = 0.0
        for r in range(M):          # fixed order: deterministic loss
            total += c.row_loss[r]
        loss[0] = total / <double>M
        if c.G > 1:
            _reduce_slots(dst, starts, 0, SLOT_HEAD, slots, &c, nt)
        if grads_done != NULL:
            grads_done(ctx, nl)
    # the layers' backward, last first
    i = nl - 1
    while i >= 0 and status == MODEL_OK:
        status = _run_phase(PHASE_LAYER, ws, &rg, ptrs, na, &c, tokens, targets, embedding,
                            final_norm, lm_head_bias, layer_params, d, i, nt)
        if status == MODEL_OK:
            if c.G > 1:
                for j in range(MAMBA_NPARAMS):
                    dst[SLOT_HEAD + j] = g_layer_params[i * MAMBA_NPARAMS + j]
                _reduce_slots(dst, starts, SLOT_HEAD, SLOT_ARRAYS, slots, &c, nt)
            if grads_done != NULL:
                grads_done(ctx, i)
        i -= 1
    # the lookup's backward
    if status == MODEL_OK:
        status = _run_phase(PHASE_LOOKUP, ws, &rg, ptrs, na, &c, tokens, targets, embedding,
                            final_norm, lm_head_bias, layer_params, d, 0, nt)
        if status == MODEL_OK and c.G > 1:
            _reduce_slots(dst, starts, 0, 1, slots, &c, nt)
    free(c.row_loss)
    free(c.status)
    free(ptrs)
    free(slots)
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


def _set_group_rows(idx_t n):
    """Testing hook: the rows of a sequence group at least (0: the default, 256); returns
    the previous value. Not thread-safe: for tests and benchmarks only."""
    global group_rows
    cdef idx_t old = group_rows
    group_rows = n if n > 0 else GROUP_ROWS
    return old


def sequence_groups(sizes, bint checkpointing=False):
    """(groups, sequences a group) of a loss-and-grads call of sizes (V, n_layers, B, L, Dm,
    D, N, K, R) without state passing (see "Sequence groups"); (1, B) when the call runs as
    one pass over the batch."""
    cdef model_dims d = _dims(sizes, DEFAULT_EPS)
    cdef idx_t k = group_seqs(&d, checkpointing)
    return n_of_groups(&d, k), k


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
