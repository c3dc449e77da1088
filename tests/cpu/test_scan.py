"""Selective scan step (mamba_ext.cpu.steps.scan_forward / scan_backward) against the
float64 reference step (mamba_ext.testing.reference.scan_forward).

Size letters: B batch, L seqLen, D dInner, N dState, C = ceil(L / SCAN_CHUNK).
L = 150 spans three chunks of SCAN_CHUNK = 64; D = 70: a full group of 64 channel lanes
and a partial one (lane copies); A_log includes entries beyond the clamp bounds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mamba_ext.cpu import steps
from mamba_ext.cpu.block import A_LOG_MAX, A_LOG_MIN, SCAN_CHUNK
from mamba_ext.testing import reference as ref

DISCS = ["zoh", "euler"]


def _case(rng, B=2, L=150, D=70, N=3):
    A_log = rng.uniform(-2, 2, (D, N))
    A_log[0, 0], A_log[1, 1], A_log[2, 2] = A_LOG_MIN - 1, A_LOG_MAX + 1, A_LOG_MAX
    return dict(u=rng.standard_normal((B, L, D)), delta=rng.uniform(0.01, 1.0, (B, L, D)),
                Bs=rng.standard_normal((B, L, N)), Cs=rng.standard_normal((B, L, N)),
                A_log=A_log, D_vec=rng.normal(1, 0.5, D), h0=0.3 * rng.standard_normal((B, D, N)))


def _ref(u, delta, Bs, Cs, A_log, D_vec, h0, discretization):
    return ref.scan_forward(u, delta, ref.a_of(A_log), Bs, Cs, D_vec, discretization, h0)


def _run_forward(c, disc, dtype):
    a = {k: np.ascontiguousarray(v, dtype) for k, v in c.items()}
    B, L, D = a["u"].shape
    N = a["A_log"].shape[1]
    y = np.full((B, L, D), np.nan, dtype)
    hstate = np.full((B, -(-L // SCAN_CHUNK), D, N), np.nan, dtype)
    h_last = np.full((B, D, N), np.nan, dtype)
    steps.scan_forward(y, hstate, a["u"], a["delta"], a["Bs"], a["Cs"], a["A_log"], a["D_vec"],
                       disc, h0=a["h0"], h_last=h_last)
    return y, hstate, h_last, a


@pytest.mark.parametrize("disc", DISCS)
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_forward_matches_reference(rng, disc, dtype, tol):
    c = _case(rng)
    y, hstate, h_last, _ = _run_forward(c, disc, dtype)
    want_y, want_h = _ref(**c, discretization=disc)
    np.testing.assert_allclose(y, want_y, rtol=tol, atol=tol * np.abs(want_y).max())
    np.testing.assert_allclose(h_last, want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    np.testing.assert_array_equal(hstate[:, 0], c["h0"].astype(dtype))   # chunk 0 enters with h0
    # hstate[:, 1] is the reference state after the first SCAN_CHUNK steps
    T = SCAN_CHUNK
    _, h_T = _ref(**{k: (v[:, :T] if k in ("u", "delta", "Bs", "Cs") else v)
                     for k, v in c.items()}, discretization=disc)
    np.testing.assert_allclose(hstate[:, 1], h_T, rtol=tol, atol=tol * np.abs(h_T).max())


@pytest.mark.parametrize("disc", DISCS)
def test_backward_matches_finite_differences(rng, vjp_check, disc):
    c = _case(rng, L=70, D=66)
    y, hstate, h_last, a = _run_forward(c, disc, np.float64)
    dy = rng.standard_normal(y.shape)
    dh_last = rng.standard_normal(h_last.shape)
    g = {k: np.zeros_like(v) for k, v in a.items()}
    steps.scan_backward(g["u"], g["delta"], g["Bs"], g["Cs"], g["A_log"], g["D_vec"], dy, hstate,
                        a["u"], a["delta"], a["Bs"], a["Cs"], a["A_log"], a["D_vec"], disc,
                        dh_last=dh_last, dh0=g["h0"])
    clamped = (a["A_log"] <= A_LOG_MIN) | (a["A_log"] >= A_LOG_MAX)
    assert np.all(g["A_log"][clamped] == 0.0)                       # exactly, at and beyond

    def loss(**kw):
        y_, h_ = _ref(**kw, discretization=disc)
        return np.sum(y_ * dy) + np.sum(h_ * dh_last)

    vjp_check(loss, dict(c), g, mask={"A_log": clamped})


def test_bad_arguments_are_named(rng):
    c = _case(rng, L=5, D=4)
    y, hstate, _, a = _run_forward(c, "zoh", np.float64)
    args = [a[k] for k in ("u", "delta", "Bs", "Cs", "A_log", "D_vec")]
    with pytest.raises(ValueError, match="hstate"):
        steps.scan_forward(y, hstate[:, :, :-1].copy(), *args)
    with pytest.raises(ValueError, match="Cs"):
        steps.scan_forward(y, hstate, *args[:3], args[3][:, :-1].copy(), *args[4:])
    with pytest.raises(ValueError, match="discretization"):
        steps.scan_forward(y, hstate, *args, "exact")
    with pytest.raises(ValueError, match="h0"):
        steps.scan_forward(y, hstate, *args, h0=a["h0"][:1].copy())
    for bad, err in ((0, ValueError), (10 ** 9, ValueError), (2.0, TypeError)):
        with pytest.raises(err, match="n_threads"):    # never an OpenMP team of 10^9
            steps.scan_forward(y, hstate, *args, n_threads=bad)
    steps.scan_forward(y, hstate, *args, n_threads=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scan_with_A_given_equals_the_A_log_path(dtype):
    """a_given (mamba_ext.torch's path): A itself instead of A_log, no clamp. Inside the
    clamp range with A = -exp(A_log) the forward is bitwise the A_log path, and dA = dA_log / A."""
    from mamba_ext.cpu import steps
    rng = np.random.default_rng(7)
    B, L, D, N = 2, 70, 67, 3              # two chunks, a partial channel group
    u, delta, dy = (rng.standard_normal((B, L, D)).astype(dtype) for _ in range(3))
    delta = np.abs(delta) * 0.1
    Bs, Cs = (rng.standard_normal((B, L, N)).astype(dtype) for _ in range(2))
    A_log = rng.uniform(-2, 2, (D, N)).astype(dtype)
    # libm's exp, as the kernel's (NumPy's own exp may differ in the last bit)
    A = (-np.vectorize(math.exp)(A_log.astype(np.float64))).astype(dtype)
    Dv = rng.standard_normal(D).astype(dtype)
    C = (L + 63) // 64
    outs = []
    for arr, given in ((A_log, False), (A, True)):
        y, hs = np.empty_like(u), np.empty((B, C, D, N), dtype)
        steps.scan_forward(y, hs, u, delta, Bs, Cs, arr, Dv, "euler", a_given=given)
        g = [np.zeros_like(a) for a in (u, u, Bs, Cs, arr, Dv)]
        steps.scan_backward(*g, dy, hs, u, delta, Bs, Cs, arr, Dv, "euler", a_given=given)
        outs.append((y, g))
    (y0, g0), (y1, g1) = outs
    assert np.array_equal(y0, y1)
    for a, b in zip(g0[:4] + g0[5:], g1[:4] + g1[5:]):
        assert np.array_equal(a, b)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(g1[4] * A, g0[4], rtol=tol, atol=tol * np.abs(g0[4]).max())
    with pytest.raises(ValueError, match="negative"):
        steps.scan_forward(y0, np.empty((B, C, D, N), dtype), u, delta, Bs, Cs, -A, Dv, "euler",
                           a_given=True)
