# Selective scan (S6) of one Mamba-1 block, forward and memory-lean backward.
# Size letters: B batch, L seqLen, D dInner, N dState; T = SCAN_CHUNK (csrc/mx_constants.h),
# C = ceil(L / T) chunks per sequence.
#
# Per sequence b and channel d, with A[d,n] = -exp(clamp(A_log[d,n], A_LOG_MIN, A_LOG_MAX)):
#   a_bar = exp(delta*A),  b_bar = (a_bar - 1)/A * Bs  (ZOH, discretization 0)
#                                 or delta * Bs          (Euler, discretization 1)
#   h[t] = a_bar*h[t-1] + b_bar*u[t] (h[-1] = 0, or h0 in scan_forward_state),
#   y[t] = sum_n Cs[t,n]*h[t,n] + D_vec*u[t]
# The forward keeps only the states entering each chunk, hstate (B, C, D, N);
# the backward recomputes the states inside one chunk at a time (per thread
# scratch of (2T+1)*N*64 values for 64 channels), so no (B, L, D, N) buffer ever
# exists. Per-thread dBs/dCs buffer of the backward: (L, 2N, 16) values; per-job
# partial sums (B, ceil(D/64), L*2N + (N+1)*64) reduced in a fixed order (deterministic).
from mamba_ext.cpu.types cimport floating, idx_t


# ceil(L / SCAN_CHUNK)
cdef idx_t scan_nchunks(idx_t L) noexcept nogil

# y (B, L, D) and hstate (B, C, D, N) written.
# u, delta (B, L, D); Bs, Cs rows of N values, ld_bc apart (e.g. columns of x_proj's output);
# A_log (D, N), D_vec (D,). Returns 0, or -1 when scratch memory cannot be allocated.
cdef int scan_forward(floating* y, floating* hstate,
                      const floating* u, const floating* delta,
                      const floating* Bs, const floating* Cs, idx_t ld_bc,
                      const floating* A_log, const floating* D_vec,
                      idx_t B, idx_t L, idx_t D, idx_t N,
                      int discretization, int n_threads) noexcept nogil

# Gradients ACCUMULATE (+=): du, ddelta (B, L, D); dBs, dCs (rows ld_bc apart);
# dA_log (D, N) (exactly 0 contribution where A_log <= A_LOG_MIN or >= A_LOG_MAX); dD_vec (D,).
# dy (B, L, D) read, plus the forward's inputs and its hstate.
cdef int scan_backward(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                       floating* dA_log, floating* dD_vec,
                       const floating* dy, const floating* hstate,
                       const floating* u, const floating* delta,
                       const floating* Bs, const floating* Cs, idx_t ld_bc,
                       const floating* A_log, const floating* D_vec,
                       idx_t B, idx_t L, idx_t D, idx_t N,
                       int discretization, int n_threads) noexcept nogil

# The same with an initial and final state (any of the four may be NULL: zeros / not
# wanted): h0 (B, D, N) the state before step 0 (hstate chunk 0 = h0); h_last (B, D, N)
# written with the state after step L-1. a_given != 0: A_log holds A itself (negative
# values, used as they are: no clamp), and the backward adds dLoss/dA to dA_log; the
# forward returns -2 (its outputs undefined) when such an A is not negative or NaN.
cdef int scan_forward_state(floating* y, floating* hstate, floating* h_last,
                            const floating* u, const floating* delta,
                            const floating* Bs, const floating* Cs, idx_t ld_bc,
                            const floating* A_log, int a_given, const floating* D_vec,
                            const floating* h0, idx_t B, idx_t L, idx_t D, idx_t N,
                            int discretization, int n_threads) noexcept nogil

# dh_last (B, D, N): dLoss/d h_last (read; NULL = 0); dh0 (B, D, N) += dLoss/d h0.
cdef int scan_backward_state(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                             floating* dA_log, floating* dD_vec, floating* dh0,
                             const floating* dy, const floating* dh_last,
                             const floating* hstate,
                             const floating* u, const floating* delta,
                             const floating* Bs, const floating* Cs, idx_t ld_bc,
                             const floating* A_log, int a_given, const floating* D_vec,
                             idx_t B, idx_t L, idx_t D, idx_t N,
                             int discretization, int n_threads) noexcept nogil

# The same, with du, ddelta, dBs, dCs written, not added to (their inputs not read; the sums
# are those into zeros); dA_log, dD_vec and dh0 are added to as above.
cdef int scan_backward_state_set(floating* du, floating* ddelta, floating* dBs, floating* dCs,
                                 floating* dA_log, floating* dD_vec, floating* dh0,
                                 const floating* dy, const floating* dh_last,
                                 const floating* hstate,
                                 const floating* u, const floating* delta,
                                 const floating* Bs, const floating* Cs, idx_t ld_bc,
                                 const floating* A_log, int a_given, const floating* D_vec,
                                 idx_t B, idx_t L, idx_t D, idx_t N,
                                 int discretization, int n_threads) noexcept nogil
