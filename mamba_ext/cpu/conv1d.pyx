# cython: language_level=3
"""Depthwise causal conv1d, forward and backward (jobs: csrc/mx_conv1d.h).

Size letters: B batch, L seqLen, D channels (dInner), K taps (dConv), M = B*L rows,
CB = MX_CONV_CB channels per job, KB = MX_CONV_KB taps per pass, RB rows per job.

conv[b,t,d] = bias[d] + sum_{k<K, t-k>=0} weight[d,k] * xc[b,t-k,d]. Jobs of RB rows times
CB channels run in parallel, each with its taps transposed into a (KB, CB) stack tile so
that every inner loop is a contiguous, vectorised pass over its channels; taps beyond KB
are done in further passes (see csrc/mx_conv1d.h for why). The weight and bias gradients
are summed per row block into a scratch of partial sums, then over the blocks in order:
RB depends on M alone, so the results do not depend on the thread count.
"""
from libc.stdlib cimport free, malloc
from cython.parallel cimport prange
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.threads cimport mx_team

cdef extern from "csrc/mx_conv1d.h" nogil:
    enum: MX_CONV_CB, MX_CONV_KB
    void mx_conv1d_forward_f(float* conv, const float* xc, idx_t ld_xc, const float* weight,
                             const float* bias, idx_t L, idx_t D, idx_t K, idx_t r0, idx_t r1,
                             idx_t d0, int n, idx_t k0, int kn) noexcept
    void mx_conv1d_forward_d(double* conv, const double* xc, idx_t ld_xc, const double* weight,
                             const double* bias, idx_t L, idx_t D, idx_t K, idx_t r0, idx_t r1,
                             idx_t d0, int n, idx_t k0, int kn) noexcept
    void mx_conv1d_backward_f(float* dxc, idx_t ld_dxc, float* dw_part, float* db_part,
                              const float* dconv, const float* xc, idx_t ld_xc,
                              const float* weight, idx_t L, idx_t D, idx_t K, idx_t r0,
                              idx_t r1, idx_t d0, int n, idx_t k0, int kn, int add) noexcept
    void mx_conv1d_backward_d(double* dxc, idx_t ld_dxc, double* dw_part, double* db_part,
                              const double* dconv, const double* xc, idx_t ld_xc,
                              const double* weight, idx_t L, idx_t D, idx_t K, idx_t r0,
                              idx_t r1, idx_t d0, int n, idx_t k0, int kn, int add) noexcept
    void mx_conv1d_reduce_f(float* dweight, float* dbias, const float* dw_part,
                            const float* db_part, idx_t nblk, idx_t D, idx_t K, idx_t d0,
                            int n) noexcept
    void mx_conv1d_reduce_d(double* dweight, double* dbias, const double* dw_part,
                            const double* db_part, idx_t nblk, idx_t D, idx_t K, idx_t d0,
                            int n) noexcept

cdef enum:
    # rows per job: a multiple of 64, and at most ~MAX_BLOCKS row blocks (the partial
    # sums of the backward take MAX_BLOCKS * (K + 1) * D values at most)
    RB_UNIT = 64
    MAX_BLOCKS = 256
    # multiply-adds per thread below which another thread costs more than it saves
    MIN_WORK_PER_THREAD = 1 << 16


