# C-level contract of one Mamba-1 block (see types.pxd for the size letters).
#
# Parameters are passed as an array of 13 pointers in BLOCK_PARAM_NAMES order
# (the enum below); each points to a C-contiguous buffer of the golden shape.
# All functions are callable without the GIL and report failure (only: out of
# memory for internal scratch) by a non-zero return value, never by a crash.
from mamba_ext.cpu.types cimport floating, idx_t

cdef enum:
    MAMBA_NPARAMS = 13

cdef enum:                 # index into the 13-pointer parameter arrays
    P_wInProj = 0          # (2D, Dm)
    P_bInProj = 1          # (2D,)
    P_wConv = 2            # (D, K)   tap k multiplies x[t-k]
    P_bConv = 3            # (D,)
    P_wXProj = 4           # (P, D)
    P_bXProj = 5           # (P,)
    P_wDtProj = 6          # (D, R)
    P_bDtProj = 7          # (D,)
    P_A_log = 8            # (D, N)
    P_D_vec = 9            # (D,)
    P_wOutProj = 10        # (Dm, D)
    P_bOutProj = 11        # (Dm,)
    P_normWeight = 12      # (Dm,)

ctypedef struct mamba_dims:
    idx_t B     # batch
    idx_t L     # seqLen
    idx_t Dm    # dModel
    idx_t D     # dInner
    idx_t N     # dState
    idx_t K     # dConv
    idx_t R     # dtRank
    double eps          # RMSNorm epsilon (DEFAULT_EPS = 1e-6 in the golden semantics)
    int discretization  # 0: exact ZOH (default); 1: Euler, b_bar = delta*Bs

cdef enum:                 # flat_op's operations
    FLAT_ZERO = 0          # out = 0 (a unused)
    FLAT_COPY = 1          # out = a
    FLAT_ADD = 2           # out += a

# out (n,) = 0, = a or += a (a (n,) must not overlap out), split among up to nt threads
# (nt <= 0: OpenMP's default); the results do not depend on nt.
cdef void flat_op(int op, floating* out, const floating* a, idx_t n, int nt) noexcept nogil

# Number of `floating` elements of the forward cache for these sizes.
cdef idx_t block_cache_len(const mamba_dims* d) noexcept nogil

# Number of elements of parameter j (P_wInProj .. P_normWeight: the shapes above).
cdef idx_t block_param_len(const mamba_dims* d, int j) noexcept nogil

# out (B, L, Dm) written; cache (block_cache_len) written; x (B, L, Dm) read.
cdef int block_forward(floating* out, floating* cache,
                       const floating* x, const floating** params,
                       const mamba_dims* d, int n_threads) noexcept nogil

# dx (B, L, Dm) and grads[i] (shape of params[i]) ACCUMULATE (+=);
# dout (B, L, Dm) and cache (from block_forward with the same params) read.
cdef int block_backward(floating* dx, floating** grads,
                        const floating* dout, const floating* cache,
                        const floating** params,
                        const mamba_dims* d, int n_threads) noexcept nogil

# block_forward with state passing; each of the four state pointers may be NULL.
# h0 (B, D, N): scan state before step 0 (NULL: zeros); conv_state (B, D, K-1): the
# in_proj x-half (xc) of the K-1 steps before x, oldest first (NULL: zeros);
# h_last (B, D, N), conv_tail (B, D, K-1) written (when not NULL) with the same after
# the last step, to be passed as h0 / conv_state of the next chunk.
cdef int block_forward_state(floating* out, floating* cache,
                             floating* h_last, floating* conv_tail,
                             const floating* x, const floating** params,
                             const floating* h0, const floating* conv_state,
                             const mamba_dims* d, int n_threads) noexcept nogil

# block_backward with state passing: dh0 (B, D, N), dconv_state (B, D, K-1) ACCUMULATE
# (NULL: not wanted); dh_last, dconv_tail: dLoss/d of the forward's h_last, conv_tail
# (NULL: 0); conv_state: the forward's (NULL: zeros; h0 is kept in the cache).
cdef int block_backward_state(floating* dx, floating** grads,
                              floating* dh0, floating* dconv_state,
                              const floating* dout, const floating* dh_last,
                              const floating* dconv_tail, const floating* cache,
                              const floating** params, const floating* conv_state,
                              const mamba_dims* d, int n_threads) noexcept nogil
