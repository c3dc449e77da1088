"""Cross-entropy step (mamba_ext.cpu.steps.cross_entropy_forward / cross_entropy_backward,
one fused kernel as in the model) against the float64 reference step
(mamba_ext.testing.reference.cross_entropy_forward).
Size letters: M rows, V vocab."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.testing import reference as ref


def _case(rng, M=9, V=37, scale=3.0):
    logits = scale * rng.standard_normal((M, V))
    logits[0, 0] = 80.0                        # exp(80) overflows float32 without the max shift
    return logits, rng.integers(0, V, M).astype(np.int64)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-14), (np.float32, 1e-6)])
@pytest.mark.parametrize("V", [1, 7, 8, 37, 256])
def test_forward_matches_reference(rng, dtype, tol, V):
    logits, targets = _case(rng, V=V)
    # the row maxima in other places (the max runs in 8 lanes and a tail: mx_row_max), large
    # enough that exp overflows, in float64 too, unless the shift is the row's true max
    logits[1, V - 1] = 1000.0
    logits[2, V // 2] = 1001.0
    loss = steps.cross_entropy_forward(logits.astype(dtype), targets)
    want = ref.cross_entropy_forward(logits.astype(dtype).astype(np.float64), targets)
    assert abs(loss - want) <= tol * abs(want)


def test_backward_matches_finite_differences(rng, vjp_check):
    logits, targets = _case(rng, scale=1.0)
    logits[0, 0] = 5.0
    dlogits = np.full_like(logits, np.nan)
    loss = steps.cross_entropy_backward(dlogits, logits, targets)
    assert loss == steps.cross_entropy_forward(logits, targets)
    np.testing.assert_allclose(dlogits.sum(axis=1), 0.0, atol=1e-15)   # softmax - onehot
    vjp_check(lambda logits: ref.cross_entropy_forward(logits, targets), {"logits": logits},
              {"logits": dlogits})


def test_loss_scale_scales_the_gradient_exactly(rng):
    logits, targets = _case(rng)
    g1, g8 = np.empty_like(logits), np.empty_like(logits)
    steps.cross_entropy_backward(g1, logits, targets)
    steps.cross_entropy_backward(g8, logits, targets, loss_scale=8.0)
    np.testing.assert_array_equal(g8, 8.0 * g1)


def test_bad_arguments_are_named(rng):
    logits, targets = _case(rng)
    with pytest.raises(ValueError, match="targets: id"):
        steps.cross_entropy_forward(logits, np.full_like(targets, logits.shape[1]))
    with pytest.raises(ValueError, match="targets"):
        steps.cross_entropy_forward(logits, targets[:-1].copy())
    with pytest.raises(ValueError, match="zero rows"):
        steps.cross_entropy_forward(logits[:0].copy(), targets[:0].copy())
    with pytest.raises(ValueError, match="dlogits"):
        steps.cross_entropy_backward(logits[:-1].copy(), logits, targets)
