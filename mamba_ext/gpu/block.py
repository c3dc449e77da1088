"""GPU forward and backward of one Mamba-1 block, mirroring the CPU API.

``mamba1_forward(x, params)`` -> ``(out, cache)`` and
``mamba1_backward(dout, params, cache)`` -> ``(dx, grads)`` with NumPy arrays in
and out; float32 only. The cache is a :class:`GpuBlockCache` holding the GPU
buffers of the forward activations (they stay on the GPU); its plan goes back
to a pool for reuse once the cache is garbage collected.
"""
from __future__ import annotations

import weakref

import numpy as np

from .._validate import BLOCK_PARAM_NAMES, block_param_shapes, check_block_params, check_x
from .device import gpu
from .layers import BlockLayer, Scratch, block_arena

_POOL = {}          # plan key -> list of free plans
_POOL_MAX = 4       # free plans kept per key


def require_float32(name, arr):
    """float32 only on the GPU: anything else is a TypeError naming the dtype."""
    dt = getattr(arr, "dtype", None)
    if dt is not None and np.dtype(dt) != np.float32:
        raise TypeError(f"{name}: mamba_ext.gpu computes in float32 only, got dtype {np.dtype(dt)}; "
                        f"convert with .astype(np.float32) (or use the CPU API for float64)")


def _check_discretization(discretization):
    if discretization not in ("zoh", "euler"):
        raise ValueError(f"discretization: expected 'zoh' or 'euler', got {discretization!r}")


def validate_block(x, params):
    require_float32("x", x)
    for n in BLOCK_PARAM_NAMES:
        if isinstance(params, dict) and n in params:
            require_float32(n, params[n])
    xa = check_x("x", x, np.float32)
    arrays, dims = check_block_params(params, np.float32, d_model=xa.shape[2])
    return xa, arrays, dims


class _Plan:
    """Buffers and recorded ops of one block for one (dims, B, L, eps, disc)."""

    def __init__(self, dims, B, L, eps, discretization, chunk):
        g = gpu()
        self.key = (dims, B, L, eps, discretization, chunk)
        self.offs, n = block_arena(dims)
        M = B * L
        self.w = g.buffer(n, "params")
        self.gr = g.buffer(n, "grads")
        self.x = g.buffer(M * dims.Dm, "x")
        self.out = g.buffer(M * dims.Dm, "out")
        self.dout = g.buffer(M * dims.Dm, "dout")
        self.dx = g.buffer(M * dims.Dm, "dx")
        self.scratch = Scratch(g, dims, B, L, chunk)
        self.layer = BlockLayer(g, dims, B, L, self.w, self.gr, self.offs, self.x, self.out,
                                self.scratch, eps, discretization, chunk)
        self.fwd = self.layer.forward_ops()
        self.bwd = self.layer.backward_ops(self.dout, self.dx)
        self.n = n

    def upload_params(self, arrays):
        g = gpu()
        g.write(self.w, np.concatenate([arrays[k].ravel() for k in BLOCK_PARAM_NAMES]))


def _chunk():
    from . import layers
    return layers.SCAN_CHUNK


def _acquire(key):
    free = _POOL.get(key)
    if free:
        return free.pop()
    return _Plan(*key)


def _release(plan):
    free = _POOL.setdefault(plan.key, [])
    if len(free) < _POOL_MAX:
        free.append(plan)


class GpuBlockCache:
    """What the GPU forward keeps for the backward: the plan whose buffers hold
    this forward's activations (on the GPU), and the shapes."""

    def __init__(self, plan, shape):
        self.plan = plan
        self.shape = shape
        self._finalizer = weakref.finalize(self, _release, plan)

    @property
    def nbytes(self):
        return sum(b.size for b in self.plan.layer.buffers())


def mamba1_forward(x, params, *, eps=1e-6, discretization="zoh"):
    """Block forward on the GPU: ``out`` (B, L, Dm) float32 and a GPU cache."""
    _check_discretization(discretization)
    xa, arrays, dims = validate_block(x, params)
    B, L, _ = xa.shape
    if B * L == 0:
        return xa.copy(), _EmptyCache(xa.shape, dims)
    plan = _acquire((dims, B, L, float(eps), discretization, _chunk()))
    g = gpu()
    plan.upload_params(arrays)
    g.write(plan.x, xa)
    g.submit(plan.fwd)
    out = g.read(plan.out, xa.size).reshape(xa.shape)
    return out, GpuBlockCache(plan, xa.shape)


class _EmptyCache:
    """Cache of an empty batch (B*L == 0): nothing to keep."""

    def __init__(self, shape, dims):
        self.shape, self.dims, self.plan = shape, dims, None


def mamba1_backward(dout, params, cache):
    """Block backward on the GPU: ``(dx, grads)``; grads keyed like ``params``."""
    if not isinstance(cache, (GpuBlockCache, _EmptyCache)):
        raise TypeError(f"cache: expected the cache returned by mamba_ext.gpu.mamba1_forward, "
                        f"got {type(cache).__name__}")
    da, arrays, dims = validate_block(dout, params)
    if da.shape != tuple(cache.shape):
        raise ValueError(f"dout: expected shape {tuple(cache.shape)} (the forward's x), got {da.shape}")
    if cache.plan is None:
        return da.copy(), {k: np.zeros(s, np.float32) for k, s in block_param_shapes(dims).items()}
    plan = cache.plan
    if plan.key[0] != dims:
        raise ValueError(f"params: sizes {dims} differ from the forward's {plan.key[0]}")
    g = gpu()
    plan.upload_params(arrays)
    g.write(plan.dout, da)
    g.submit(plan.bwd, clears=[plan.gr])
    dx = g.read(plan.dx, da.size).reshape(da.shape)
    flat = g.read(plan.gr, plan.n)
    shapes = block_param_shapes(dims)
    grads = {k: flat[plan.offs[k]:plan.offs[k] + a.size].reshape(shapes[k]).copy()
             for k, a in arrays.items()}
    return dx, grads
