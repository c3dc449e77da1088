"""Mixed precision on the GPU (kernels/amp.wgsl, mamba_ext.gpu.amp, ResidentTrainer
with a DynamicLossScaler) against mamba_ext.amp and the CPU's amp_step."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import nerr, random_model, read, require_gpu, run, upload

g = require_gpu()
import mamba_ext  # noqa: E402
from mamba_ext import gpu as G  # noqa: E402
from mamba_ext.amp import DynamicLossScaler  # noqa: E402
from mamba_ext.gpu.amp import AmpOps  # noqa: E402
from mamba_ext.training.loop import amp_step  # noqa: E402


def _edge_values():
    """Every rounding case of float32 -> float16: ties (to even, both ways), the overflow
    threshold 65520 and its neighbours, the subnormal range and its underflow tie 2^-25,
    zeros, infinities, NaN; plus random values over the whole exponent range."""
    f = np.float32
    v = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.996, 65520.0, -65520.0, 1e6, np.inf, -np.inf,
         2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -26, 3.0 * 2.0 ** -25,
         1e-40, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -23,
         2049.0, 2051.0, 6.1e-5, 5.96e-8, 1e-8]
    rng = np.random.default_rng(0)
    rnd = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 6, 20000)).astype(f)
    return np.concatenate([np.array(v, f), -np.array(v, f), rnd])


def test_round_f16_is_numpys_float16():
    x = _edge_values()
    n = x.size
    w, w16, gr = upload(g, "w", x), g.buffer(n, "w16"), upload(g, "gr", x * 4.0)
    amp = AmpOps(g, n, w, w16, gr)
    amp.set_scale(DynamicLossScaler(init_scale=4.0))
    run(g, [amp.weights_op, amp.grads_op])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = read(g, w16, (n,))
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))       # -0 stays -0
    grads = read(g, gr, (n,))
    with np.errstate(over="ignore"):
        want_g = (x * 4.0).astype(np.float16).astype(np.float32) * np.float32(0.25)
    assert np.array_equal(grads, want_g, equal_nan=True)
    nan = upload(g, "nan", np.array([np.nan, 1.0], np.float32))
    out = g.buffer(2, "o")
    run(g, [AmpOps(g, 2, nan, out, out).weights_op])
    assert np.isnan(read(g, out, (2,))[0])
    # the host's copy of the same step (distributed AMP rounds each streamed part there:
    # mamba_ext.amp's round_fp16 and DynamicLossScaler.unscale)
    from mamba_ext.amp import round_fp16
    for scale in (4.0, 3.0, 2.0 ** 20):
        gx = (x * 4.0).astype(np.float32)
        buf = upload(g, "gr2", gx)
        host = round_fp16(gx)
        DynamicLossScaler(init_scale=scale).unscale([host])
        for on_gpu in (False, True):    # the reciprocal given, or read from the GPU's state
            buf = upload(g, "gr2", gx)
            ops = AmpOps(g, n, w, w16, buf)
            ops.set_scale(DynamicLossScaler(init_scale=scale), on_gpu)
            run(g, [ops.grads_op])
            assert np.array_equal(read(g, buf, (n,)), host, equal_nan=True), (scale, on_gpu)


def _pair(params, init_scale, **kw):
    cpu = {k: v.copy() for k, v in params.items()}
    opt = mamba_ext.AdamW(cpu, lr=kw["lr"], weight_decay=kw["weight_decay"])
    tr = G.ResidentTrainer(params, lr=kw["lr"], weight_decay=kw["weight_decay"], clip=kw["clip"],
                           scaler=DynamicLossScaler(init_scale=init_scale, growth_interval=2))
    return cpu, opt, DynamicLossScaler(init_scale=init_scale, growth_interval=2), tr


def test_amp_trainer_matches_cpu_amp_step():
    """Same steps as the CPU's amp_step: losses, the scaler's trajectory (it grows
    after two clean steps), and the weights' changes."""
    params = random_model(V=19, Dm=8, n_layers=2, D=16, N=4, K=3, R=1, seed=27)
    rng = np.random.default_rng(8)
    batches = [(rng.integers(0, 19, (2, 13)), rng.integers(0, 19, (2, 13))) for _ in range(4)]
    kw = dict(lr=3e-3, weight_decay=0.1, clip=1.0)
    cpu, opt, scaler, tr = _pair(params, 2.0 ** 10, **kw)
    for tok, tgt in batches:
        loss = tr.step(tok, tgt)
        c_loss, applied = amp_step(tok, tgt, cpu, opt, scaler, grad_clip=kw["clip"])
        assert applied
        assert abs(loss - c_loss) <= 1e-5 * abs(c_loss)
        assert tr.scaler.scale == scaler.scale and tr.scaler.growth_tracker == scaler.growth_tracker
    assert scaler.scale == 2.0 ** 12 and tr.t == 4 and tr.skipped == 0
    got = tr.params()
    for k in params:
        assert nerr(got[k] - params[k], cpu[k] - params[k]) <= 1e-3, k


