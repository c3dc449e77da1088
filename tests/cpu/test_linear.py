"""Linear step (mamba_ext.cpu.steps.linear_forward / linear_backward, BLAS) against the
float64 reference step (mamba_ext.testing.reference.linear_forward).
Size letters: M rows, C input columns, OC output columns."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.testing import reference as ref


def _case(rng, M=9, C=13, OC=6):
    return rng.standard_normal((M, C)), rng.standard_normal((OC, C)), rng.standard_normal(OC)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-13), (np.float32, 1e-5)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_matches_reference(rng, dtype, tol, with_bias):
    x, w, b = (a.astype(dtype) for a in _case(rng))
    out = np.full((x.shape[0], w.shape[0]), np.nan, dtype)
    steps.linear_forward(out, x, w, b if with_bias else None)
    want = ref.linear_forward(x.astype(np.float64), w.astype(np.float64),
                              b.astype(np.float64) if with_bias else 0.0)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max())


def test_backward_matches_finite_differences(rng, vjp_check):
    x, w, b = _case(rng)
    dout = rng.standard_normal((x.shape[0], w.shape[0]))
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)
    steps.linear_backward(dx, dw, db, dout, x, w)
    vjp_check(ref.linear_forward, {"x": x, "weight": w, "bias": b},
              {"x": dx, "weight": dw, "bias": db}, dout)


def test_backward_skips_none_and_accumulates(rng):
    x, w, b = _case(rng)
    dout = rng.standard_normal((x.shape[0], w.shape[0]))
    dx = np.ones_like(x)
    steps.linear_backward(dx, None, None, dout, x, w)
    np.testing.assert_allclose(dx, 1.0 + dout @ w, rtol=1e-13)


# (M, IC, OC): a weight gradient formed transposed in scratch (OC < IC, OC < 192), split by
# its OC rows (OC < IC, OC >= linear.pyx's DWT_MAX_OC = 192), and one with more rows than columns
@pytest.mark.parametrize("M, C, OC", [(150, 400, 100), (150, 400, 250), (150, 100, 250)])
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_backward_weight_gradient_layouts_accumulate(rng, M, C, OC, dtype, tol):
    x, w, b = (a.astype(dtype) for a in _case(rng, M, C, OC))
    dout = rng.standard_normal((M, OC)).astype(dtype)
    dx0, dw0, db0 = (rng.standard_normal(a.shape).astype(dtype) for a in (x, w, b))
    dx, dw, db = dx0.copy(), dw0.copy(), db0.copy()
    steps.linear_backward(dx, dw, db, dout, x, w)
    d64, x64, w64 = (a.astype(np.float64) for a in (dout, x, w))
    for got, want in ((dx, dx0 + d64 @ w64), (dw, dw0 + d64.T @ x64), (db, db0 + d64.sum(0))):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_zero_width_input_gives_bias(rng):
    x, w, b = np.zeros((4, 0)), np.zeros((3, 0)), rng.standard_normal(3)
    out = np.full((4, 3), np.nan)
    steps.linear_forward(out, x, w, b)
    np.testing.assert_array_equal(out, np.broadcast_to(b, (4, 3)))


def test_bad_arguments_are_named(rng):
    x, w, b = _case(rng)
    out = np.empty((x.shape[0], w.shape[0]))
    with pytest.raises(ValueError, match="weight"):
        steps.linear_forward(out, x, w[:, :-1].copy(), b)
    with pytest.raises(ValueError, match="bias"):
        steps.linear_forward(out, x, w, b[:-1])
    with pytest.raises(ValueError, match="out"):
        steps.linear_forward(out[:, :-1].copy(), x, w, b)
    with pytest.raises(ValueError, match="dbias"):
        steps.linear_backward(None, None, b[:-1].copy(), out, x, w)
