# cython: language_level=3
"""Depthwise causal conv1d, forward and backward (jobs: csrc/mx_conv1d.h).

Size letters: B batch, L seqLen, D channels (dInner), K taps (dConv), M = B*L rows,
CB = MX_CONV_CB channels per job, KB = MX_CONV_KB taps per pass.

conv[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * xc[b,t-k,d]. Jobs of CB channels
run in parallel (OpenMP default thread count), each owning its channels' conv / dxc /
dweight / dbias entries (no reduction), with its taps transposed into a (KB, CB) stack
tile so every inner loop is a contiguous, vectorised pass over the CB channels. Taps
beyond KB are done in further passes (see csrc/mx_conv1d.h for why).
"""
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t

cdef extern from "csrc/mx_threads.h" nogil:
    int mx_team(int n, long long work, long long min_work, long long parts) noexcept

cdef extern from "csrc/mx_conv1d.h" nogil:
    enum: MX_CONV_CB, MX_CONV_KB
    void mx_conv1d_forward_f(float* conv, const float* xc, idx_t ld_xc, const float* weight,
                             const float* bias, idx_t B, idx_t L, idx_t D, idx_t K,
                             idx_t d0, int n, idx_t k0, int kn) noexcept
    void mx_conv1d_forward_d(double* conv, const double* xc, idx_t ld_xc, const double* weight,
                             const double* bias, idx_t B, idx_t L, idx_t D, idx_t K,
                             idx_t d0, int n, idx_t k0, int kn) noexcept
    void mx_conv1d_backward_f(float* dxc, idx_t ld_dxc, float* dweight, float* dbias,
                              const float* dconv, const float* xc, idx_t ld_xc,
                              const float* weight, idx_t B, idx_t L, idx_t D, idx_t K,
                              idx_t d0, int n, idx_t k0, int kn) noexcept
    void mx_conv1d_backward_d(double* dxc, idx_t ld_dxc, double* dweight, double* dbias,
                              const double* dconv, const double* xc, idx_t ld_xc,
                              const double* weight, idx_t B, idx_t L, idx_t D, idx_t K,
                              idx_t d0, int n, idx_t k0, int kn) noexcept


cdef void conv1d_forward(floating* conv, const floating* xc, idx_t ld_xc,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    # conv (B, L, D); xc (B*L rows, ld_xc); weight (D, K); bias (D,)
    cdef idx_t j, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn, nt = mx_team(n_threads, B * L * D * max(K, <idx_t>1), 1 << 16,
                                (D + MX_CONV_CB - 1) // MX_CONV_CB)
    if B * L * D == 0:
        return
    for j in prange((D + MX_CONV_CB - 1) // MX_CONV_CB, schedule='static', num_threads=nt):
        d0 = j * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv1d_forward_f(conv, xc, ld_xc, weight, bias, B, L, D, K, d0, n, k0, kn)
            else:
                mx_conv1d_forward_d(conv, xc, ld_xc, weight, bias, B, L, D, K, d0, n, k0, kn)


cdef void conv1d_backward(floating* dxc, idx_t ld_dxc, floating* dweight, floating* dbias,
                          const floating* dconv, const floating* xc, idx_t ld_xc,
                          const floating* weight,
                          idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    # dxc (B*L rows, ld_dxc) +=; dweight (D, K) +=; dbias (D,) +=
    # dconv (B, L, D); xc (B*L rows, ld_xc); weight (D, K)
    cdef idx_t j, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn, nt = mx_team(n_threads, B * L * D * max(K, <idx_t>1), 1 << 16,
                                (D + MX_CONV_CB - 1) // MX_CONV_CB)
    if B * L * D == 0:
        return
    for j in prange((D + MX_CONV_CB - 1) // MX_CONV_CB, schedule='static', num_threads=nt):
        d0 = j * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv1d_backward_f(dxc, ld_dxc, dweight, dbias, dconv, xc, ld_xc, weight,
                                     B, L, D, K, d0, n, k0, kn)
            else:
                mx_conv1d_backward_d(dxc, ld_dxc, dweight, dbias, dconv, xc, ld_xc, weight,
                                     B, L, D, K, d0, n, k0, kn)