def test_amp_trainer_overflow_skips_and_backs_off():
    """A scale that overflows fp16 gradients: the step is skipped on the GPU as on the
    CPU (weights, moments and the step count untouched) and the scale halves."""
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=29)
    tok = np.random.default_rng(1).integers(0, 19, (2, 9))
    kw = dict(lr=3e-3, weight_decay=0.1, clip=0.0)
    cpu, opt, scaler, tr = _pair(params, 2.0 ** 24, **kw)
    loss = tr.step(tok, tok)
    c_loss, applied = amp_step(tok, tok, cpu, opt, scaler, grad_clip=0.0)
    assert not applied and scaler.scale == 2.0 ** 23
    assert abs(loss - c_loss) <= 1e-5 * abs(c_loss)
    assert tr.skipped == 1 and tr.t == 0 and tr.scaler.scale == 2.0 ** 23
    assert tr.scaler.overflows == 1
    got = tr.params()
    assert all(np.array_equal(got[k], params[k]) for k in params)
    assert all(np.all(v == 0) for k, v in tr.state().items() if k not in ("t", "skipped"))


def test_update_scale_on_the_gpu_is_the_scalers():
    """amp_update_scale advances (scale, 1/scale, growth tracker) by DynamicLossScaler.update's
    rule, value for value, through overflows, growth, and both bounds."""
    from mamba_ext.gpu.amp import scale_on_gpu
    stat = g.buffer(4, "stat")
    x = upload(g, "x", np.ones(4, np.float32))
    for sc, flags in ((DynamicLossScaler(init_scale=2.0 ** 22, growth_interval=1),
                       [False, False, False, True, True, False]),          # up to max_scale
                      (DynamicLossScaler(init_scale=2.0, growth_interval=3, min_scale=1.0),
                       [True, True, True, False, False, False, False, True])):   # min_scale
        assert scale_on_gpu(sc)
        amp = AmpOps(g, 4, x, g.buffer(4, "x16"), g.buffer(4, "gr"), stat)
        amp.set_scale(sc, on_gpu=True)
        for overflow in flags:
            g.write(stat, np.array([0.0, float(overflow), 0.0, 0.0], np.float32))
            run(g, [amp.update_op])
            sc.update(overflow)
            got = read(g, amp.state, (4,))
            assert (got[0], got[1], got[2]) == (np.float32(sc.scale), np.float32(1 / sc.scale),
                                                sc.growth_tracker), (got, sc.state_dict())
    assert not scale_on_gpu(DynamicLossScaler(backoff_factor=0.75))
    assert not scale_on_gpu(DynamicLossScaler(init_scale=3.0))
    assert not scale_on_gpu(type("Sub", (DynamicLossScaler,), {})())


