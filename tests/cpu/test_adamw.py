"""AdamW (mamba_ext.optim / mamba_ext.cpu.adamw) and clip_grad_norm.

The reference is an independent NumPy transcription of PyTorch's
torch.optim.AdamW single-tensor algorithm, in float64. The kernel is also
compared with torch.optim.AdamW itself in a test of its own (skipped without
torch locally, FAIL under CI=true: conftest.optional).
"""
import math

import numpy as np
import pytest
from conftest import optional

from mamba_ext import AdamW, clip_grad_norm
from mamba_ext.cpu import adamw as _adamw
from mamba_ext.optim import DEFAULT_NO_DECAY

# A model-like parameter set: names decide weight decay.
SHAPES = {
    "embedding": (11, 6), "final_norm": (6,), "lm_head_bias": (11,),
    "layer0.wInProj": (8, 6), "layer0.bInProj": (8,), "layer0.A_log": (4, 3),
    "layer0.D_vec": (4,), "layer0.normWeight": (6,), "layer1.wOutProj": (6, 4),
    "layer1.bConv": (4,),
}
NO_DECAY_BY_DEFAULT = {"final_norm", "lm_head_bias", "layer0.bInProj", "layer0.A_log",
                       "layer0.D_vec", "layer0.normWeight", "layer1.bConv"}


