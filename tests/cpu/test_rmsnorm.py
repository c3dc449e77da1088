"""RMSNorm step (mamba_ext.cpu.steps.rmsnorm_forward / rmsnorm_backward) against the
float64 reference step (mamba_ext.testing.reference.rmsnorm_forward).
Size letters: M rows, C columns (Dm in the block)."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.cpu.block import DEFAULT_EPS
from mamba_ext.testing import reference as ref


def _case(rng, M=7, C=33, scale=1.0):
    return rng.standard_normal((M, C)) * scale, rng.normal(1.0, 0.3, C)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-14), (np.float32, 2e-6)])
@pytest.mark.parametrize("scale", [1.0, 1e-4])          # 1e-4: eps matters
# C: the row sums run in 8 lanes (csrc/mx_activations.h, mx_row_dot2/3): fewer, a whole
# multiple, and a remainder
@pytest.mark.parametrize("C", [1, 7, 8, 33, 256])
def test_forward_matches_reference(rng, dtype, tol, scale, C):
    x, w = _case(rng, C=C, scale=scale)
    out, rstd = np.empty_like(x, dtype), np.empty(len(x), dtype)
    steps.rmsnorm_forward(out, rstd, x.astype(dtype), w.astype(dtype))
    want, want_rstd = ref.rmsnorm_forward(x.astype(dtype).astype(np.float64),
                                          w.astype(dtype).astype(np.float64), DEFAULT_EPS)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_allclose(rstd, want_rstd[:, 0], rtol=tol)


@pytest.mark.parametrize("C", [1, 7, 8, 33])
def test_backward_matches_finite_differences(rng, vjp_check, C):
    x, w = _case(rng, C=C)
    dout = rng.standard_normal(x.shape)
    out, rstd = np.empty_like(x), np.empty(len(x))
    steps.rmsnorm_forward(out, rstd, x, w, 1e-5)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    steps.rmsnorm_backward(dx, dw, dout, x, w, rstd)
    vjp_check(lambda x, w: ref.rmsnorm_forward(x, w, 1e-5)[0], {"x": x, "w": w},
              {"x": dx, "w": dw}, dout)


def test_backward_accumulates(rng):
    x, w = _case(rng)
    dout = rng.standard_normal(x.shape)
    out, rstd = np.empty_like(x), np.empty(len(x))
    steps.rmsnorm_forward(out, rstd, x, w)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    steps.rmsnorm_backward(dx, dw, dout, x, w, rstd)
    dx2, dw2 = dx.copy(), dw.copy()
    steps.rmsnorm_backward(dx2, dw2, dout, x, w, rstd)
    np.testing.assert_allclose(dx2, 2 * dx, rtol=1e-15)
    np.testing.assert_allclose(dw2, 2 * dw, rtol=1e-15)


def test_bad_arguments_are_named(rng):
    x, w = _case(rng)
    out, rstd = np.empty_like(x), np.empty(len(x))
    with pytest.raises(ValueError, match="weight"):
        steps.rmsnorm_forward(out, rstd, x, w[:-1])
    with pytest.raises(ValueError, match="rstd"):
        steps.rmsnorm_forward(out, rstd[:-1], x, w)
    with pytest.raises(ValueError, match="eps"):
        steps.rmsnorm_forward(out, rstd, x, w, -1.0)
    with pytest.raises((TypeError, ValueError), match="dtype"):      # mixed dtypes
        steps.rmsnorm_forward(out.astype(np.float32), rstd, x, w)
