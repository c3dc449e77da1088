# cython: language_level=3
"""Depthwise causal conv1d (size letters: B batch, L seqLen, D channels, K taps).

Loops run with the channel index d innermost so every inner loop reads and
writes contiguous memory. The work (B*L*D*K multiply-adds) is small next to the
GEMMs and the scan but not negligible (~3% of size c on one thread), so blocks
of CB channels run in parallel (OpenMP default thread count); a block owns its
channels' dinp, dweight and dbias entries, so the backward needs no reduction.
"""
from cython.parallel cimport prange
from mamba_ext._types cimport floating, idx_t

cdef enum:
    CB = 64        # channels per parallel job (256 B of float32 per row)


cdef void conv1d_forward(floating* out, const floating* inp, idx_t ld_in,
                         const floating* weight, const floating* bias,
                         idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # out (B, L, D); inp (B*L rows, ld_in); weight (D, K); bias (D,)
    cdef idx_t j, b, t, k, d, r, d0, d1
    cdef floating* o
    cdef const floating* src
    for j in prange((D + CB - 1) // CB, schedule='static'):
        d0 = j * CB
        d1 = min(D, d0 + CB)
        for b in range(B):
            for t in range(L):
                r = b * L + t
                o = out + r * D
                for d in range(d0, d1):
                    o[d] = bias[d]
                for k in range(min(K, t + 1)):
                    src = inp + (r - k) * ld_in
                    for d in range(d0, d1):
                        o[d] += weight[d * K + k] * src[d]


cdef void conv1d_backward(floating* dinp, idx_t ld_dinp, floating* dweight, floating* dbias,
                          const floating* dout, const floating* inp, idx_t ld_in,
                          const floating* weight,
                          idx_t B, idx_t L, idx_t D, idx_t K) noexcept nogil:
    # dinp (B*L rows, ld_dinp) +=; dweight (D, K) +=; dbias (D,) +=
    # dout (B, L, D); inp (B*L rows, ld_in); weight (D, K)
    cdef idx_t j, b, t, k, d, r, d0, d1
    cdef const floating* g
    cdef const floating* src
    cdef floating* di
    for j in prange((D + CB - 1) // CB, schedule='static'):
        d0 = j * CB
        d1 = min(D, d0 + CB)
        for b in range(B):
            for t in range(L):
                r = b * L + t
                g = dout + r * D
                for d in range(d0, d1):
                    dbias[d] += g[d]
                for k in range(min(K, t + 1)):
                    src = inp + (r - k) * ld_in
                    di = dinp + (r - k) * ld_dinp
                    for d in range(d0, d1):
                        dweight[d * K + k] += g[d] * src[d]
                        di[d] += g[d] * weight[d * K + k]
