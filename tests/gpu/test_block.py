"""The GPU block (mamba_ext.gpu.mamba1_forward / mamba1_backward) against the golden
files, the float64 reference and the CPU core; its API rules (the CPU's)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (BLOCK_GOLDEN, assert_clamped_grad_zero, assert_golden_close,
                      golden_block_case, load_golden)
from gpu_support import nerr, rand_params, require_gpu
from mamba_ext.testing import reference

require_gpu()
import mamba_ext  # noqa: E402
from mamba_ext import gpu as G  # noqa: E402
from mamba_ext.gpu import scan as gpu_scan  # noqa: E402

NAMES = mamba_ext.BLOCK_PARAM_NAMES


@pytest.fixture
def chunk(request, monkeypatch):
    monkeypatch.setattr(gpu_scan, "SCAN_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("chunk", [3, 32], indirect=True)
@pytest.mark.parametrize("case", BLOCK_GOLDEN)
def test_block_golden(case, chunk):
    z = load_golden(case)
    x, params, dout = golden_block_case(z)
    out, cache = G.mamba1_forward(x, params)
    dx, grads = G.mamba1_backward(dout, params, cache)
    assert_golden_close("out", out, z["out"], case)
    assert_golden_close("dx", dx, z["dx"], case)
    for n in NAMES:
        assert_golden_close("g_" + n, grads[n], z["g_" + n], case)
    assert_clamped_grad_zero(grads["A_log"], params["A_log"])


def assert_branch_close(out, x, golden_out, what):
    """The mixer branch out - x against golden_out - x, with a tolerance on the branch's
    own scale (golden rule 2e-5 * max + 1e-4 * |ref|) plus the rounding that both
    float32 outputs carry (one ulp of |out| each, half an ulp per rounding)."""
    x64 = x.astype(np.float64)
    branch, ref = out.astype(np.float64) - x64, golden_out.astype(np.float64) - x64
    rounding = np.spacing(np.maximum(np.abs(out), np.abs(golden_out)).astype(np.float32))
    tol = 2e-5 * np.max(np.abs(ref)) + 1e-4 * np.abs(ref) + rounding
    err = np.abs(branch - ref)
    assert np.all(err <= tol), (f"{what}: mixer branch off by {err.max():.3g} "
                                f"(branch scale {np.max(np.abs(ref)):.3g}, allowed {tol.max():.3g})")


def test_block_mixer_branch():
    """block_realistic_init has out ~ x (the branch is ~1e-5 of x): the golden check of
    out alone cannot see the branch, so check it by itself, against the golden and CPU."""
    case = "block_realistic_init"
    z = load_golden(case)
    x, params, _ = golden_block_case(z)
    out, _ = G.mamba1_forward(x, params)
    c_out, _ = mamba_ext.mamba1_forward(x, params)
    branch_scale = np.max(np.abs(z["out"].astype(np.float64) - x))
    assert branch_scale < 1e-4 * np.max(np.abs(x))          # the case is what it claims
    assert_golden_close("out", out, z["out"], case)
    assert_branch_close(out, x, z["out"], "GPU vs golden")
    assert_branch_close(out, x, c_out, "GPU vs CPU")
    # the check can fail: a branch 2% off (out_proj weights scaled) passes the golden
    # check of out, but not the branch check
    bad, _ = G.mamba1_forward(x, {**params, "wOutProj": params["wOutProj"] * np.float32(1.02)})
    assert_golden_close("out", bad, z["out"], case)
    with pytest.raises(AssertionError, match="mixer branch"):
        assert_branch_close(bad, x, z["out"], "perturbed")


# sizes that are multiples of no workgroup, tile or chunk size
CONFIGS = [
    # Dm, D, N, K, R, B, L, chunk, discretization
    (7, 13, 5, 3, 2, 2, 37, 8, "zoh"),
    (20, 70, 17, 4, 3, 3, 19, 5, "zoh"),
    (9, 18, 3, 2, 1, 1, 66, 64, "euler"),
    (33, 66, 16, 4, 3, 2, 29, 7, "euler"),
]


@pytest.mark.parametrize("wide", [False, True], ids=["default", "wg32-small-blocks"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_block_vs_cpu(cfg, wide, monkeypatch):
    Dm, D, N, K, R, B, L, T, disc = cfg
    monkeypatch.setattr(gpu_scan, "SCAN_CHUNK", T)
    if wide:    # the scan's other workgroup layout (tests/gpu/test_scan.py)
        for name, v in (("SCAN_WG", 32), ("SCAN_TS_FORWARD", 4), ("SCAN_TS_BACKWARD", 4),
                        ("SCAN_RB", 2)):
            monkeypatch.setattr(gpu_scan, name, v)
    params = rand_params(Dm, D, N, K, R, seed=sum(cfg[:7]))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, L, Dm)).astype(np.float32)
    dout = rng.standard_normal((B, L, Dm)).astype(np.float32)
    out, cache = G.mamba1_forward(x, params, discretization=disc)
    dx, grads = G.mamba1_backward(dout, params, cache)
    # forward against the independent float64 reference
    assert nerr(out, reference.block_forward(x, params, discretization=disc)) <= 1e-4
    # forward and backward against the CPU core (float32)
    c_out, c_cache = mamba_ext.mamba1_forward(x, params, discretization=disc)
    c_dx, c_grads = mamba_ext.mamba1_backward(dout, params, c_cache)
    assert nerr(out, c_out) <= 1e-4
    assert nerr(dx, c_dx) <= 1e-4
    for n in NAMES:
        assert nerr(grads[n], c_grads[n]) <= 1e-4, n


def test_block_every_product_split_k(monkeypatch):
    """Every product of the block split into K slices: the forward's x_proj partials in
    y (written later by the scan), the backward's in dead temporaries, the rest in the
    device scratch; the same block as the CPU's."""
    from mamba_ext.gpu import block as gblock
    from mamba_ext.gpu import linear as lin
    for name, v in (("MIN_SPLIT_K", 16), ("MIN_SPLIT_K_SHORT", 16), ("SPLIT_BELOW_TILES", 10 ** 6),
                    ("SPLIT_TARGET_GROUPS", 10 ** 6)):
        monkeypatch.setattr(lin, name, v)
    monkeypatch.setattr(gblock, "_POOL", {})
    params = rand_params(24, 48, 8, 4, 2, seed=5)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 37, 24)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    out, cache = G.mamba1_forward(x, params)
    dx, grads = G.mamba1_backward(dout, params, cache)
    splits = lambda ops: sum(op.name == "linear_split_sum" for op in ops)
    # (rows, columns, K) of every product; those with K >= 2 * MIN_SPLIT_K are split:
    # forward x_proj (K = D 48) and out_proj (K = D); in_proj (K = Dm 24) and dt_proj
    # (K = R 2) are too short
    M, D, Dm, P, R = 2 * 37, 48, 24, 2 + 2 * 8, 2
    fwd = [(M, 2 * D, Dm), (M, P, D), (M, D, R), (M, Dm, D)]
    # backward, dX then dW of out_proj, dt_proj, x_proj, in_proj: all but out_proj's dX
    # (K = Dm) and x_proj's dX (K = P 18)
    bwd = [(M, D, Dm), (Dm, D, M), (M, R, D), (D, R, M), (M, D, P), (P, D, M),
           (M, Dm, 2 * D), (2 * D, Dm, M)]
    count = lambda prods: sum(lin.split_count(G.device.gpu(), *p) > 1 for p in prods)
    assert splits(cache.plan.fwd) == count(fwd) == 2
    assert splits(cache.plan.bwd) == count(bwd) == 6
    c_out, c_cache = mamba_ext.mamba1_forward(x, params)
    c_dx, c_grads = mamba_ext.mamba1_backward(dout, params, c_cache)
    assert nerr(out, c_out) <= 1e-4 and nerr(dx, c_dx) <= 1e-4
    for n in NAMES:
        assert nerr(grads[n], c_grads[n]) <= 1e-4, n


