"""kernels/adamw.wgsl through the resident trainer (mamba_ext.gpu.ResidentTrainer):
AdamW steps against mamba_ext.AdamW on the CPU, the NaN guard, the optimizer state
in the CPU's format, the model's eps and discretization."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import nerr, random_model, require_gpu

require_gpu()
import mamba_ext  # noqa: E402
from mamba_ext import gpu as G  # noqa: E402
from mamba_ext.gpu import scan as gpu_scan  # noqa: E402


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("max_delta", [0.0, 2e-3])
def test_trainer_matches_cpu_adamw(max_delta, monkeypatch):
    monkeypatch.setattr(gpu_scan, "SCAN_CHUNK", 4)
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


class _OneRank:
    """A one-rank stand-in for Distributed: flat_stream() with the FlatStream protocol
    (the mean over one rank is the identity); ``fail_at``: the part whose add raises."""

    def __init__(self, fail_at=None):
        self.fail_at, self.parts = fail_at, []

    def flat_stream(self):
        return self

    def add(self, part, unscale=None):
        if len(self.parts) == self.fail_at:
            raise RuntimeError("simulated failure of an all-reduce")
        if unscale is not None:
            unscale([part])
        self.parts.append(part.size)

    def progress(self):
        pass

    def finish(self, loss=0.0, overflow=False):
        return loss, overflow


@pytest.mark.parametrize("thread_safe", [True, False])
def test_trainer_streamed_reduce_equals_the_plain_step_and_survives_a_failure(monkeypatch,
                                                                             thread_safe):
    """The distributed path (segments submitted by a feeder thread, or all queued first
    where the device is not thread-safe as Dawn's, each layer's gradients read back and
    handed to the all-reduce as they finish, written back) gives the plain step's bits on
    one rank, hands over every gradient once, and a failing all-reduce leaves the trainer
    usable (its staging buffers unmapped)."""
    from mamba_ext.gpu.device import gpu
    if thread_safe and not gpu().thread_safe:
        pytest.skip("this device is not thread-safe (Dawn): the trainer never runs a feeder "
                    "thread on it, so the test may not force one")
    monkeypatch.setattr(gpu(), "thread_safe", thread_safe)
    params = random_model(V=13, Dm=8, n_layers=3, D=16, N=4, K=4, R=1, seed=21)
    tok = np.arange(3 * 9).reshape(3, 9) % 13
    plain = G.ResidentTrainer(params, lr=1e-2)
    streamed = G.ResidentTrainer(params, lr=1e-2)
    for _ in range(2):
        one = _OneRank()
        assert streamed.step(tok, tok, reduce=one) == plain.step(tok, tok)
        assert sum(one.parts) == streamed.n and len(one.parts) > 3 + 2   # per layer, and more
    for k, v in plain.params().items():
        assert np.array_equal(streamed.params()[k], v), k
    with pytest.raises(RuntimeError, match="simulated failure"):
        streamed.step(tok, tok, reduce=_OneRank(fail_at=2))
    streamed.step(tok, tok, reduce=_OneRank())                 # runs again


def test_trainer_lowers_loss():
    params = random_model(V=13, Dm=8, n_layers=1, D=16, N=4, K=4, R=1, seed=9)
    tr = G.ResidentTrainer(params, lr=2e-2)
    seq = np.arange(2 * 13).reshape(2, 13) % 13
    tok, tgt = seq, (seq + 1) % 13          # learnable: next id
    first = tr.step(tok, tgt)
    for _ in range(25):
        last = tr.step(tok, tgt)
    assert last < 0.5 * first


@pytest.mark.parametrize("disc,model_eps", [("euler", 1e-6), ("zoh", 1e-3)])
def test_trainer_model_eps_and_discretization(disc, model_eps):
    """The trainer's loss is the CPU model's with the same eps and discretization."""
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=23)
    tok = np.random.default_rng(5).integers(0, 19, (2, 9))
    tr = G.ResidentTrainer(params, model_eps=model_eps, discretization=disc)
    loss = tr.step(tok, tok)
    c_loss, _ = mamba_ext.model_loss_and_grads(tok, tok, params, eps=model_eps,
                                               discretization=disc)
    other, _ = mamba_ext.model_loss_and_grads(tok, tok, params)
    assert abs(loss - c_loss) <= 1e-6 * abs(c_loss)
    assert abs(loss - other) > 1e-5 * abs(c_loss)        # the settings did change the loss


def test_trainer_bad_settings():
    params = random_model(V=11, Dm=6, n_layers=1, D=12, N=3, K=2, R=1, seed=35)
    with pytest.raises(ValueError, match="discretization"):
        G.ResidentTrainer(params, discretization="exact")
    with pytest.raises(ValueError, match="eps"):
        G.ResidentTrainer(params, model_eps=-1.0)
    with pytest.raises(ValueError, match="lr"):
        G.ResidentTrainer(params, lr=float("nan"))


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


def test_trainer_checkpointing_same_steps():
    """ResidentTrainer(checkpointing=True) takes the very same steps (bit for bit)."""
    params = random_model(V=17, Dm=8, n_layers=2, D=16, N=4, K=3, R=1, seed=41)
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, 17, (2, 33)), rng.integers(0, 17, (2, 33))) for _ in range(3)]
    plain = G.ResidentTrainer(params, lr=1e-2)
    ckpt = G.ResidentTrainer(params, lr=1e-2, checkpointing=True)
    for tok, tgt in batches:
        assert ckpt.step(tok, tgt) == plain.step(tok, tgt)
    a, b = plain.params(), ckpt.params()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_trainer_pre_encoded_steps_same_bits(monkeypatch):
    """Each step runs the command buffer encoded during the previous step of its shape
    (Gpu.encode): the same steps, bit for bit, as encoding every step at its submit,
    with batch shapes alternating and the learning rate changed between steps."""
    params = random_model(V=17, Dm=8, n_layers=2, D=16, N=4, K=3, R=1, seed=43)
    rng = np.random.default_rng(3)
    shapes = [(2, 9), (1, 13), (2, 9), (2, 9), (2, 9), (1, 13)]
    batches = [(rng.integers(0, 17, s), rng.integers(0, 17, s)) for s in shapes]
    pre = G.ResidentTrainer(params, lr=1e-2)
    plain = G.ResidentTrainer(params, lr=1e-2)
    plain.pre_encode = False
    used = []                   # whether the step found its command buffer encoded
    for i, (tok, tgt) in enumerate(batches):
        if i == 3:
            pre.lr = plain.lr = 3e-3            # a new uniform value, written before the submit
        used.append(tok.shape in pre._next)
        assert pre.step(tok, tgt) == plain.step(tok, tgt)
        assert not plain._next
    # steps 4 and 5: only the last step's shape is kept encoded
    assert used == [False, False, False, True, True, False]
    a, b = pre.params(), plain.params()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embedding"], params["embedding"])


def test_trainer_step_async_same_bits_with_a_skipped_step_in_flight():
    """step_async submits a step before the one before it is read back: the same losses,
    weights, step and skip counts, bit for bit, as step(), with the batch shape
    alternating, the learning rate changed, and a step skipped (non-finite gradients)
    while the next one is already submitted: the GPU's count of steps taken picks the
    bias corrections (t_c + 1 or t_c + 2, kernels/adamw.wgsl)."""
    from mamba_ext.gpu.device import gpu
    params = random_model(V=17, Dm=8, n_layers=2, D=16, N=4, K=3, R=1, seed=44)
    rng = np.random.default_rng(5)
    shapes = [(2, 9), (2, 9), (1, 13), (2, 9), (2, 9), (2, 9), (1, 13)]
    batches = [(rng.integers(0, 17, s), rng.integers(0, 17, s)) for s in shapes]
    runs = {}
    for mode in ("sync", "async"):
        tr = G.ResidentTrainer(params, lr=1e-2, betas=(0.8, 0.9))
        off = 4 * (tr.offs["lm_head_bias"] + 3)
        losses, pending = [], None
        for i, (tok, tgt) in enumerate(batches):
            if i == 3:
                tr.lr = 3e-3
            # step 4 runs on a NaN logit bias (every gradient non-finite: skipped); the
            # writes are queued behind the steps submitted before them
            if i in (4, 5):
                gpu().write(tr.w, np.array([np.nan if i == 4 else 0.25], np.float32), off)
            if mode == "sync":
                losses.append(tr.step(tok, tgt))
            else:
                nxt = tr.step_async(tok, tgt)
                assert pending is None or pending.done        # read back at this submit
                if pending is not None:
                    losses.append(pending.result())
                pending = nxt
                assert not pending.done
        if pending is not None:
            losses.append(pending.result())
            assert pending.done and pending.result() == losses[-1]
        runs[mode] = (losses, tr.params(), tr.t, tr.skipped)
    (la, pa, ta, sa), (lb, pb, tb, sb) = runs["sync"], runs["async"]
    assert (ta, sa) == (tb, sb) == (6, 1)
    assert np.isnan(la[4]) and np.isnan(lb[4])
    assert la[:4] + la[5:] == lb[:4] + lb[5:]
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_trainer_step_async_state_reads_back_the_pending_step_and_count_wraps():
    """state_dict() (and params(), step()) read back a pending step first; the GPU's step
    count is kept mod COUNT_MOD and set from a loaded state."""
    from mamba_ext.gpu.adamw import COUNT_MOD
    from mamba_ext.gpu.device import gpu
    params = random_model(V=11, Dm=6, n_layers=1, D=12, N=3, K=2, R=1, seed=6)
    tok = np.arange(10).reshape(2, 5) % 11
    tr = G.ResidentTrainer(params, lr=1e-2)
    p = tr.step_async(tok, tok)
    assert tr.t == 0 and not p.done
    state = tr.state_dict()
    assert p.done and tr.t == 1 and state["step"] == 1
    state["step"] = COUNT_MOD - 1
    tr.load_state_dict(state)
    assert gpu().read(tr._adamw.stat, 3)[2] == COUNT_MOD - 1
    tr.step_async(tok, tok)
    tr.step(tok, tok)
    assert tr.t == COUNT_MOD + 1 and gpu().read(tr._adamw.stat, 3)[2] == 1
