"""BlockCache (issue 13, point 3): read-only attributes, a backward that re-validates the
cache before any kernel reads it, and a parameter fingerprint that covers every value."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import mamba_ext

fwd, bwd = mamba_ext.mamba1_forward, mamba_ext.mamba1_backward


def _case(B=2, L=70, Dm=8, dtype=np.float32):
    p = mamba_ext.init_mamba1_params(Dm, d_state=4, d_conv=3, dtype=dtype, seed=1)
    x = np.random.default_rng(0).standard_normal((B, L, Dm)).astype(dtype)
    return x, p


def test_public_attributes_are_read_only():
    x, p = _case()
    _, cache = fwd(x, p, conv_state=np.zeros((2, 16, 2), np.float32))
    for name in ("buffer", "dims", "dtype", "x_shape", "eps", "discretization", "fingerprint",
                 "has_h0", "conv_state"):
        with pytest.raises(AttributeError):
            setattr(cache, name, getattr(cache, name))
    with pytest.raises(ValueError, match="read-only"):
        cache.buffer[0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        cache.conv_state[...] = 1.0
    bwd(np.ones_like(x), p, cache)              # still usable


_EDITS = r"""
import json, sys
import numpy as np
import mamba_ext
from mamba_ext._validate import BlockDims
x = np.ones((2, 70, 8), np.float32)
p = mamba_ext.init_mamba1_params(8, d_state=4, d_conv=3, seed=1)
out = {}
edits = {
    "x_shape": lambda c: setattr(c, "_x_shape", (2, 7000, 8)),
    "x_shape_type": lambda c: setattr(c, "_x_shape", [2, 70, 8]),
    "buffer_small": lambda c: setattr(c, "_buffer", c._buffer[:10].copy()),
    "buffer_dtype": lambda c: setattr(c, "_buffer", c._buffer.astype(np.float64)),
    "buffer_strided": lambda c: setattr(c, "_buffer", np.repeat(c._buffer, 2)[::2]),
    "dims": lambda c: setattr(c, "_dims", BlockDims(8, 16, 40, 3, 1)),
    "conv_state": lambda c: setattr(c, "_conv_state", np.zeros((2, 16, 7), np.float32)),
    "discretization": lambda c: setattr(c, "_discretization", "bilinear"),
}
for name, edit in edits.items():
    _, cache = mamba_ext.mamba1_forward(x, p)
    try:
        edit(cache)                       # a plain assignment is refused at once
        out[name] = "assigned"
    except AttributeError as e:
        out["assign " + name] = "AttributeError: " + str(e)
    # circumventing that (object.__setattr__) is caught by the backward's re-validation
    setattr_ = lambda c, k, v: object.__setattr__(c, k, v)
    globals()["setattr"] = setattr_
    edit(cache)
    del globals()["setattr"]
    try:
        mamba_ext.mamba1_backward(np.ones_like(x), p, cache)
        out[name] = "accepted"
    except (TypeError, ValueError) as e:
        out[name] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def test_an_edited_cache_is_refused_never_read_out_of_bounds():
    r = subprocess.run([sys.executable, "-c", _EDITS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"crashed (exit {r.returncode}): {r.stderr[-2000:]}"
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for name, what in results.items():
        if name.startswith("assign "):
            assert what.startswith("AttributeError") and "read-only" in what, (name, what)
        else:
            assert what.startswith("ValueError") and "cache" in what, (name, what)
    assert sum(n.startswith("assign ") for n in results) == 8


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fingerprint_sees_an_edit_of_any_single_value(dtype):
    """The old fingerprint sampled 8192 strided values of a large array; an edit between
    two samples went unnoticed. Now every value counts."""
    p = mamba_ext.init_mamba1_params(64, d_state=16, dtype=dtype, seed=2)   # wInProj: 16384 values
    x = np.random.default_rng(1).standard_normal((1, 5, 64)).astype(dtype)
    assert p["wInProj"].size > 8192
    for index in (1, 3, p["wInProj"].size - 2):
        _, cache = fwd(x, p)
        flat = p["wInProj"].reshape(-1)
        old = flat[index]
        flat[index] = np.nextafter(old, dtype(np.inf))       # the smallest possible edit
        with pytest.raises(ValueError, match=r"values of \['wInProj'\] differ"):
            bwd(np.ones_like(x), p, cache)
        flat[index] = old
        bwd(np.ones_like(x), p, cache)                       # restored: accepted again


@pytest.mark.parametrize("name", ["wInProj", "A_log", "wXProj"])
def test_fingerprint_sees_two_values_swapped(name):
    """A sum of the bytes misses a swap of two values (issue 27, point 5): the fingerprint
    is an order-dependent hash of every byte."""
    p = mamba_ext.init_mamba1_params(16, d_state=4, seed=2)
    x = np.random.default_rng(1).standard_normal((1, 5, 16)).astype(np.float32)
    flat = p[name].reshape(-1)
    i, j = 0, flat.size - 1
    assert flat[i] != flat[j]
    _, cache = fwd(x, p)
    flat[[i, j]] = flat[[j, i]]
    with pytest.raises(ValueError, match=rf"values of \['{name}'\] differ"):
        bwd(np.ones_like(x), p, cache)
    flat[[i, j]] = flat[[j, i]]
    bwd(np.ones_like(x), p, cache)


def test_hash_depends_on_every_byte_and_its_place():
    from mamba_ext.cpu import block as _blk
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 31, 32, 33, 1000, (1 << 20) + 5, 3 << 20):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        h = _blk.hash_bytes(a)
        assert _blk.hash_bytes(a.copy()) == h
        if n >= 2:
            for k in {0, n // 2, n - 1}:
                b = a.copy()
                b[k] ^= 1
                assert _blk.hash_bytes(b) != h, (n, k)
            b = a.copy()
            b[0], b[-1] = a[-1], a[0]
            assert a[0] == a[-1] or _blk.hash_bytes(b) != h


def test_cache_memory_cannot_be_made_writeable():
    """The buffer and conv_state live in memory NumPy cannot re-flag writeable (issue 27,
    point 5): not through the view, not through its base, not through the private slot."""
    x, p = _case()
    _, cache = fwd(x, p, conv_state=np.zeros((2, 16, 2), np.float32))
    for a in (cache.buffer, cache.buffer.base, cache._buffer, cache.conv_state,
              cache._conv_state, cache.buffer[3:]):
        if not isinstance(a, np.ndarray):
            continue
        with pytest.raises(ValueError, match="WRITEABLE"):
            a.flags.writeable = True
    with pytest.raises(AttributeError, match="read-only"):
        cache._discretization = "euler"


def test_cache_pool_reuses_a_freed_buffer_and_changes_no_result():
    """The cache pool (block.pyx): a cache of >= 1 MiB freed by its arrays is handed to
    the next forward of that size, the results are those of fresh memory bit for bit,
    and a live cache's buffer is never handed out."""
    from mamba_ext.cpu import block as _blk
    old = _blk.cache_pool()[1]
    try:
        x, p = _case(B=2, L=700, Dm=64)
        dout = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
        _blk.cache_pool(0)                           # nothing kept: fresh memory
        out0, cache0 = fwd(x, p)
        assert cache0.buffer.nbytes >= 1 << 20
        dx0, g0 = bwd(dout, p, cache0)
        del cache0
        assert _blk.cache_pool() == (0, 0)
        _blk.cache_pool(64 << 20)
        x2 = (x * 3).astype(np.float32)              # other contents first
        _, c2 = fwd(x2, p)
        addr, nbytes = c2.buffer.ctypes.data, c2.buffer.nbytes
        _, live = fwd(x2, p)
        assert live.buffer.ctypes.data != addr       # both alive: two buffers
        del c2
        assert _blk.cache_pool()[0] == nbytes        # kept, not freed
        out1, cache1 = fwd(x, p)
        assert cache1.buffer.ctypes.data == addr     # the freed one, reused
        assert _blk.cache_pool()[0] == 0
        dx1, g1 = bwd(dout, p, cache1)
        assert np.array_equal(out0, out1) and np.array_equal(dx0, dx1)
        assert all(np.array_equal(g0[n], g1[n]) for n in g0)
        del live, cache1
        held = _blk.cache_pool()[0]
        assert 0 < held <= 64 << 20
        _blk.cache_pool(held - 1)                    # a lower limit frees down to it
        assert _blk.cache_pool()[0] <= held - 1
    finally:
        _blk.cache_pool(old)


def test_cache_pool_holds_at_most_its_limit():
    from mamba_ext.cpu import block as _blk
    old = _blk.cache_pool()[1]
    try:
        _blk.cache_pool(6 << 20)
        for L in (300, 700, 1100, 500, 900):         # caches of ~1.4-5 MiB, freed at once
            x, p = _case(B=2, L=L, Dm=64)
            fwd(x, p)
            assert 0 < _blk.cache_pool()[0] <= 6 << 20
        for bad in (-1, 1.5, "1", True):
            with pytest.raises(ValueError, match="limit"):
                _blk.cache_pool(bad)
    finally:
        _blk.cache_pool(old)
