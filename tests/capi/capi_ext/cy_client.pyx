# cython: language_level=3, boundscheck=False, wraparound=False
"""A small external Cython extension that cimports the block kernels of the
INSTALLED mamba_ext (its shipped .pxd files), the way scipy.linalg.cython_blas
is used; tests/test_capi.py compiles it and runs it on golden cases.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank.
"""
import numpy as np

from mamba_ext.cpu.types cimport idx_t
from mamba_ext.cpu.block cimport (mamba_dims, MAMBA_NPARAMS, block_cache_len,
                               block_forward, block_backward)


def forward_backward(dims, x, dout, params, grads):
    """float32 block forward + backward through the cimported kernels.

    dims = (B, L, Dm, D, N, K, R); x, dout (B, L, Dm); params / grads: 13 arrays
    each (grads accumulate, zero them first). Returns (out, dx, cache_len).
    """
    cdef mamba_dims d
    d.B, d.L, d.Dm, d.D, d.N, d.K, d.R = dims
    d.eps = 1e-6
    d.discretization = 0

    cdef float[::1] xv = np.ascontiguousarray(x, np.float32).reshape(-1)
    cdef float[::1] doutv = np.ascontiguousarray(dout, np.float32).reshape(-1)
    out = np.empty(np.shape(x), np.float32)
    dx = np.zeros(np.shape(x), np.float32)
    cdef float[::1] outv = out.reshape(-1)
    cdef float[::1] dxv = dx.reshape(-1)

    # Pointer arrays in BLOCK_PARAM_NAMES order; `keep` holds the views alive.
    cdef const float* p[MAMBA_NPARAMS]
    cdef float* g[MAMBA_NPARAMS]
    cdef float[::1] v
    keep = []
    cdef int i
    for i in range(MAMBA_NPARAMS):
        v = np.ascontiguousarray(params[i], np.float32).reshape(-1)
        keep.append(v)
        p[i] = &v[0]
        if grads[i].dtype != np.float32 or not grads[i].flags.c_contiguous:
            raise ValueError("grads: float32 C-contiguous arrays expected")
        v = grads[i].reshape(-1)      # a view: the kernels accumulate into grads[i]
        keep.append(v)
        g[i] = &v[0]

    cdef idx_t n_cache = block_cache_len(&d)
    cdef float[::1] cache = np.empty(n_cache, np.float32)
    cdef int r1, r2
    with nogil:
        r1 = block_forward(&outv[0], &cache[0], &xv[0], <const float**>p, &d, 1)
        r2 = block_backward(&dxv[0], <float**>g, &doutv[0], &cache[0],
                            <const float**>p, &d, 1)
    if r1 != 0 or r2 != 0:
        raise MemoryError(f"block kernels returned {r1}, {r2}")
    return out, dx, n_cache
