# C-level contract of the whole Mamba-1 language model (see types.pxd for the
# size letters; V = vocab size, n_layers blocks sharing one set of dims).
#
#   h0[r] = embedding[tokens[r]]                 # (M, Dm)
#   h_{i+1} = Block_i(h_i)                       # block.pxd, i = 0 .. n_layers-1
#   xn = RMSNorm(h_last; final_norm, eps)        # (M, Dm)
#   logits = xn @ embedding^T + lm_head_bias     # (M, V), head tied to the table
#   loss = mean_r (logsumexp(logits[r]) - logits[r, targets[r]])
#
# Layer parameters are ONE flat array of n_layers * MAMBA_NPARAMS pointers:
# layer i, parameter j (BLOCK_PARAM_NAMES order, block.pxd enum) is
# layer_params[i * MAMBA_NPARAMS + j]; the gradients use the same layout.
# Token ids are int64, C-contiguous (B, L); every float buffer is C-contiguous.
# All functions run without the GIL and never crash on bad token ids: they
# return a status (MODEL_OK, or one of the MODEL_ERR_* codes) instead.
from libc.stdint cimport int64_t
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.block cimport mamba_dims

cdef enum:
    MODEL_OK = 0
    MODEL_ERR_NOMEM = 1     # workspace allocation (or a block's scratch) failed
    MODEL_ERR_TOKEN = 2     # a token or target id outside [0, V)
    MODEL_ERR_EMPTY = 3     # loss of zero positions (B*L == 0) is undefined

ctypedef struct model_dims:
    idx_t V             # vocab size (rows of the embedding table)
    idx_t n_layers      # number of blocks (>= 0)
    mamba_dims block    # B, L, Dm, D, N, K, R, eps (every RMSNorm), discretization

# h (M, Dm) = embedding (V, Dm) [tokens (M,)]; ids must be in [0, V) (not checked here).
cdef void embedding_forward(floating* h, const int64_t* tokens, const floating* embedding,
                            idx_t M, idx_t Dm) noexcept nogil

# dembedding (V, Dm) [tokens[r]] += dh (M, Dm) [r] (in row order: deterministic).
cdef void embedding_backward(floating* dembedding, const floating* dh, const int64_t* tokens,
                             idx_t M, idx_t Dm) noexcept nogil

# Cross-entropy of M rows of logits (M, V) against targets (M,) in one pass: row_loss (M,)
# written (double, logsumexp - picked); logits overwritten in place by
# (softmax - onehot(target)) * seed_scale (seed_scale = loss_scale / M for the mean loss).
# exp in the buffer's precision, sums in double; rows in parallel (n_threads, <= 0 default).
cdef void cross_entropy_forward_backward(double* row_loss, floating* logits,
                                         const int64_t* targets, idx_t M, idx_t V,
                                         double seed_scale, int n_threads) noexcept nogil

# Bytes of the internal workspace model_loss_and_grads uses for these sizes and
# element size (the calling thread's reused buffer, kept and grown across calls,
# freed when the thread exits); checkpointing != 0 keeps one block cache instead of
# n_layers (layer inputs are kept in both modes).
cdef size_t model_workspace_bytes(const model_dims* d, int checkpointing,
                                  size_t itemsize) noexcept nogil

# logits (B, L, V) written; tokens (B, L) read.
cdef int model_forward(floating* logits, const int64_t* tokens,
                       const floating* embedding, const floating* final_norm,
                       const floating* lm_head_bias, const floating** layer_params,
                       const model_dims* d, int n_threads) noexcept nogil

# *loss written (mean cross-entropy, accumulated in double; NOT multiplied by
# loss_scale). Gradients ACCUMULATE (+=) into g_embedding (V, Dm) (both the
# head and the lookup contribution), g_final_norm (Dm,), g_lm_head_bias (V,)
# and g_layer_params (flat layout above); the gradient seed dLoss/dlogits is
# multiplied by loss_scale (mixed-precision loss scaling; 1.0 otherwise).
# checkpointing != 0: keep only each layer's input and recompute the block
# cache in the backward pass; the gradients are bit-identical.
cdef int model_loss_and_grads(double* loss,
                              floating* g_embedding, floating* g_final_norm,
                              floating* g_lm_head_bias, floating** g_layer_params,
                              const int64_t* tokens, const int64_t* targets,
                              const floating* embedding, const floating* final_norm,
                              const floating* lm_head_bias, const floating** layer_params,
                              const model_dims* d, double loss_scale, int checkpointing,
                              int n_threads) noexcept nogil

# model_forward / model_loss_and_grads with state passing per layer: `states` is NULL
# (same as the functions above) or a table of 4 * n_layers pointers; layer i's are
# states[4i + 0] h0 (B, D, N), [4i + 1] conv_state (B, D, K-1) (read), [4i + 2] h_last
# (B, D, N), [4i + 3] conv_tail (B, D, K-1) (written), each NULL or a buffer as in
# block_forward_state (block.pxd). The gradients treat h0 and conv_state as constants
# (truncated backpropagation through time).
cdef int model_forward_state(floating* logits, const int64_t* tokens,
                             const floating* embedding, const floating* final_norm,
                             const floating* lm_head_bias, const floating** layer_params,
                             void** states, const model_dims* d, int n_threads) noexcept nogil

# grads_done(ctx, i), when not NULL, is called on the calling thread (outside any parallel
# region) as soon as gradients are final: i = n_layers for g_final_norm and g_lm_head_bias
# (after the head's backward), then i = n_layers-1 .. 0 for layer i's; g_embedding is final
# when the function returns. E.g. data parallelism starts each all-reduce then.
ctypedef void (*grads_done_fn)(void* ctx, idx_t i) noexcept nogil

cdef int model_loss_and_grads_state(double* loss,
                                    floating* g_embedding, floating* g_final_norm,
                                    floating* g_lm_head_bias, floating** g_layer_params,
                                    const int64_t* tokens, const int64_t* targets,
                                    const floating* embedding, const floating* final_norm,
                                    const floating* lm_head_bias, const floating** layer_params,
                                    void** states, const model_dims* d, double loss_scale,
                                    int checkpointing, int n_threads,
                                    grads_done_fn grads_done, void* ctx) noexcept nogil
