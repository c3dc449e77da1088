"""A long call runs window by window inside the core (block.pyx, "Windows"): the results
equal one window's, the state crosses the time windows, and the scratch is sized by the
window. The window's budget is lowered through a testing hook so that small sizes cross
many windows: groups of whole sequences, and time windows with a partial last one."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext import mamba1_backward, mamba1_forward
from mamba_ext.block import init_mamba1_params
from mamba_ext.cpu import block as _block


def _call(p, x, dout, **kw):
    out, cache, st = mamba1_forward(x, p, return_state=True, **kw)
    rng = np.random.default_rng(5)
    dh = rng.normal(0, 1, st[0].shape).astype(x.dtype)
    dct = rng.normal(0, 1, st[1].shape).astype(x.dtype)
    dx, g = mamba1_backward(dout, p, cache, dh_last=dh, dconv_tail=dct)
    return out, st, dx, g


def _windowed(nbytes, fn):
    old = _block._set_window_bytes(nbytes)
    try:
        return fn()
    finally:
        _block._set_window_bytes(old)


def _bytes_for(rows, p, dtype):
    # the budget that gives windows of `rows` rows (block.pyx window_rows)
    D, Dm = p["wInProj"].shape[0] // 2, p["wInProj"].shape[1]
    R, P = p["wDtProj"].shape[1], p["wXProj"].shape[0]
    return rows * (7 * D + P + 2 * R + 2 * Dm) * np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B, L, rows", [(3, 200, 64), (2, 257, 128), (5, 64, 128), (4, 100, 256)])
def test_windows_equal_one_call(dtype, B, L, rows):
    p = init_mamba1_params(24, d_state=6, seed=3, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (B, L, 24)).astype(dtype)
    dout = rng.normal(0, 1, x.shape).astype(dtype)
    D, N = p["A_log"].shape
    kw = dict(h0=rng.normal(0, 1, (B, D, N)).astype(dtype),
              conv_state=rng.normal(0, 1, (B, D, 3)).astype(dtype), n_threads=2)
    ref = _call(p, x, dout, **kw)
    sizes = (B, L, 24, D, N, 4, p["wDtProj"].shape[1])
    assert _windowed(_bytes_for(rows, p, dtype),
                     lambda: _block.window_len(sizes, np.dtype(dtype).itemsize)) == rows < B * L
    got = _windowed(_bytes_for(rows, p, dtype), lambda: _call(p, x, dout, **kw))
    # to float rounding, relative to each array's scale (the order of a few sums changes)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    pairs = [("out", ref[0], got[0]), ("h_last", ref[1][0], got[1][0]),
             ("conv_tail", ref[1][1], got[1][1]), ("dx", ref[2], got[2])]
    pairs += [(k, ref[3][k], got[3][k]) for k in ref[3]]
    for name, a, b in pairs:
        scale = max(1.0, float(np.abs(a).max()))
        err = float(np.abs(b - a).max()) / scale
        assert err <= tol, f"{name}: windowed differs by {err:.2e} of its scale"


def test_windows_match_float64_reference_of_the_whole_sequence():
    # against the independent float64 NumPy reference, not only against ourselves
    from mamba_ext.testing import reference
    p = init_mamba1_params(16, d_state=4, seed=1, dtype=np.float64)
    x = np.random.default_rng(2).normal(0, 1, (1, 300, 16))
    out = _windowed(_bytes_for(64, p, np.float64), lambda: mamba1_forward(x, p)[0])
    ref = reference.block_forward(x, p)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)
