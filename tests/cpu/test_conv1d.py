"""Depthwise causal conv1d step (mamba_ext.cpu.steps.conv1d_forward / conv1d_backward)
against the float64 reference step (mamba_ext.testing.reference.conv1d_forward).
Size letters: B batch, L seqLen, D channels, K taps. D = 70: a full job of 64 channels
and a partial one; K = 11: two tap passes of 8 and 3."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.testing import reference as ref

SIZES = [(2, 13, 70, 4), (1, 3, 5, 11), (3, 1, 64, 1)]


def _case(rng, B, L, D, K):
    return rng.standard_normal((B, L, D)), rng.standard_normal((D, K)), rng.standard_normal(D)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_forward_matches_reference(rng, sizes, dtype, tol):
    xc, w, b = (a.astype(dtype) for a in _case(rng, *sizes))
    conv = np.full_like(xc, np.nan)
    steps.conv1d_forward(conv, xc, w, b)
    want = ref.conv1d_forward(*(a.astype(np.float64) for a in (xc, w, b)))
    np.testing.assert_allclose(conv, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("sizes", SIZES)
def test_backward_matches_finite_differences(rng, vjp_check, sizes):
    xc, w, b = _case(rng, *sizes)
    dconv = rng.standard_normal(xc.shape)
    dxc, dw, db = np.zeros_like(xc), np.zeros_like(w), np.zeros_like(b)
    steps.conv1d_backward(dxc, dw, db, dconv, xc, w)
    vjp_check(ref.conv1d_forward, {"xc": xc, "weight": w, "bias": b},
              {"xc": dxc, "weight": dw, "bias": db}, dconv)


def test_bad_arguments_are_named(rng):
    xc, w, b = _case(rng, 2, 5, 6, 3)
    conv = np.empty_like(xc)
    with pytest.raises(ValueError, match="weight"):
        steps.conv1d_forward(conv, xc, w[:-1].copy(), b)
    with pytest.raises(ValueError, match="bias"):
        steps.conv1d_forward(conv, xc, w, b[:-1].copy())
    with pytest.raises(ValueError, match="dconv"):
        steps.conv1d_backward(np.zeros_like(xc), np.zeros_like(w), np.zeros_like(b),
                              conv[:, :-1].copy(), xc, w)


def test_conv1d_reads_evenly_spaced_rows_in_place():
    """xc may be the x columns of a (B, L, 2D) array (mamba_ext.torch passes xz's x half
    without a copy): the same results as its contiguous copy; other layouts are refused."""
    from mamba_ext.cpu import steps
    rng = np.random.default_rng(5)
    B, L, D, K = 2, 9, 5, 4
    xz = rng.standard_normal((B, L, 2 * D))
    w, b, dconv = rng.standard_normal((D, K)), rng.standard_normal(D), rng.standard_normal((B, L, D))
    outs = []
    for xc in (xz[:, :, :D], np.ascontiguousarray(xz[:, :, :D])):
        conv = np.empty((B, L, D))
        steps.conv1d_forward(conv, xc, w, b)
        g = [np.zeros((B, L, D)), np.zeros((D, K)), np.zeros(D)]
        steps.conv1d_backward(*g, dconv, xc, w)
        outs.append([conv] + g)
    for a, c in zip(*outs):
        assert np.array_equal(a, c)
    with pytest.raises(ValueError, match="contiguous channels"):
        steps.conv1d_forward(np.empty((B, L, D)), xz[:, :, ::2], w, b)
    with pytest.raises(ValueError, match="follow each other"):
        steps.conv1d_forward(np.empty((B, L, D)), np.ascontiguousarray(xz.transpose(1, 0, 2))
                             .transpose(1, 0, 2)[:, :, :D], w, b)
