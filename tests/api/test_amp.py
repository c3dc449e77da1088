"""Mixed precision pieces (mamba_ext.amp): fp16 rounding, dynamic loss scaling.

The scaler is compared with an independent transcription of
torch.amp.GradScaler's update rule, and with GradScaler itself in tests of their
own (skipped without torch locally, FAIL under CI=true: conftest.optional).
"""
import math

import numpy as np
import pytest
from conftest import optional

from mamba_ext import AdamW
from mamba_ext.amp import DynamicLossScaler, fp16_view, round_fp16


# ---- round_fp16 ---------------------------------------------------------------

def ref_round_fp16(x: float) -> float:
    """Nearest float16 value with ties to even, by hand (Python's round() is
    ties-to-even and |x| / ulp is exact: ulp is a power of two)."""
    if not math.isfinite(x) or x == 0:
        return x
    e = max(math.frexp(abs(x))[1] - 1, -14)        # binade; subnormals share -14
    ulp = 2.0 ** (e - 10)                          # 10 fraction bits
    y = round(abs(x) / ulp) * ulp
    return math.copysign(math.inf if y > 65504.0 else y, x)


TIES = [
    (1 + 2 ** -11, 1.0),                        # halfway, even below
    (1 + 3 * 2 ** -11, 1 + 2 ** -9),            # halfway, even above
    (-(1 + 2 ** -11), -1.0),
    (2048 + 1, 2048.0),                         # spacing 2 at 2048
    (2048 + 3, 2052.0),
    (2 ** -25, 0.0),                            # half the smallest subnormal
    (3 * 2 ** -25, 2 ** -23),
    (65504 + 16, math.inf),                     # halfway to 65536: even is "inf"
    (65504 + 15.99, 65504.0),
    (-65520.0, -math.inf),
    (1e6, math.inf),
    (6e-8, 2 ** -24),
    (1e-8, 0.0),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_fp16_ties_to_even_and_overflow(dtype):
    x = np.array([t[0] for t in TIES], dtype)
    expect = np.array([t[1] for t in TIES], np.float32)
    got = round_fp16(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, expect)
    assert np.isnan(round_fp16(np.array([np.nan], dtype))[0])


def test_round_fp16_no_double_rounding_from_float64():
    # just above a tie: float64 -> float32 -> float16 would round to the tie
    # and then to even (1.0); a direct rounding gives 1 + 2^-10.
    x = np.array([1 + 2 ** -11 + 2 ** -40, -(1 + 2 ** -11 + 2 ** -40)])
    np.testing.assert_array_equal(round_fp16(x), [1 + 2 ** -10, -(1 + 2 ** -10)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_fp16_matches_hand_rounding(dtype):
    rng = np.random.default_rng(0)
    wide = rng.standard_normal(3000) * 10.0 ** rng.uniform(-9, 5.5, 3000)
    # exact ties and near-ties around random fp16 values
    h = rng.standard_normal(1000).astype(np.float16).astype(np.float64)
    half_ulp = np.abs(np.spacing(h.astype(np.float16)).astype(np.float64)) / 2
    x = np.concatenate([wide, h + half_ulp, h - half_ulp, h + half_ulp * 0.999]).astype(dtype)
    got = round_fp16(x)
    ref = np.array([ref_round_fp16(float(v)) for v in x], np.float32)
    np.testing.assert_array_equal(got, ref)


def test_round_fp16_out_and_fp16_view():
    g = np.array([1 + 2 ** -11, 3e-8, 70000.0], np.float32)
    res = round_fp16(g, out=g)                    # in place, as for gradients
    assert res is g
    np.testing.assert_array_equal(g, [1.0, 2 ** -24, np.inf])
    with pytest.raises(TypeError, match="out"):
        round_fp16(np.ones(3), out=np.ones(3))    # float64 out
    with pytest.raises(ValueError, match="out"):
        round_fp16(np.ones(3), out=np.ones(2, np.float32))
    with pytest.raises(TypeError, match="round_fp16"):
        round_fp16(np.arange(3))

    master = {"a": np.array([1 + 2 ** -12, 0.1], np.float32), "b": np.array([[1e5]], np.float64)}
    before = {k: v.copy() for k, v in master.items()}
    view = fp16_view(master)
    assert set(view) == {"a", "b"}
    assert all(v.dtype == np.float32 for v in view.values())
    np.testing.assert_array_equal(view["a"], [1.0, np.float16(0.1)])
    assert view["b"][0, 0] == np.inf
    for k in master:                              # masters untouched
        np.testing.assert_array_equal(master[k], before[k])
    with pytest.raises(TypeError, match=r"params\['x'\]"):
        fp16_view({"x": np.arange(3)})


def test_compiled_fp16_conversions_are_numpys_bits():
    """mamba_ext.cpu.half (round_fp16's float32 path, FlatStream's fp16 wire) gives the bits
    of NumPy's float16 casts: every 4099th float32 bit pattern (NaN payloads, infinities,
    subnormals of both), in place and out of place, strided input through NumPy; the sum
    of fp16 rows in row order."""
    from mamba_ext.cpu import half
    x = np.arange(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    bits = np.empty(x.size, np.uint16)
    half.fp16_bits(x, bits)
    np.testing.assert_array_equal(bits, want.view(np.uint16))
    got = round_fp16(x)                               # the compiled path
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    y = x.copy()
    assert round_fp16(y, out=y) is y and np.array_equal(y.view(np.uint32), got.view(np.uint32))
    strided = round_fp16(x[::3])                      # not contiguous: NumPy's own cast
    assert np.array_equal(strided.view(np.uint32), got[::3].view(np.uint32))
    half.round_fp16_array(x, y, n_threads=2)          # chunks over threads: the same bits
    assert np.array_equal(y.view(np.uint32), got.view(np.uint32))

    rows = np.random.default_rng(0).standard_normal((3, 1001)).astype(np.float16)
    out = np.empty(1001, np.float32)
    half.sum_fp16_rows(rows.view(np.uint16), out)
    ref = rows[0].astype(np.float32)
    ref += rows[1]
    ref += rows[2]
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="out"):
        half.sum_fp16_rows(rows.view(np.uint16), np.empty(10, np.float32))
    with pytest.raises(ValueError, match="out"):
        half.fp16_bits(x[:5], np.empty(4, np.uint16))


# ---- the gradient that needs loss scaling --------------------------------------

def test_small_gradient_survives_with_scaling_only():
    g_true = np.full(4, 1e-8, np.float32)
    # without scaling, 1e-8 is below half the smallest fp16 subnormal: lost
    assert np.all(round_fp16(g_true) == 0)
    scaler = DynamicLossScaler()                  # scale 2**14
    grads = {"w": round_fp16(g_true * np.float32(scaler.scale))}  # fp16 backward of the scaled loss
    assert not scaler.check(grads)
    scaler.unscale(grads)
    np.testing.assert_allclose(grads["w"], 1e-8, rtol=2 ** -11)
    assert np.all(grads["w"] != 0)


# ---- DynamicLossScaler ---------------------------------------------------------

def ref_gradscaler(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """torch.amp.GradScaler's _amp_update_scale_, transcribed (float32 scale)."""
    scale, tracker, out = np.float32(init_scale), 0, []
    for found_inf in overflows:
        if found_inf:
            scale = np.float32(np.float64(scale) * backoff_factor)
            tracker = 0
        else:
            tracker += 1
            if tracker == growth_interval:
                new = np.float32(np.float64(scale) * growth_factor)
                if np.isfinite(new):
                    scale = new
                tracker = 0
        out.append(float(scale))
    return out


def torch_gradscaler(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    torch = optional("torch", "pip install torch to compare with torch.amp.GradScaler")
    s = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for found_inf in overflows:
        s.scale(torch.ones(()))
        p.grad = torch.tensor([math.inf if found_inf else 1.0, 1.0])
        s.step(opt)
        s.update()
        out.append(float(s.get_scale()))
    return out


def run_scaler(scaler, overflows):
    applied, traj = [], []
    for ov in overflows:
        applied.append(scaler.update(ov))
        traj.append(scaler.scale)
    return applied, traj


SEQS = {
    "growth": [False] * 20,
    "backoff": [True] * 5,
    "mixed": list(np.random.default_rng(3).random(60) < 0.2),
    "recover": [True, True] + [False] * 9 + [True] + [False] * 7,
}


def _unbounded_scaler(growth, backoff, interval):
    # bounds wide enough never to be hit: GradScaler has none
    return DynamicLossScaler(init_scale=1024.0, growth_factor=growth, backoff_factor=backoff,
                             growth_interval=interval, min_scale=2.0 ** -60, max_scale=2.0 ** 100)


@pytest.mark.parametrize("seq", sorted(SEQS))
@pytest.mark.parametrize("factors", [(2.0, 0.5, 3), (3.0, 0.3, 2)])
def test_scaler_trajectory_equals_gradscaler_transcription(seq, factors):
    overflows = [bool(x) for x in SEQS[seq]]
    growth, backoff, interval = factors
    scaler = _unbounded_scaler(growth, backoff, interval)
    applied, traj = run_scaler(scaler, overflows)
    ref = ref_gradscaler(overflows, 1024.0, growth, backoff, interval)
    assert traj == ref
    assert applied == [not o for o in overflows]
    assert scaler.overflows == scaler.skipped == sum(overflows)


@pytest.mark.parametrize("seq", sorted(SEQS))
@pytest.mark.parametrize("factors", [(2.0, 0.5, 3), (3.0, 0.3, 2)])
def test_scaler_trajectory_equals_torch_gradscaler(seq, factors):
    overflows = [bool(x) for x in SEQS[seq]]
    growth, backoff, interval = factors
    _, traj = run_scaler(_unbounded_scaler(growth, backoff, interval), overflows)
    theirs = torch_gradscaler(overflows, 1024.0, growth, backoff, interval)
    assert len(theirs) == len(overflows) and traj == theirs


def test_scaler_growth_and_max_clamp():
    s = DynamicLossScaler(init_scale=2.0 ** 14, growth_interval=3, max_scale=2.0 ** 16)
    _, traj = run_scaler(s, [False] * 12)
    assert traj == [2 ** 14, 2 ** 14, 2 ** 15, 2 ** 15, 2 ** 15, 2 ** 16,
                    2 ** 16, 2 ** 16, 2 ** 16, 2 ** 16, 2 ** 16, 2 ** 16]
    assert s.skipped == 0 and s.overflows == 0
    assert s.update(True) is False and s.scale == 2 ** 15  # backs off from the bound


def test_scaler_backoff_and_min_clamp():
    s = DynamicLossScaler(init_scale=8.0, min_scale=1.0, growth_interval=2)
    applied, traj = run_scaler(s, [True] * 6 + [False, False])
    assert traj == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    assert applied == [False] * 6 + [True, True]
    assert s.overflows == 6 and s.skipped == 6
    # defaults are the documented ones
    d = DynamicLossScaler()
    assert (d.scale, d.growth_factor, d.backoff_factor, d.growth_interval, d.min_scale, d.max_scale) == (
        2.0 ** 14, 2.0, 0.5, 200, 1.0, 2.0 ** 24)


def test_scaler_check_and_unscale():
    s = DynamicLossScaler(init_scale=256.0)
    grads = {"a": np.array([512.0, -256.0], np.float32), "b": np.array([[1.0]], np.float64)}
    assert s.check(grads) is False
    s.unscale(grads)
    np.testing.assert_array_equal(grads["a"], [2.0, -1.0])
    np.testing.assert_array_equal(grads["b"], [[1 / 256]])
    assert s.check([np.ones(2), np.array([np.inf])]) is True
    assert s.check({"x": np.array([1.0, np.nan], np.float32)}) is True
    with pytest.raises(TypeError, match=r"grads\['x'\]"):
        s.check({"x": [1.0]})
    with pytest.raises(TypeError, match="overflow"):
        s.update(1)


def test_scaler_state_round_trip_and_validation():
    s = DynamicLossScaler(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=5,
                          min_scale=0.5, max_scale=2.0 ** 20)
    run_scaler(s, [False, True, False, False])
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict({k: np.array(v) for k, v in state.items()})  # 0-d arrays, as from safetensors
    assert t.state_dict() == state
    seq = [False] * 4 + [True, False]
    assert run_scaler(s, seq) == run_scaler(t, seq)

    for key, value, exc in [("scale", -1.0, ValueError), ("growth_interval", 0, ValueError),
                            ("growth_tracker", 7, ValueError), ("overflows", 1.5, ValueError),
                            ("backoff_factor", 1.5, ValueError), ("scale", "x", TypeError),
                            ("bogus", 1, ValueError)]:
        bad = dict(state, **{key: value})
        fresh = DynamicLossScaler()
        with pytest.raises(exc, match=key):
            fresh.load_state_dict(bad)
        assert fresh.state_dict() == DynamicLossScaler().state_dict()   # untouched
    with pytest.raises(ValueError, match="missing key 'skipped'"):
        DynamicLossScaler().load_state_dict({k: v for k, v in state.items() if k != "skipped"})


def test_scaler_bad_construction():
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicLossScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=2.0 ** 30)          # above max_scale
    with pytest.raises(ValueError, match="min_scale"):
        DynamicLossScaler(min_scale=4.0, max_scale=2.0)
    with pytest.raises(TypeError, match="init_scale"):
        DynamicLossScaler(init_scale="big")


# ---- the pieces composed into an AMP step -----------------------------------------

def amp_step(w_master, x, y, scaler, opt):
    """Least squares on fp16-rounded weights: loss = mean((x @ w - y)^2) / 2."""
    w16 = fp16_view(w_master)["w"]
    r = x @ w16 - y
    g = {"w": (x.T @ r / len(y)).astype(np.float32) * np.float32(scaler.scale)}  # scaled loss
    round_fp16(g["w"], out=g["w"])                                             # fp16 gradients
    scaler.unscale(g)
    overflow = scaler.check(g)
    if scaler.update(overflow):
        return opt.step(g)
    return False


def test_amp_step_skips_on_overflow_and_learns():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0, -1.0], np.float32)
    params = {"w": np.zeros(5, np.float32)}
    opt = AdamW(params, lr=0.05, weight_decay=0.0)
    scaler = DynamicLossScaler(init_scale=2.0 ** 24, growth_interval=10)  # overflows at first
    assert amp_step(params, x, y, scaler, opt) is False
    assert opt.step_count == 0 and not params["w"].any()
    assert not opt.exp_avg["w"].any() and not opt.exp_avg_sq["w"].any()   # moments untouched
    for _ in range(300):
        amp_step(params, x, y, scaler, opt)
    assert scaler.skipped >= 1
    assert opt.step_count == 301 - scaler.skipped
    loss = float(np.mean((x @ params["w"] - y) ** 2) / 2)
    assert loss < 1e-3
