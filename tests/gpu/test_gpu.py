"""WGSL kernels (mamba_ext.gpu) against the golden files, the float64 NumPy
reference and the CPU core; AdamW steps of the resident trainer against
mamba_ext.AdamW. Runs on any wgpu adapter (lavapipe in CI).

Skips only when no adapter exists AND the environment variable CI is unset;
under CI a missing adapter fails every test.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import (BLOCK_GOLDEN, MODEL_GOLDEN, assert_clamped_grad_zero, assert_golden_close,
                      golden_block_case, load_golden)
from mamba_ext.testing import reference

from mamba_ext.gpu.device import available

if not os.environ.get("CI") and not available():
    pytest.skip("no wgpu adapter (install mesa-vulkan-drivers for lavapipe); CI unset",
                allow_module_level=True)

import mamba_ext
from mamba_ext import gpu as G
from mamba_ext.gpu import layers
from mamba_ext.gpu.device import Gpu, gpu, kernel_source

NAMES = mamba_ext.BLOCK_PARAM_NAMES


def nerr(ours, ref):
    """max|ours - ref| / max|ref| (0 for an all-zero reference equal to ours)."""
    ref = np.asarray(ref, np.float64)
    d = float(np.max(np.abs(np.asarray(ours, np.float64) - ref))) if ref.size else 0.0
    s = float(np.max(np.abs(ref))) if ref.size else 0.0
    return d / s if s > 0 else d


@pytest.fixture
def chunk(request, monkeypatch):
    monkeypatch.setattr(layers, "SCAN_CHUNK", request.param)
    return request.param


def rand_params(Dm, D, N, K, R, seed, a_log_range=(-2.0, 2.0)):
    rng = np.random.default_rng(seed)
    P = R + 2 * N
    f = lambda *s, sd=1.0: (rng.standard_normal(s) * sd).astype(np.float32)
    return {
        "wInProj": f(2 * D, Dm, sd=Dm ** -0.5), "bInProj": f(2 * D, sd=0.3),
        "wConv": f(D, K, sd=(0.81 / K) ** 0.5), "bConv": f(D, sd=0.3),
        "wXProj": f(P, D, sd=D ** -0.5), "bXProj": f(P, sd=0.3),
        "wDtProj": f(D, R, sd=(0.25 / R) ** 0.5),
        "bDtProj": rng.uniform(-2, 0.5, D).astype(np.float32),
        "A_log": rng.uniform(*a_log_range, (D, N)).astype(np.float32),
        "D_vec": f(D, sd=0.5) + 1, "wOutProj": f(Dm, D, sd=D ** -0.5),
        "bOutProj": f(Dm, sd=0.3), "normWeight": f(Dm, sd=0.2) + 1,
    }


# ------------------------------------------------------------ scalar helpers
def test_helpers_match_numpy():
    """expm1 / log1p / softplus / ZOH derivative factor of common.wgsl, in a tiny kernel."""
    x = np.concatenate([np.float32(2.0) ** -np.arange(1, 40, dtype=np.float32),
                        np.linspace(-30, 30, 601, dtype=np.float32),
                        np.array([0.0, 0.4999, 0.5, -0.5, 1e-30, -1e-7], np.float32)])
    x = np.concatenate([x, -x]).astype(np.float32)
    g = gpu()
    xb, ob = g.buffer(x.size, "x", x), g.buffer(5 * x.size, "out")
    g.submit([layers.elementwise(g, "selftest", "eval_helpers", x.size, [x.size], [xb, ob], wg=64)])
    out = g.read(ob, 5 * x.size).reshape(5, x.size).astype(np.float64)
    xd = x.astype(np.float64)
    rel = lambda a, b: np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))
    # GPU exp/log may be a few ulp off and exp(x) for |x| ~ 30 carries the
    # rounding of x*log2(e): 1e-5 relative overall; near 0 the series must be
    # accurate to float32 rounding (where exp(x) - 1 would lose everything).
    near0 = np.abs(xd) < 0.5
    assert rel(out[0], np.expm1(xd)) < 1e-5
    assert rel(out[0][near0], np.expm1(xd[near0])) < 1e-6
    assert rel(out[1], np.log1p(np.abs(xd))) < 1e-5
    assert rel(out[1][near0], np.log1p(np.abs(xd[near0]))) < 1e-6
    assert rel(out[2], np.logaddexp(0.0, xd)) < 1e-5
    with np.errstate(all="ignore"):
        dfac = np.where(np.abs(xd) < 1e-3, 0.5 + xd / 3 + xd * xd / 8,
                        (xd * np.exp(xd) - np.expm1(xd)) / (xd * xd))
    small = np.abs(xd) < 20
    assert rel(out[3][small], dfac[small]) < 1e-5
    assert rel(out[4], 1.0 / (1.0 + np.exp(-xd))) < 1e-5
    # the naive single-precision form that expm1_f replaces is far off here
    tiny = np.float32(4.54e-5) * np.float32(0.1)
    assert abs((np.exp(tiny) - np.float32(1)) / tiny - 1) > 1e-3


# ----------------------------------------------------------------- golden
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
    if case == "block_realistic_init":   # the mixer branch itself (out ~ x there)
        assert np.max(np.abs((out - x) - (z["out"] - x))) <= 2.5e-7 * 4


@pytest.mark.parametrize("chunk", [2], indirect=True)
@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_model_golden(case, chunk):
    z = load_golden(case)
    params = {k[2:]: v for k, v in z.items() if k.startswith("w_")}
    loss, grads = G.model_loss_and_grads(z["tokens"], z["targets"], params)
    assert_golden_close("loss", loss, z["loss"], case)
    assert set(grads) == set(params)
    for k, v in grads.items():
        assert_golden_close("g_" + k, v, z["g_" + k], case)


# ------------------------------------------------- random configs vs CPU
# sizes that are multiples of no workgroup, tile or chunk size
CONFIGS = [
    # Dm, D, N, K, R, B, L, chunk, discretization
    (7, 13, 5, 3, 2, 2, 37, 8, "zoh"),
    (20, 70, 17, 4, 3, 3, 19, 5, "zoh"),
    (9, 18, 3, 2, 1, 1, 66, 64, "euler"),
    (33, 66, 16, 4, 3, 2, 29, 7, "euler"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_block_vs_cpu(cfg, monkeypatch):
    Dm, D, N, K, R, B, L, T, disc = cfg
    monkeypatch.setattr(layers, "SCAN_CHUNK", T)
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


def random_model(V, Dm, n_layers, D, N, K, R, seed):
    rng = np.random.default_rng(seed)
    p = {"embedding": (rng.standard_normal((V, Dm)) * 0.5).astype(np.float32),
         "final_norm": (1 + 0.2 * rng.standard_normal(Dm)).astype(np.float32),
         "lm_head_bias": (0.3 * rng.standard_normal(V)).astype(np.float32)}
    for i in range(n_layers):
        for k, v in rand_params(Dm, D, N, K, R, seed + i).items():
            p[f"layer{i}.{k}"] = v
    return p


def test_model_vs_cpu(monkeypatch):
    monkeypatch.setattr(layers, "SCAN_CHUNK", 6)
    params = random_model(V=37, Dm=10, n_layers=2, D=20, N=5, K=3, R=2, seed=11)
    rng = np.random.default_rng(3)
    tok = rng.integers(0, 37, (2, 23))
    tgt = rng.integers(0, 37, (2, 23))
    tok[0, :5] = 4       # repeated ids: several rows into one embedding gradient row
    loss, grads = G.model_loss_and_grads(tok, tgt, params)
    c_loss, c_grads = mamba_ext.model_loss_and_grads(tok, tgt, params)
    assert abs(loss - c_loss) <= 1e-6 * abs(c_loss)
    for k in params:
        assert nerr(grads[k], c_grads[k]) <= 1e-4, k


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("max_delta", [0.0, 2e-3])
def test_trainer_matches_cpu_adamw(max_delta, monkeypatch):
    monkeypatch.setattr(layers, "SCAN_CHUNK", 4)
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=21)
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, 19, (2, 11)), rng.integers(0, 19, (2, 11))) for _ in range(3)]
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, max_delta=max_delta)
    tr = G.ResidentTrainer(params, **kw)
    cpu = {k: v.copy() for k, v in params.items()}
    opt = mamba_ext.AdamW(cpu, **kw)
    for tok, tgt in batches:
        loss = tr.step(tok, tgt)
        c_loss, c_grads = mamba_ext.model_loss_and_grads(tok, tgt, cpu)
        assert abs(loss - c_loss) <= 1e-5 * abs(c_loss)
        assert opt.step(c_grads)
    got = tr.params()
    assert tr.t == 3 and tr.skipped == 0
    for k in params:
        # compare the change made by the three steps (weights themselves are O(1))
        assert nerr(got[k] - params[k], cpu[k] - params[k]) <= 1e-3, k
    if max_delta:
        assert max(np.max(np.abs(got[k] - params[k])) for k in params) <= 3 * max_delta * (1 + 1e-5)
    # the tied embedding, a decayed matrix and an undecayed bias all moved
    assert not np.array_equal(got["embedding"], params["embedding"])


def test_trainer_skips_nonfinite_step():
    params = random_model(V=11, Dm=6, n_layers=1, D=12, N=3, K=2, R=1, seed=5)
    params["lm_head_bias"][3] = np.nan     # NaN logits -> NaN gradients everywhere
    tr = G.ResidentTrainer(params, lr=1e-2)
    tok = np.arange(10).reshape(2, 5) % 11
    tr.step(tok, tok)
    assert tr.skipped == 1 and tr.t == 0
    got = tr.params()
    for k in params:
        assert np.array_equal(got[k], params[k], equal_nan=True), k
    st = tr.state()
    assert all(not np.any(st[f"m.{k}"]) for k in params)


def test_trainer_lowers_loss():
    params = random_model(V=13, Dm=8, n_layers=1, D=16, N=4, K=4, R=1, seed=9)
    tr = G.ResidentTrainer(params, lr=2e-2)
    seq = np.arange(2 * 13).reshape(2, 13) % 13
    tok, tgt = seq, (seq + 1) % 13          # learnable: next id
    first = tr.step(tok, tgt)
    for _ in range(25):
        last = tr.step(tok, tgt)
    assert last < 0.5 * first


# -------------------------------------------------------------- bad input
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
    m = random_model(V=5, Dm=6, n_layers=1, D=12, N=3, K=3, R=1, seed=0)
    with pytest.raises(ValueError, match="token id 5"):
        G.model_loss_and_grads(np.array([[0, 5]]), np.array([[0, 1]]), m)


def test_empty_batch():
    params = rand_params(6, 12, 3, 3, 1, seed=1)
    x = np.zeros((0, 4, 6), np.float32)
    out, cache = G.mamba1_forward(x, params)
    dx, grads = G.mamba1_backward(x, params, cache)
    assert out.shape == x.shape and dx.shape == x.shape
    assert all(not np.any(grads[n]) and grads[n].shape == params[n].shape for n in NAMES)


def test_limits_refused_with_message():
    g = gpu()
    with pytest.raises(ValueError, match="max_storage_buffer_binding_size"):
        g.buffer(g.max_binding // 4 + 1, "too_big")
    with pytest.raises(ValueError, match="max_compute_workgroups_per_dimension"):
        g.check_grid((g.max_groups + 1, 1, 1), "test")
    gx = g.grid1d(g.max_groups * 3 + 1, "split")     # split into y instead of refused
    assert gx[0] <= g.max_groups and gx[0] * gx[1] >= g.max_groups * 3 + 1


def test_no_adapter_message(monkeypatch):
    import wgpu
    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(RuntimeError, match="mesa-vulkan-drivers"):
        Gpu()


def test_kernel_sources_found():
    src = kernel_source("scan")
    assert "fn scan_bwd_grads" in src and "fn expm1_f" in src


# ---------------------------------------------------------- optimizer state
def _state_batches(V, n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, V, (2, 7)), rng.integers(0, V, (2, 7))) for _ in range(n)]


_STATE_KW = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def test_trainer_state_round_trip_continues_exactly():
    params = random_model(V=17, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=31)
    batches = _state_batches(17, 4, seed=6)
    full = G.ResidentTrainer(params, **_STATE_KW)
    for tok, tgt in batches:
        full.step(tok, tgt)
    first = G.ResidentTrainer(params, **_STATE_KW)
    for tok, tgt in batches[:2]:
        first.step(tok, tgt)
    sd = first.state_dict()
    assert sd["step"] == 2 and sd["skipped"] == 0 and sd["lr"] == 3e-3 and sd["beta2"] == 0.99
    assert set(sd) == set(mamba_ext.AdamW({k: v.copy() for k, v in params.items()}).state_dict())
    assert all(sd[f"exp_avg.{k}"].dtype == np.float32 and sd[f"exp_avg_sq.{k}"].shape == params[k].shape
               for k in params)
    assert np.any(sd["exp_avg.embedding"])
    # a fresh trainer from the weights after step 2, with defaults that the state overrides
    resumed = G.ResidentTrainer(first.params(), lr=1.0, betas=(0.5, 0.5), weight_decay=0.0)
    resumed.load_state_dict(sd)
    assert resumed.t == 2 and resumed.lr == 3e-3 and resumed.betas == (0.9, 0.99)
    for tok, tgt in batches[2:]:
        resumed.step(tok, tgt)
    got, ref = resumed.params(), full.params()
    for k in params:      # the same kernels on the same data: bit-identical (deterministic GPU)
        assert np.array_equal(got[k], ref[k]), k
    rs, fs = resumed.state_dict(), full.state_dict()
    assert rs["step"] == fs["step"] == 4
    for k in params:
        assert np.array_equal(rs[f"exp_avg_sq.{k}"], fs[f"exp_avg_sq.{k}"]), k


def test_trainer_loads_cpu_adamw_state():
    params = random_model(V=17, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=33)
    batches = _state_batches(17, 3, seed=7)
    cpu = {k: v.copy() for k, v in params.items()}
    opt = mamba_ext.AdamW(cpu, **_STATE_KW)
    for tok, tgt in batches[:2]:
        assert opt.step(mamba_ext.model_loss_and_grads(tok, tgt, cpu)[1])
    tr = G.ResidentTrainer({k: v.copy() for k, v in cpu.items()})    # default hyper-parameters
    tr.load_state_dict(opt.state_dict())
    assert tr.t == 2
    before = {k: v.copy() for k, v in cpu.items()}
    tok, tgt = batches[2]
    tr.step(tok, tgt)
    assert opt.step(mamba_ext.model_loss_and_grads(tok, tgt, cpu)[1])
    got = tr.params()
    for k in params:
        # the third step's change: bias correction t=3 and the moments both carried over
        assert nerr(got[k] - before[k], cpu[k] - before[k]) <= 1e-5 * 100, k
        assert nerr(got[k], cpu[k]) <= 1e-5, k
    sd = tr.state_dict()
    for k in params:
        assert nerr(sd[f"exp_avg.{k}"], opt.exp_avg[k]) <= 1e-4, k


def test_trainer_load_state_dict_refuses_bad_state():
    params = random_model(V=11, Dm=6, n_layers=1, D=12, N=3, K=2, R=1, seed=35)
    tr = G.ResidentTrainer(params, **_STATE_KW)
    tok = np.arange(14).reshape(2, 7) % 11
    tr.step(tok, tok)
    good = tr.state_dict()
    w0 = tr.params()
    bad_m = good["exp_avg.layer0.wConv"].copy()
    bad_m[0, 0] = np.nan
    cases = [
        ({k: v for k, v in good.items() if k != "exp_avg_sq.embedding"}, ValueError, "exp_avg_sq.embedding"),
        ({**good, "exp_avg.layer0.wConv": bad_m}, ValueError, "exp_avg.layer0.wConv"),
        ({**good, "exp_avg.final_norm": good["exp_avg.final_norm"][:-1]}, ValueError, "exp_avg.final_norm"),
        ({**good, "exp_avg_sq.lm_head_bias": -np.ones(11, np.float32)}, ValueError, "lm_head_bias"),
        ({**good, "exp_avg.embedding": good["exp_avg.embedding"].astype(np.float64)}, TypeError,
         "exp_avg.embedding"),
        ({**good, "step": -1}, ValueError, "step"),
        ({**good, "beta1": 1.5}, ValueError, "beta"),
        ({**good, "m.embedding": good["exp_avg.embedding"]}, ValueError, "m.embedding"),
    ]
    for state, err, key in cases:
        with pytest.raises(err, match=key.replace(".", r"\.")):
            tr.load_state_dict(state)
    after = tr.state_dict()        # nothing changed: moments, counts, hyper-parameters, weights
    assert set(after) == set(good)
    for k, v in good.items():
        assert np.array_equal(after[k], v), k
    assert all(np.array_equal(tr.params()[k], w0[k]) for k in params)
