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
