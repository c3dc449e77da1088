"""The recurrent state is the caller's: every step re-checks what the compiled step will
read and write through raw pointers, steps on the arrays the state holds at that moment,
and validates the settings assigned to it (issue 27, points 1-2)."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext import init_model_params
from mamba_ext import recurrent as rec

V = 17


@pytest.fixture(scope="module")
def params():
    return init_model_params(V, 12, 2, d_state=4, seed=3)


def _primed(params, batch=2, **kw):
    s = rec.init_state(params, batch, **kw)
    for t in range(3):
        rec.step(np.arange(batch) + t, params, s)
    return s


@pytest.mark.parametrize("slot", ["h", "conv"])
@pytest.mark.parametrize("bad, exc, match", [
    (lambda a: np.zeros((1, 1, 1), a.dtype), ValueError, "expected shape"),
    (lambda a: np.zeros(a.shape, np.float64), ValueError, "dtype"),
    (lambda a: np.frombuffer(bytes(a.nbytes), a.dtype).reshape(a.shape), ValueError, "writeable"),
    (lambda a: np.asfortranarray(np.zeros(a.shape[::-1], a.dtype).T), ValueError, "C-contiguous"),
    (lambda a: a.tolist(), TypeError, "numpy array"),
])
def test_bad_arrays_assigned_into_the_state_are_refused(params, slot, bad, exc, match):
    s = _primed(params)
    arrays = getattr(s, slot)
    before = [a.copy() for a in arrays]
    arrays[1] = bad(arrays[1])
    with pytest.raises(exc, match=rf"state\.{slot}\[1\].*{match}|{match}"):
        rec.step(np.zeros(2, int), params, s)
    np.testing.assert_array_equal(arrays[0], before[0])     # nothing was stepped


def test_wrong_number_of_layers_refused(params):
    s = _primed(params)
    s.h.pop()
    with pytest.raises(ValueError, match=r"state\.h: expected a list of 2 arrays"):
        rec.step(np.zeros(2, int), params, s)


def test_replaced_arrays_take_effect(params):
    a = _primed(params)
    b = a.copy()
    rng = np.random.default_rng(0)
    h0, c1 = rng.normal(0, 1, a.h[0].shape).astype(np.float32), \
        rng.normal(0, 1, a.conv[1].shape).astype(np.float32)
    a.h[0] = h0.copy()                # replaced: new arrays
    a.conv[1] = c1.copy()
    b.h[0][...] = h0                  # the same values written in place
    b.conv[1][...] = c1
    la, _ = rec.step(np.array([1, 2]), params, a)
    lb, _ = rec.step(np.array([1, 2]), params, b)
    np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(a.h[0], h0)          # the new array is the one stepped


def test_settings_are_validated_and_used(params):
    s = _primed(params)
    with pytest.raises(ValueError, match="discretization"):
        s.discretization = "bilinear"
    with pytest.raises(ValueError, match="eps"):
        s.eps = 0
    with pytest.raises(AttributeError):
        s.batch = 3
    # a valid change is used by the next step: as a state made with those settings
    e = _primed(params, discretization="euler", eps=1e-3)
    z = _primed(params)
    z.h, z.conv = [a.copy() for a in e.h], [a.copy() for a in e.conv]
    z.discretization, z.eps = "euler", 1e-3
    le, _ = rec.step(np.array([4, 5]), params, e)
    lz, _ = rec.step(np.array([4, 5]), params, z)
    np.testing.assert_array_equal(le, lz)