cdef inline idx_t rows_per_job(idx_t M) noexcept nogil:
    # a function of M alone: it fixes the order of the gradient sums
    return RB_UNIT * max(<idx_t>1, (M + RB_UNIT * MAX_BLOCKS - 1) // (RB_UNIT * MAX_BLOCKS))


cdef void conv1d_forward(floating* conv, const floating* xc, idx_t ld_xc,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    # conv (B, L, D); xc (B*L rows, ld_xc); weight (D, K); bias (D,)
    cdef idx_t M = B * L, rb = rows_per_job(M), nblk = (M + rb - 1) // rb
    cdef idx_t ncb = (D + MX_CONV_CB - 1) // MX_CONV_CB
    cdef idx_t j, r0, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn, nt
    if M * D == 0:
        return
    nt = mx_team(n_threads, M * D * max(K, <idx_t>1), MIN_WORK_PER_THREAD, nblk * ncb)
    for j in prange(nblk * ncb, schedule='static', num_threads=nt):
        r0 = (j // ncb) * rb
        d0 = (j % ncb) * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv1d_forward_f(conv, xc, ld_xc, weight, bias, L, D, K, r0,
                                    min(M, r0 + rb), d0, n, k0, kn)
            else:
                mx_conv1d_forward_d(conv, xc, ld_xc, weight, bias, L, D, K, r0,
                                    min(M, r0 + rb), d0, n, k0, kn)


cdef int conv1d_backward(floating* dxc, idx_t ld_dxc, floating* dweight, floating* dbias,
                         const floating* dconv, const floating* xc, idx_t ld_xc,
                         const floating* weight,
                         idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    return backward(dxc, ld_dxc, 1, dweight, dbias, dconv, xc, ld_xc, weight, B, L, D, K,
                    n_threads)


cdef int conv1d_backward_set(floating* dxc, idx_t ld_dxc, floating* dweight, floating* dbias,
                             const floating* dconv, const floating* xc, idx_t ld_xc,
                             const floating* weight,
                             idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    return backward(dxc, ld_dxc, 0, dweight, dbias, dconv, xc, ld_xc, weight, B, L, D, K,
                    n_threads)


cdef int backward(floating* dxc, idx_t ld_dxc, int add, floating* dweight, floating* dbias,
                  const floating* dconv, const floating* xc, idx_t ld_xc,
                  const floating* weight,
                  idx_t B, idx_t L, idx_t D, idx_t K, int n_threads) noexcept nogil:
    # dxc (B*L rows, ld_dxc) += (add 1) or = (add 0: not read); dweight (D, K) +=;
    # dbias (D,) +=; dconv (B, L, D); xc (B*L rows, ld_xc); weight (D, K)
    # scratch: dw_part (nblk, K, D), db_part (nblk, D): the row blocks' partial sums
    cdef idx_t M = B * L, rb = rows_per_job(M), nblk = (M + rb - 1) // rb
    cdef idx_t ncb = (D + MX_CONV_CB - 1) // MX_CONV_CB
    cdef idx_t j, b, r0, d0, k0, kb, nkb = max(<idx_t>1, (K + MX_CONV_KB - 1) // MX_CONV_KB)
    cdef int n, kn, nt
    cdef floating* dw_part
    cdef floating* db_part
    if M * D == 0:
        return 0
    dw_part = <floating*>malloc(nblk * (K + 1) * D * sizeof(floating))
    if dw_part == NULL:
        return -1
    db_part = dw_part + nblk * K * D
    nt = mx_team(n_threads, M * D * max(K, <idx_t>1), MIN_WORK_PER_THREAD, nblk * ncb)
    for j in prange(nblk * ncb, schedule='static', num_threads=nt):
        b = j // ncb
        r0 = b * rb
        d0 = (j % ncb) * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        for kb in range(nkb):
            k0 = kb * MX_CONV_KB
            kn = <int>max(<idx_t>0, min(<idx_t>MX_CONV_KB, K - k0))  # K == 0: bias only
            if floating is float:
                mx_conv1d_backward_f(dxc, ld_dxc, dw_part + b * K * D, db_part + b * D, dconv,
                                     xc, ld_xc, weight, L, D, K, r0, min(M, r0 + rb), d0, n,
                                     k0, kn, add)
            else:
                mx_conv1d_backward_d(dxc, ld_dxc, dw_part + b * K * D, db_part + b * D, dconv,
                                     xc, ld_xc, weight, L, D, K, r0, min(M, r0 + rb), d0, n,
                                     k0, kn, add)
    nt = mx_team(n_threads, nblk * (K + 1) * D, MIN_WORK_PER_THREAD, ncb)
    for j in prange(ncb, schedule='static', num_threads=nt):
        d0 = j * MX_CONV_CB
        n = <int>min(<idx_t>MX_CONV_CB, D - d0)
        if floating is float:
            mx_conv1d_reduce_f(dweight, dbias, dw_part, db_part, nblk, D, K, d0, n)
        else:
            mx_conv1d_reduce_d(dweight, dbias, dw_part, db_part, nblk, D, K, d0, n)
    free(dw_part)
    return 0