def make_params(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def make_grads(params, seed):
    rng = np.random.default_rng(1000 + seed)
    # mixed magnitudes so that sqrt(v) and eps both matter somewhere
    return {n: (rng.standard_normal(p.shape) * 10.0 ** rng.integers(-4, 1, p.shape)).astype(p.dtype)
            for n, p in params.items()}


def reference_adamw_step(w, m, v, g, t, lr, b1, b2, eps, wd, max_delta):
    """torch.optim.AdamW (_single_tensor_adamw) transcribed to float64 NumPy,
    plus the documented trust region: the total change is clamped."""
    w, m, v, g = (np.asarray(a, np.float64) for a in (w, m, v, g))
    w_new = w * (1.0 - lr * wd)
    m = m + (1.0 - b1) * (g - m)
    v = v * b2 + (1.0 - b2) * g * g
    bias_correction1 = 1.0 - b1 ** t
    bias_correction2 = 1.0 - b2 ** t
    step_size = lr / bias_correction1
    denom = np.sqrt(v) / math.sqrt(bias_correction2) + eps
    w_new = w_new - step_size * m / denom
    if max_delta > 0:
        w_new = w - np.clip(w - w_new, -max_delta, max_delta)
    return w_new, m, v


def run_reference(params, grads_seq, lr, betas, eps, wd, max_delta, no_decay_names):
    w = {n: p.astype(np.float64) for n, p in params.items()}
    m = {n: np.zeros_like(a) for n, a in w.items()}
    v = {n: np.zeros_like(a) for n, a in w.items()}
    for t, grads in enumerate(grads_seq, start=1):
        for n in w:
            w[n], m[n], v[n] = reference_adamw_step(
                w[n], m[n], v[n], grads[n], t, lr, betas[0], betas[1], eps,
                0.0 if n in no_decay_names else wd, max_delta)
    return w, m, v


def run_torch(params, grads_seq, lr, betas, eps, wd, no_decay_names):
    torch = optional("torch", "pip install torch to compare with torch.optim.AdamW")
    tp = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params.items()}
    groups = [{"params": [tp[n] for n in tp if n not in no_decay_names], "weight_decay": wd},
              {"params": [tp[n] for n in tp if n in no_decay_names], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    for grads in grads_seq:
        for n, p in tp.items():
            p.grad = torch.from_numpy(grads[n].copy())
        opt.step()
    return {n: p.detach().numpy() for n, p in tp.items()}


TOL = {np.float32: dict(rtol=2e-6, atol=2e-6), np.float64: dict(rtol=1e-13, atol=1e-13)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("max_delta", [0.0, 2e-3])
@pytest.mark.parametrize("default_no_decay", [True, False])
def test_matches_pytorch_algorithm(dtype, max_delta, default_no_decay):
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.3
    params = make_params(dtype)
    start = {n: p.copy() for n, p in params.items()}
    kwargs = {} if default_no_decay else {"no_decay": ()}
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, max_delta=max_delta, **kwargs)
    no_decay_names = NO_DECAY_BY_DEFAULT if default_no_decay else set()
    assert set(opt.decayed) == set(SHAPES) - no_decay_names

    grads_seq = [make_grads(params, s) for s in range(6)]
    for grads in grads_seq:
        before = {n: p.copy() for n, p in params.items()}
        assert opt.step(grads) is True
        if max_delta > 0:
            for n in params:   # the trust region bounds every element's change
                change = np.abs(params[n].astype(np.float64) - before[n])
                assert np.all(change <= max_delta + 2 * np.spacing(np.abs(before[n])))
    assert opt.step_count == 6 and opt.skipped == 0 and opt.nonfinite == 0

    ref_w, ref_m, ref_v = run_reference(start, grads_seq, lr, betas, eps, wd, max_delta, no_decay_names)
    for n in params:
        assert params[n].dtype == dtype
        np.testing.assert_allclose(params[n], ref_w[n], **TOL[dtype], err_msg=n)
        np.testing.assert_allclose(opt.exp_avg[n], ref_m[n], **TOL[dtype], err_msg=n)
        np.testing.assert_allclose(opt.exp_avg_sq[n], ref_v[n], **TOL[dtype], err_msg=n)
        # the parameters really moved, and decay is visible where it applies
        assert not np.array_equal(params[n], start[n])
    if max_delta > 0:   # the clamp was active somewhere (lr 1e-2 >> 2e-3)
        plain, _, _ = run_reference(start, grads_seq, lr, betas, eps, wd, 0.0, no_decay_names)
        assert any(np.abs(plain[n] - ref_w[n]).max() > 1e-3 for n in params)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("default_no_decay", [True, False])
def test_matches_torch_adamw(dtype, default_no_decay):
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.3
    params = make_params(dtype)
    start = {n: p.copy() for n, p in params.items()}
    kwargs = {} if default_no_decay else {"no_decay": ()}
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **kwargs)
    no_decay_names = NO_DECAY_BY_DEFAULT if default_no_decay else set()
    grads_seq = [make_grads(params, s) for s in range(6)]
    for grads in grads_seq:
        assert opt.step(grads) is True
    tw = run_torch(start, grads_seq, lr, betas, eps, wd, no_decay_names)
    for n in params:
        assert not np.array_equal(tw[n], start[n]), n     # torch moved it too
        np.testing.assert_allclose(params[n], tw[n], **TOL[dtype], err_msg=n)


def test_no_decay_rule():
    params = make_params(np.float64)
    assert set(AdamW(params).decayed) == set(SHAPES) - NO_DECAY_BY_DEFAULT
    assert set(AdamW(params, no_decay=()).decayed) == set(SHAPES)
    # exact full names and suffixes after a dot; no partial-word matches
    opt = AdamW(params, no_decay={"layer0.A_log", "Proj", "embedding"})
    assert set(opt.decayed) == set(SHAPES) - {"layer0.A_log", "embedding"}
    assert DEFAULT_NO_DECAY >= {"A_log", "D_vec", "normWeight", "final_norm", "lm_head_bias"}
    with pytest.raises(TypeError, match="no_decay"):
        AdamW(params, no_decay="A_log")


def test_weight_decay_only_where_configured():
    # zero gradients: Adam's step is 0, so the change is exactly the decay
    params = make_params(np.float64)
    start = {n: p.copy() for n, p in params.items()}
    opt = AdamW(params, lr=0.1, weight_decay=0.5)
    opt.step({n: np.zeros_like(p) for n, p in params.items()})
    for n in params:
        expect = start[n] if n in NO_DECAY_BY_DEFAULT else start[n] * (1 - 0.05)
        np.testing.assert_allclose(params[n], expect, rtol=1e-15, atol=0, err_msg=n)


def test_trust_region_inactive_is_bit_identical():
    # a max_delta no element reaches gives exactly the unclamped update
    a, b = make_params(np.float32), make_params(np.float32)
    oa, ob = AdamW(a, lr=1e-3), AdamW(b, lr=1e-3, max_delta=1.0)
    for s in range(3):
        g = make_grads(a, s)
        oa.step(g)
        ob.step(g)
    for n in a:
        assert np.array_equal(a[n], b[n])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_gradient_skips_whole_step(bad, dtype):
    params = make_params(dtype)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    opt.step(make_grads(params, 0))
    snap = ({n: p.copy() for n, p in params.items()},
            {n: a.copy() for n, a in opt.exp_avg.items()},
            {n: a.copy() for n, a in opt.exp_avg_sq.items()})
    grads = make_grads(params, 1)
    grads["layer0.A_log"][2, 1] = bad
    assert opt.step(grads) is False
    assert opt.skipped == 1 and opt.step_count == 1
    for n in params:   # nothing moved, bit for bit
        assert np.array_equal(params[n], snap[0][n])
        assert np.array_equal(opt.exp_avg[n], snap[1][n])
        assert np.array_equal(opt.exp_avg_sq[n], snap[2][n])
    # the next finite step is applied as step 2
    assert opt.step(make_grads(params, 2)) is True
    assert opt.step_count == 2
    assert all(np.isfinite(p).all() for p in params.values())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [37, 200_003])   # serial and OpenMP-chunked paths
