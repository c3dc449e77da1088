"""The block against the golden vectors of tests/data/golden and the float64 reference.

Golden rule (docs/semantics.md): |ours - ref| <= 2e-5 max|ref| + 1e-4 |ref|;
in *clamp* cases dx and the gradients except g_A_log get 2e-3 max|ref|; g_A_log
exactly 0 where A_log <= -10 or >= 5.
"""
import numpy as np
import pytest

import mamba_ext
from conftest import (BLOCK_GOLDEN, MODEL_GOLDEN, assert_clamped_grad_zero, assert_golden_close,
                      clamped_mask, golden_block_case, golden_tolerance, load_golden)
from mamba_ext.testing import reference
from mamba_ext.testing.gradcheck import CONFIGS, finite_differences

NAMES = mamba_ext.BLOCK_PARAM_NAMES


def _check_all(case, d, out, dx, grads):
    """Every array of the case under the golden rule; one failure lists all bad arrays."""
    failures = []
    for key, ours in [("out", out), ("dx", dx)] + [("g_" + n, grads[n]) for n in NAMES]:
        try:
            assert_golden_close(key, ours, d[key], case)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", BLOCK_GOLDEN)
def test_block_matches_golden(case, dtype):
    d = load_golden(case)
    x, params, dout = golden_block_case(d)
    x, dout = x.astype(dtype), dout.astype(dtype)
    params = {n: params[n].astype(dtype) for n in NAMES}
    out, cache = mamba_ext.mamba1_forward(x, params)
    assert out.dtype == dtype and out.shape == x.shape
    dx, grads = mamba_ext.mamba1_backward(dout, params, cache)
    assert dx.dtype == dtype and sorted(grads) == sorted(NAMES)
    _check_all(case, d, out, dx, grads)
    assert_clamped_grad_zero(grads["A_log"], params["A_log"])


def test_alog_clamp_case_has_clamped_entries_with_exact_zero_grads():
    d = load_golden("block_alog_clamp")
    x, params, dout = golden_block_case(d)
    A = params["A_log"]
    # the file really exercises both bounds, including the exact boundary values
    assert np.any(A == -10.0) and np.any(A == 5.0) and np.any(A < -10) and np.any(A > 5)
    _, cache = mamba_ext.mamba1_forward(x, params)
    _, grads = mamba_ext.mamba1_backward(dout, params, cache)
    assert assert_clamped_grad_zero(grads["A_log"], A) >= 10
    inside = ~clamped_mask(A)
    assert np.all(grads["A_log"][inside] != 0)  # the clamp is not wider than (-10, 5)


def test_realistic_init_branch_out_minus_x():
    """out ~ x there; the mixer branch out - x is checked to ~1 ulp of |out| (README note)."""
    d = load_golden("block_realistic_init")
    x, params, dout = golden_block_case(d)
    out, _ = mamba_ext.mamba1_forward(x, params)
    branch_ref = d["out"].astype(np.float64) - x
    branch = out.astype(np.float64) - x
    assert np.max(np.abs(branch_ref)) > 1e-6          # the branch is there at all
    ulp = np.spacing(np.maximum(np.abs(d["out"]), np.abs(out))).astype(np.float64)
    tol = ulp + 2e-5 * np.max(np.abs(branch_ref))
    worst = np.max(np.abs(branch - branch_ref) / tol)
    assert worst <= 1.0, f"out - x differs from golden by {worst:.3g}x the 1-ulp tolerance"


# --- the independent float64 reference (tests/reference.py) ---------------------------------

@pytest.mark.parametrize("case", BLOCK_GOLDEN)
def test_reference_matches_golden_out(case):
    """tests/reference.py itself reproduces the golden forward (README: <= 1.3e-6 max|ref|)."""
    d = load_golden(case)
    x, params, _ = golden_block_case(d)
    out = reference.block_forward(x, params)
    assert np.max(np.abs(out - d["out"])) <= 2e-6 * np.max(np.abs(d["out"]))
    assert_golden_close("out", out, d["out"], case)


@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_reference_model_matches_golden(case):
    d = load_golden(case)
    weights = {k[2:]: v for k, v in d.items() if k.startswith("w_")}
    logits, loss = reference.model_forward(d["tokens"], d["targets"], weights)
    assert_golden_close("logits", logits, d["logits"], case)
    assert_golden_close("loss", loss, d["loss"], case)


@pytest.mark.parametrize("case", [c for c in BLOCK_GOLDEN if c != "block_realistic_init"])
def test_reference_fd_gradients_match_golden(case):
    """Central differences of the reference reproduce a sample of every golden gradient.

    Validates the reference and the FD checker used by gradcheck together.
    (realistic_init is left out: its gradients of ~1e-16 are below FD resolution.)
    """
    d = load_golden(case)
    x, params, dout = golden_block_case(d)
    kink = {"A_log": (params["A_log"] == -10.0) | (params["A_log"] == 5.0)}
    fd = finite_differences(lambda t: reference.block_forward(t["x"], {n: t[n] for n in NAMES}),
                            {"x": x, **params}, dout, max_elems=4, skip=kink, seed=1)
    for name, (idx, values) in fd.items():
        key = "dx" if name == "x" else "g_" + name
        ref = d[key].reshape(-1)
        tol = golden_tolerance(key, d[key], case).reshape(-1)[idx]
        assert np.all(np.abs(values - ref[idx]) <= tol), (case, key, values, ref[idx])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_forward_float64_matches_reference(config):
    """Core float64 forward == reference to rounding, incl. euler, eps, clamp, long sequences."""
    case = CONFIGS[config]()
    out, _ = mamba_ext.mamba1_forward(case.x, case.params, **case.kwargs)
    ref = reference.block_forward(case.x, case.params, **case.kwargs)
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err <= 1e-12, f"{config}: max|out - ref| / max|ref| = {err:.3g}"


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_eps_is_used(eps):
    case = CONFIGS["tiny_input_eps"]()
    out, _ = mamba_ext.mamba1_forward(case.x, case.params, eps=eps)
    ref = reference.block_forward(case.x, case.params, eps=eps)
    default = reference.block_forward(case.x, case.params)
    assert np.max(np.abs(ref - default)) > 1e-6           # eps matters for this input
    assert np.max(np.abs(out - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_reference_windows_with_carried_state_equal_the_whole_sequence():
    """The reference's state passing (h0, conv_state, return_state), which the state
    tests of the block and model build on: two windows == one pass."""
    rng = np.random.default_rng(3)
    data = load_golden("block_basic")
    x, params, _ = golden_block_case(data)
    x = rng.standard_normal((2, 11, x.shape[2]))
    whole = reference.block_forward(x, params)
    a, h, tail = reference.block_forward(x[:, :4], params, return_state=True)
    b = reference.block_forward(x[:, 4:], params, h0=h, conv_state=tail)
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), whole, rtol=1e-12, atol=1e-12)
