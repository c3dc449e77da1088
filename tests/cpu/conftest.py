"""Fixtures of the per-kernel CPU tests (tests/cpu/test_<step>.py).

``vjp_check``: a backward kernel's gradients against float64 central finite differences
of the float64 NumPy reference forward (mamba_ext.testing.reference), one random direction
per input: for loss = sum(forward(**inputs) * dout), sum(grad * v) must equal
(loss(x + eps v) - loss(x - eps v)) / (2 eps).
"""
from __future__ import annotations

import numpy as np
import pytest


def _loss(forward, inputs, dout):
    out = forward(**inputs)
    return float(np.sum(np.asarray(out, np.float64) * dout)) if dout is not None else float(out)


@pytest.fixture
def vjp_check():
    def check(forward, inputs: dict, grads: dict, dout=None, eps=1e-6, rtol=1e-7, seed=0,
              mask: dict | None = None):
        """grads[name]: the kernel's dLoss/d inputs[name]. dout None: forward returns the
        scalar loss itself. mask[name]: entries not moved (e.g. clamped A_log). Returns the
        worst relative gap; fails above rtol."""
        rng = np.random.default_rng(seed)
        worst = 0.0
        for name, g in grads.items():
            x = np.asarray(inputs[name], np.float64)
            v = rng.standard_normal(x.shape)
            if mask and name in mask:
                v = np.where(mask[name], 0.0, v)
            plus = dict(inputs, **{name: x + eps * v})
            minus = dict(inputs, **{name: x - eps * v})
            fd = (_loss(forward, plus, dout) - _loss(forward, minus, dout)) / (2 * eps)
            an = float(np.sum(np.asarray(g, np.float64) * v))
            gap = abs(an - fd) / max(1.0, abs(fd))
            worst = max(worst, gap)
            assert gap <= rtol, f"d/d{name}: kernel {an!r}, finite differences {fd!r}"
        return worst
    return check


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
