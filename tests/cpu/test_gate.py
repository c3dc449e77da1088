"""Gate step gated = y * silu(z) (mamba_ext.cpu.steps.gate_forward / gate_backward)
against the float64 reference step (mamba_ext.testing.reference.gate_forward).
Size letters: M rows, D dInner. D = 70 runs a vector body and a scalar tail; z spans the
float32 exp clamps (|z| up to 100)."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.testing import reference as ref


def _case(rng, M=5, D=70):
    z = rng.uniform(-30, 30, (M, D))
    z[0, :4] = [100.0, -100.0, 0.0, -0.0]
    return rng.standard_normal((M, D)), z


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-15), (np.float32, 2e-6)])
def test_forward_matches_reference(rng, dtype, tol):
    y, z = (a.astype(dtype) for a in _case(rng))
    gated = np.full_like(y, np.nan)
    steps.gate_forward(gated, y, z)
    want = ref.gate_forward(y.astype(np.float64), z.astype(np.float64))
    np.testing.assert_allclose(gated, want, rtol=tol, atol=tol * np.abs(want).max())


def test_backward_matches_finite_differences(rng, vjp_check):
    y, z = _case(rng)
    z = np.clip(z, -20, 20)              # finite differences of silu far out are all noise
    dgated = rng.standard_normal(y.shape)
    dy, dz = np.full_like(y, np.nan), np.full_like(z, np.nan)     # written, not accumulated
    steps.gate_backward(dy, dz, dgated, y, z)
    vjp_check(ref.gate_forward, {"y": y, "z": z}, {"y": dy, "z": dz}, dgated)


def test_float32_backward_matches_float64(rng):
    y, z = _case(rng)
    dgated = rng.standard_normal(y.shape)
    out = []
    for dt in (np.float64, np.float32):
        dy, dz = np.empty_like(y, dt), np.empty_like(z, dt)
        steps.gate_backward(dy, dz, dgated.astype(dt), y.astype(dt), z.astype(dt))
        out.append((dy, dz))
    for a64, a32 in zip(*out):
        np.testing.assert_allclose(a32, a64, rtol=1e-5, atol=1e-6 * np.abs(a64).max())


def test_bad_arguments_are_named(rng):
    y, z = _case(rng)
    with pytest.raises(ValueError, match="z"):
        steps.gate_forward(np.empty_like(y), y, z[:, :-1].copy())
    with pytest.raises(ValueError, match="dgated"):
        steps.gate_backward(np.empty_like(y), np.empty_like(z), y[:-1].copy(), y, z)