@pytest.mark.parametrize("init_scale", [2.0 ** 24, 3.0])
def test_pipelined_amp_steps_are_the_step_by_step_ones(monkeypatch, init_scale):
    """step_async with a scaler whose update is exact in float32: each step is submitted
    before the one before is read back (the host writes the scale once; the GPU advances it
    after each step), and the losses, weights, skips and the scaler's trajectory are those
    of steps read back one by one, bit for bit. A scale that is not a power of two (3.0)
    makes each step wait and take the host's scale."""
    from mamba_ext.gpu.amp import AmpOps as Ops
    writes = []
    orig = Ops.set_scale
    monkeypatch.setattr(Ops, "set_scale", lambda self, sc, on_gpu=False: (
        writes.append(on_gpu), orig(self, sc, on_gpu))[1])
    params = random_model(V=19, Dm=8, n_layers=2, D=16, N=4, K=3, R=1, seed=31)
    rng = np.random.default_rng(9)
    batches = [(rng.integers(0, 19, (2, 11)), rng.integers(0, 19, (2, 11))) for _ in range(7)]
    runs = []
    for pipelined in (False, True):
        writes.clear()
        tr = G.ResidentTrainer(params, lr=3e-3, clip=1.0,
                               scaler=DynamicLossScaler(init_scale=init_scale, growth_interval=2))
        if pipelined:
            pend = [tr.step_async(t, y) for t, y in batches]
            losses = [p.result() for p in pend]
        else:
            losses = [tr.step(t, y) for t, y in batches]
        runs.append((losses, tr.params(), tr.skipped, tr.t, tr.scaler.state_dict(), list(writes)))
        assert tr.pipelined_amp is (init_scale != 3.0)
    (l0, p0, s0, t0, sc0, w0), (l1, p1, s1, t1, sc1, w1) = runs
    assert l0 == l1 and (s0, t0) == (s1, t1) and sc0 == sc1
    assert all(np.array_equal(p0[k], p1[k]) for k in params)
    if init_scale == 3.0:
        assert w1 == [False] * 7                      # every step from the host
    else:
        assert s0 >= 1 and sc0["scale"] != init_scale  # it backed off (and grew) on the way
        assert w0 == [True] * 7 and w1 == [True]       # once: the GPU carried the scale


def test_a_scaler_replaced_between_overlapped_steps():
    """A scaler assigned while a step is in flight: that step updates the scaler it ran
    with, and the next step waits for it and runs with the new scaler's scale (written
    to the GPU anew), which the GPU then carries on."""
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=33)
    tok = np.random.default_rng(3).integers(0, 19, (2, 9))
    tr = G.ResidentTrainer(params, lr=1e-3, scaler=DynamicLossScaler(init_scale=2.0 ** 10))
    first = tr.scaler
    tr.step_async(tok, tok)
    tr.step_async(tok, tok)                   # overlapped: the first is read back meanwhile
    tr.scaler = DynamicLossScaler(init_scale=2.0 ** 6, growth_interval=2)
    tr.step_async(tok, tok).result()
    assert first.growth_tracker == 2 and first.scale == 2.0 ** 10
    assert tr.scaler.growth_tracker == 1 and tr.scaler.scale == 2.0 ** 6
    tr.step_async(tok, tok)
    tr.step_async(tok, tok).result()          # grew after its second clean step, on the GPU
    assert tr.scaler.scale == 2.0 ** 7 and tr.scaler.growth_tracker == 1
    assert read(g, tr._amp.state, (4,))[0] == 2.0 ** 7


def test_a_scaler_of_its_own_runs_step_by_step():
    """A scaler that is not a DynamicLossScaler (any object with ``scale`` and ``update``)
    is not mirrored on the GPU: each step takes its scale from the host, and its update
    sees every step's overflow, in order."""
    class Scaler:
        def __init__(self):
            self.scale, self.seen = 8.0, []

        def update(self, overflow):
            self.seen.append(overflow)
            return not overflow
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=37)
    tok = np.random.default_rng(5).integers(0, 19, (2, 9))
    tr = G.ResidentTrainer(params, lr=1e-3, scaler=Scaler())
    assert not tr.pipelined_amp
    losses = [tr.step_async(tok, tok) for _ in range(3)]
    assert all(np.isfinite(p.result()) for p in losses)
    assert tr.scaler.seen == [False] * 3 and tr.t == 3


def test_amp_trainer_refuses_a_non_scaler():
    params = random_model(V=11, Dm=6, n_layers=1, D=12, N=3, K=2, R=1, seed=35)
    with pytest.raises(TypeError, match="scaler"):
        G.ResidentTrainer(params, scaler=2.0 ** 10)