def test_kernel_per_element_guard(dtype, n):
    rng = np.random.default_rng(5)
    w = rng.standard_normal(n).astype(dtype)
    m = (rng.standard_normal(n) * 0.1).astype(dtype)
    v = (rng.random(n) * 0.1).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    bad_at = np.array([0, n // 2, n - 1])
    g[bad_at] = [np.nan, np.inf, -np.inf]
    w0, m0, v0 = w.copy(), m.copy(), v.copy()
    count = _adamw.adamw_update_array(w, m, v, g, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.0, 3,
                                      1.0, 2)
    assert count == 3
    assert np.array_equal(w[bad_at], w0[bad_at])
    assert np.array_equal(m[bad_at], m0[bad_at]) and np.array_equal(v[bad_at], v0[bad_at])
    good = np.setdiff1d(np.arange(n), bad_at)
    assert np.mean(w[good] != w0[good]) > 0.99 and np.isfinite(w).all()
    rw, rm, rv = reference_adamw_step(w0[good], m0[good], v0[good], g[good], 3, 1e-2, 0.9, 0.999,
                                      1e-8, 0.1, 0.0)
    np.testing.assert_allclose(w[good], rw, **TOL[dtype])
    np.testing.assert_allclose(m[good], rm, **TOL[dtype])
    np.testing.assert_allclose(v[good], rv, **TOL[dtype])


def test_overflowing_square_is_guarded_per_element():
    # finite float32 gradients whose square overflows: v would become inf
    params = {"w": np.ones(4, np.float32)}
    opt = AdamW(params, lr=1e-2)
    # (1 - beta2) * g * g = 1e-3 * 3e22 * 3e22 > float32 max
    assert opt.step({"w": np.array([1.0, 3e22, -2.0, 0.5], np.float32)}) is True
    assert opt.nonfinite == 1
    assert params["w"][1] == 1.0 and opt.exp_avg["w"][1] == 0 and opt.exp_avg_sq["w"][1] == 0
    assert np.all(params["w"][[0, 2, 3]] != 1.0)
    assert np.isfinite(opt.exp_avg_sq["w"]).all()


def test_threads_do_not_change_results():
    n = 300_001
    rng = np.random.default_rng(9)
    base = [rng.standard_normal(n).astype(np.float32) for _ in range(2)] + [
        (rng.random(n) * 0.01).astype(np.float32), rng.standard_normal(n).astype(np.float32)]
    outs = []
    for threads in (1, 2, 0):   # 0: OpenMP's default team
        w, m, v, g = (a.copy() for a in base)
        _adamw.adamw_update_array(w, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1e-3, 7, 0.5, threads)
        outs.append((w, m, v))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.array_equal(a, b)
    # the optimizer with explicit and default thread counts
    for threads in (1, 2, None):
        params = {"big": base[0].copy()}
        AdamW(params, lr=1e-3, max_delta=1e-3, n_threads=threads).step({"big": base[3]})
        w_ref = base[0].copy()
        _adamw.adamw_update_array(w_ref, np.zeros(n, np.float32), np.zeros(n, np.float32), base[3],
                                  1e-3, 0.9, 0.999, 1e-8, 0.01, 1e-3, 1, 1.0, 1)
        assert np.array_equal(params["big"], w_ref)
    x = base[0]
    ref = float(np.sum(x.astype(np.float64) ** 2))
    for threads in (1, 2):
        assert _adamw.sumsq_array(x, 1.0, threads) == pytest.approx(ref, rel=1e-12)
    x = x.copy()
    x[[5, 70_000, n - 1]] = [np.nan, np.inf, -np.inf]
    assert _adamw.count_nonfinite_array(x, 1) == _adamw.count_nonfinite_array(x, 2) == 3


def test_grad_scale_is_fused_unscale():
    a, b = make_params(np.float32), make_params(np.float32)
    oa, ob = AdamW(a, lr=1e-2), AdamW(b, lr=1e-2)
    g = make_grads(a, 0)
    oa.step({n: x * np.float32(0.25) for n, x in g.items()})
    ob.step({n: x * np.float32(4.0) for n, x in g.items()}, grad_scale=1 / 16)
    for n in a:   # powers of two: exactly the same numbers
        assert np.array_equal(a[n], b[n])


# ---- clip_grad_norm ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_grad_norm(dtype):
    grads = make_grads(make_params(dtype), 3)
    ref = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    orig = {n: g.copy() for n, g in grads.items()}

    norm = clip_grad_norm(grads, ref * 2)            # below the limit: untouched
    assert norm == pytest.approx(ref, rel=1e-12)
    assert all(np.array_equal(grads[n], orig[n]) for n in grads)

    norm = clip_grad_norm(grads, 0.5)                # above: scaled to ~0.5
    assert norm == pytest.approx(ref, rel=1e-12)
    coef = 0.5 / (ref + 1e-6)
    for n in grads:
        np.testing.assert_allclose(grads[n], orig[n] * coef, rtol=1e-6 if dtype == np.float32 else 1e-14)
    after = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    assert after == pytest.approx(0.5, rel=1e-5)

    seq = [g.copy() for g in orig.values()]          # a sequence works too
    assert clip_grad_norm(seq, math.inf) == pytest.approx(ref, rel=1e-12)


def test_clip_grad_norm_accumulates_in_float64():
    # float32 squares of 1e20 overflow float32 but not float64
    g = {"a": np.full(3, 1e20, np.float32), "b": np.full(1, 1e20, np.float32)}
    assert clip_grad_norm(g, 1.0) == pytest.approx(2e20, rel=1e-6)
    assert np.allclose(g["a"], 0.5, rtol=1e-5)
    # float64 values whose squares overflow float64: rescaled, still exact-ish
    big = {"a": np.array([3e200, 4e200])}
    assert clip_grad_norm(big, 1e300) == pytest.approx(5e200, rel=1e-14)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_grad_norm_nonfinite_untouched(bad):
    g = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([bad, 5.0], np.float32)}
    orig = {n: x.copy() for n, x in g.items()}
    norm = clip_grad_norm(g, 1.0)
    assert not math.isfinite(norm)
    assert (math.isnan(norm) if np.isnan(bad) else norm == math.inf)
    for n in g:
        np.testing.assert_array_equal(g[n], orig[n])


def test_clip_grad_norm_bad_input():
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm({"a": np.ones(2)}, 0.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm({"a": np.ones(2)}, float("nan"))
    with pytest.raises(TypeError, match=r"grads\['a'\]"):
        clip_grad_norm({"a": np.ones(2, np.int64)}, 1.0)
    ro = np.ones(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        clip_grad_norm({"a": ro}, 1.0)


# ---- state ------------------------------------------------------------------

def test_state_round_trip_is_exact(tmp_path):
    from safetensors.numpy import load_file, save_file

    params = make_params(np.float32)
    opt = AdamW(params, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, max_delta=0.1)
    for s in range(3):
        opt.step(make_grads(params, s))
    bad = make_grads(params, 9)
    bad["embedding"][0, 0] = np.nan
    opt.step(bad)
    state = opt.state_dict()
    assert state["step"] == 3 and state["skipped"] == 1

    # through safetensors: arrays as they are, scalars as 0-d arrays
    flat = {k: (v if isinstance(v, np.ndarray) else np.array(v)) for k, v in state.items()}
    save_file(flat, str(tmp_path / "opt.safetensors"))
    loaded = load_file(str(tmp_path / "opt.safetensors"))

    copies = {n: p.copy() for n, p in params.items()}
    opt2 = AdamW(copies)                                # other hyper-params: restored by load
    opt2.load_state_dict(loaded)
    assert (opt2.lr, opt2.betas, opt2.eps, opt2.weight_decay, opt2.max_delta) == (
        3e-3, (0.8, 0.99), 1e-7, 0.05, 0.1)
    assert opt2.step_count == 3 and opt2.skipped == 1
    for s in range(3, 5):
        g = make_grads(params, s)
        opt.step(g)
        opt2.step(g)
    for n in params:
        assert np.array_equal(params[n], copies[n])
        assert np.array_equal(opt.exp_avg[n], opt2.exp_avg[n])
        assert np.array_equal(opt.exp_avg_sq[n], opt2.exp_avg_sq[n])
    # state_dict hands out copies
    state["exp_avg.embedding"][...] = 7
    assert not np.any(opt.exp_avg["embedding"] == 7)


def _corrupt(state, key, value):
    s = dict(state)
    if value is KeyError:
        del s[key]
    else:
        s[key] = value
    return s


@pytest.mark.parametrize("key,value,exc,match", [
    ("exp_avg.embedding", KeyError, ValueError, "missing key 'exp_avg.embedding'"),
    ("exp_avg.embedding", np.zeros((11, 6), np.float64), TypeError, "exp_avg.embedding"),
    ("exp_avg_sq.final_norm", np.zeros(5, np.float32), ValueError, r"exp_avg_sq.final_norm.*shape"),
    ("exp_avg.layer0.D_vec", np.full(4, np.nan, np.float32), ValueError, "NaN"),
    ("exp_avg_sq.layer0.D_vec", np.full(4, -1.0, np.float32), ValueError, "negative"),
    ("exp_avg.nope", np.zeros(2, np.float32), ValueError, "unknown key"),
    ("step", 2.5, ValueError, "'step'"),
    ("step", -1, ValueError, "'step'"),
    ("step", KeyError, ValueError, "missing key 'step'"),
    ("lr", "big", TypeError, "'lr'"),
    ("beta2", 1.0, ValueError, r"betas\[1\]"),
])
def test_load_state_dict_validates(key, value, exc, match):
    params = make_params(np.float32)
    opt = AdamW(params)
    opt.step(make_grads(params, 0))
    good = opt.state_dict()
    target = AdamW({n: p.copy() for n, p in params.items()})
    with pytest.raises(exc, match=match):
        target.load_state_dict(_corrupt(good, key, value))
    # nothing was applied
    assert target.step_count == 0
    assert all(not a.any() for a in target.exp_avg.values())
    target.load_state_dict(good)
    assert target.step_count == 1


# ---- bad input ----------------------------------------------------------------

def test_bad_params():
    with pytest.raises(TypeError, match="params"):
        AdamW([np.ones(3)])
    with pytest.raises(TypeError, match=r"params\['x'\]"):
        AdamW({"x": np.ones(3, np.int32)})
    with pytest.raises(TypeError, match=r"params\['x'\]"):
        AdamW({"x": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"params\['x'\].*C-contiguous"):
        AdamW({"x": np.ones((4, 4))[:, 1]})
    with pytest.raises(ValueError, match="lr"):
        AdamW({"x": np.ones(3)}, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        AdamW({"x": np.ones(3)}, betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="betas"):
        AdamW({"x": np.ones(3)}, betas=0.9)
    with pytest.raises(ValueError, match="max_delta"):
        AdamW({"x": np.ones(3)}, max_delta=float("nan"))
    with pytest.raises(ValueError, match="n_threads"):
        AdamW({"x": np.ones(3)}, n_threads=0)
    with pytest.raises(ValueError, match="n_threads"):
        clip_grad_norm({"x": np.ones(3)}, 1.0, n_threads=-2)


def test_bad_grads_name_the_key():
    params = make_params(np.float32)
    opt = AdamW(params)
    good = make_grads(params, 0)
    with pytest.raises(ValueError, match="layer1.bConv"):
        opt.step({n: g for n, g in good.items() if n != "layer1.bConv"})
    with pytest.raises(ValueError, match="extra"):
        opt.step({**good, "extra": np.ones(2, np.float32)})
    with pytest.raises(TypeError, match=r"grads\['embedding'\].*float32"):
        opt.step({**good, "embedding": good["embedding"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"grads\['embedding'\].*\(11, 6\)"):
        opt.step({**good, "embedding": good["embedding"][:5]})
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(good, grad_scale=0.0)
    opt.lr = float("inf")
    with pytest.raises(ValueError, match="lr"):
        opt.step(good)
    assert opt.step_count == 0   # no failed call changed anything
    opt.lr = 1e-3
    strided = {n: np.asfortranarray(g) if g.ndim == 2 else g for n, g in good.items()}
    assert opt.step(strided) is True   # non-contiguous gradients are fine (read only)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_many_arrays_in_one_call_match_one_call_each(dtype):
    # the optimizer's batched call (pieces of several arrays in one region) against the
    # per-array kernel: bitwise, for any thread count, with the per-element guard
    rng = np.random.default_rng(21)
    sizes = [0, 1, 17, 16_384, 16_385, 70_001, 5]
    base = [[rng.standard_normal(n).astype(dtype), (rng.standard_normal(n) * 0.1).astype(dtype),
             (rng.random(n) * 0.1).astype(dtype), rng.standard_normal(n).astype(dtype)]
            for n in sizes]
    base[3][3][[0, 9_000]] = [np.nan, np.inf]          # two guarded elements
    decays = [0.1 * (i % 2) for i in range(len(sizes))]
    want, want_bad = [], 0
    for (w, m, v, g), wd in zip(base, decays):
        w, m, v = w.copy(), m.copy(), v.copy()
        want_bad += _adamw.adamw_update_array(w, m, v, g, 1e-2, 0.9, 0.999, 1e-8, wd, 1e-3, 4,
                                              0.5, 1)
        want.append((w, m, v))
    for threads in (1, 2, 0):
        ws, ms, vs = ([a[k].copy() for a in base] for k in range(3))
        bad = _adamw.adamw_update_arrays(ws, ms, vs, [a[3] for a in base], decays, 1e-2, 0.9,
                                         0.999, 1e-8, 1e-3, 4, 0.5, threads)
        assert bad == want_bad == 2
        for got, ref in zip(zip(ws, ms, vs), want):
            for a, b in zip(got, ref):
                assert np.array_equal(a, b)
        assert _adamw.count_nonfinite_arrays([a[3] for a in base], threads) == 2
    assert _adamw.count_nonfinite_arrays([], 1) == 0
    assert _adamw.adamw_update_arrays([], [], [], [], [], 1e-2, 0.9, 0.999, 1e-8, 0.0, 1) == 0


def test_many_arrays_refuse_bad_lists():
    a32, b32 = np.zeros(4, np.float32), np.zeros(5, np.float32)
    a64 = np.zeros(4, np.float64)
    with pytest.raises(TypeError, match="one dtype"):
        _adamw.count_nonfinite_arrays([a32, a64])
    with pytest.raises(TypeError, match="flat C-contiguous"):
        _adamw.count_nonfinite_arrays([np.zeros((2, 2), np.float32)])
    with pytest.raises(TypeError, match="flat C-contiguous"):
        _adamw.count_nonfinite_arrays([np.zeros(4, np.int64)])
    with pytest.raises(ValueError, match="sizes differ"):
        _adamw.adamw_update_arrays([a32], [a32.copy()], [b32], [a32.copy()], [0.0], 1e-2, 0.9,
                                   0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="one length"):
        _adamw.adamw_update_arrays([a32], [a32.copy()], [a32.copy()], [], [0.0], 1e-2, 0.9,
                                   0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        _adamw.adamw_update_arrays([a32], [a32.copy()], [a32.copy()], [a32.copy()], [0.0], 1e-2,
                                   0.9, 0.999, 1e-8, 0.0, 0)
    ro = a32.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _adamw.adamw_update_arrays([ro], [a32.copy()], [a32.copy()], [a32.copy()], [0.0], 1e-2,
                                   0.9, 0.999, 1e-8, 0.0, 1)


def test_mixed_dtype_params_are_all_checked_before_any_update():
    # one float32 and one float64 parameter: a NaN in the float64 gradient skips the step
    # for both (the optimizer checks every dtype's list before it updates any)
    params = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float64)}
    opt = AdamW(params, lr=1e-2)
    assert opt.step({"a": np.ones(3, np.float32), "b": np.array([1.0, np.nan])}) is False
    assert opt.skipped == 1 and np.all(params["a"] == 1) and np.all(params["b"] == 1)
    assert opt.step({"a": np.ones(3, np.float32), "b": np.ones(2)}) is True
    assert np.all(params["a"] < 1) and np.all(params["b"] < 1)