def test_block_eps_and_discretization_change_the_result():
    params = rand_params(8, 16, 4, 3, 1, seed=2)
    x = np.random.default_rng(3).standard_normal((1, 11, 8)).astype(np.float32) * 0.01
    for kw in (dict(eps=1e-3), dict(discretization="euler")):
        out, _ = G.mamba1_forward(x, params, **kw)
        c_out, _ = mamba_ext.mamba1_forward(x, params, **kw)
        default, _ = G.mamba1_forward(x, params)
        assert nerr(out, c_out) <= 1e-4
        assert not np.allclose(out, default, rtol=0, atol=1e-7), kw


def test_backward_deterministic():
    params = rand_params(8, 16, 4, 4, 2, seed=3)
    x = np.random.default_rng(1).standard_normal((2, 21, 8)).astype(np.float32)
    runs = []
    for _ in range(2):
        out, cache = G.mamba1_forward(x, params)
        runs.append(G.mamba1_backward(x, params, cache))
    assert np.array_equal(runs[0][0], runs[1][0])
    for n in NAMES:
        assert np.array_equal(runs[0][1][n], runs[1][1][n])


def test_caches_independent():
    """Two live caches of the same shape do not share buffers."""
    params = rand_params(6, 12, 3, 3, 1, seed=5)
    rng = np.random.default_rng(2)
    x1, x2 = (rng.standard_normal((1, 9, 6)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal((1, 9, 6)).astype(np.float32)
    _, c1 = G.mamba1_forward(x1, params)
    _, c2 = G.mamba1_forward(x2, params)
    dx1, _ = G.mamba1_backward(dout, params, c1)
    _, c1b = G.mamba1_forward(x1, params)
    del c2
    dx1b, _ = G.mamba1_backward(dout, params, c1b)
    assert np.array_equal(dx1, dx1b)


def test_backward_refuses_a_foreign_cache():
    """As the CPU: other parameter values or sizes than the forward's are refused."""
    params = rand_params(6, 12, 3, 3, 1, seed=1)
    x = np.random.default_rng(0).standard_normal((1, 5, 6)).astype(np.float32)
    _, cache = G.mamba1_forward(x, params)
    other = {**params, "wConv": params["wConv"] + np.float32(0.5)}
    with pytest.raises(ValueError, match="wConv"):
        G.mamba1_backward(x, other, cache)
    bigger = rand_params(6, 14, 3, 3, 1, seed=1)
    with pytest.raises(ValueError, match="sizes"):
        G.mamba1_backward(x, bigger, cache)
    _, c_cache = mamba_ext.mamba1_forward(x, params)          # a CPU cache
    with pytest.raises(TypeError, match="cache"):
        G.mamba1_backward(x, params, c_cache)


def test_bad_inputs():
    params = rand_params(6, 12, 3, 3, 1, seed=1)
    x = np.zeros((1, 4, 6), np.float32)
    with pytest.raises(TypeError, match="float64"):
        G.mamba1_forward(x.astype(np.float64), params)
    with pytest.raises(TypeError, match="wConv"):
        G.mamba1_forward(x, {**params, "wConv": params["wConv"].astype(np.float64)})
    with pytest.raises(ValueError, match="wXProj"):
        G.mamba1_forward(x, {**params, "wXProj": params["wXProj"][:-1]})
    with pytest.raises(ValueError, match="x"):
        G.mamba1_forward(x[0], params)
    with pytest.raises(ValueError, match="discretization"):
        G.mamba1_forward(x, params, discretization="foh")
    _, cache = G.mamba1_forward(x, params)
    with pytest.raises(ValueError, match="dout"):
        G.mamba1_backward(x[:, :3], params, cache)
    with pytest.raises(TypeError, match="cache"):
        G.mamba1_backward(x, params, object())


@pytest.mark.parametrize("eps,err", [(0.0, ValueError), (-1e-6, ValueError),
                                     (float("nan"), ValueError), (float("inf"), ValueError),
                                     ("1e-6", TypeError), (True, TypeError), (None, TypeError)])
def test_eps_rule(eps, err):
    """One eps rule (mamba_ext._validate.check_eps): a finite real > 0."""
    params = rand_params(6, 12, 3, 3, 1, seed=1)
    x = np.zeros((1, 4, 6), np.float32)
    with pytest.raises(err, match="eps"):
        G.mamba1_forward(x, params, eps=eps)


def test_empty_batch():
    params = rand_params(6, 12, 3, 3, 1, seed=1)
    x = np.zeros((0, 4, 6), np.float32)
    out, cache = G.mamba1_forward(x, params)
    dx, grads = G.mamba1_backward(x, params, cache)
    assert out.shape == x.shape and dx.shape == x.shape
    assert all(not np.any(grads[n]) and grads[n].shape == params[n].shape for n in NAMES)
