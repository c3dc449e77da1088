"""Whole-model API: float64 finite differences, checkpointing, loss scaling, validation."""
import numpy as np
import pytest

import mamba_ext
from mamba_ext.model import check_model_params, model_workspace_bytes
from mamba_ext.testing import reference

V, DM, NL = 7, 4, 2


def _model(dtype=np.float64, n_layers=NL, seed=1, vocab=V, d_model=DM):
    """A small model with O(1) random weights (init values are too small for a
    sharp finite-difference test) and A_log well inside the clamp."""
    p = mamba_ext.init_model_params(vocab, d_model, n_layers, d_state=3, d_conv=3, expand=2,
                                    dt_rank=2, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for k, a in p.items():
        if k.endswith("A_log"):
            p[k] = rng.uniform(-1.5, 1.5, a.shape)
        elif k.endswith(("normWeight", "final_norm", "D_vec")):
            p[k] = 1.0 + 0.3 * rng.standard_normal(a.shape)
        else:
            p[k] = 0.5 * rng.standard_normal(a.shape) / np.sqrt(a.shape[-1] if a.ndim == 2 else 1)
    p["embedding"] = 0.7 * rng.standard_normal(p["embedding"].shape)
    return {k: np.ascontiguousarray(a, dtype=dtype) for k, a in p.items()}


def _batch(seed=0, B=2, L=5, vocab=V):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, vocab - 1, size=(B, L + 1))   # id vocab-1 never appears
    seq[0, 1] = seq[0, 3] = seq[1, 2]                   # repeated ids: lookup grads accumulate
    return seq[:, :-1].copy(), seq[:, 1:].copy()


def _loss(tok, tgt, p):
    return mamba_ext.model_loss_and_grads(tok, tgt, p, n_threads=1)[0]


@pytest.mark.parametrize("name", ["embedding", "final_norm", "lm_head_bias", "layer0.wXProj",
                                  "layer0.A_log", "layer1.wInProj", "layer1.bDtProj",
                                  "layer0.normWeight", "layer1.D_vec"])
def test_gradients_match_float64_finite_differences(name):
    p = _model()
    tok, tgt = _batch()
    loss, grads = mamba_ext.model_loss_and_grads(tok, tgt, p, n_threads=1)
    ref_logits, ref_loss = reference.model_forward(tok, tgt, p)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    h = 1e-5
    g = grads[name]
    fd = np.zeros_like(g)
    for idx in np.ndindex(g.shape):        # every element (these tensors are tiny)
        q = dict(p)
        a = p[name].copy()
        a[idx] += h
        q[name] = a
        up = _loss(tok, tgt, q)
        a[idx] -= 2 * h
        down = _loss(tok, tgt, q)
        fd[idx] = (up - down) / (2 * h)
    err = np.max(np.abs(fd - g)) / np.max(np.abs(g))
    assert np.max(np.abs(g)) > 1e-4, f"{name}: gradient too small to test"
    assert err <= 1e-6, f"{name}: max|fd - analytic| / max|analytic| = {err:.3g}"
    if name == "embedding":   # id V-1 never occurs: only the head contributes to its row
        assert np.all(g[V - 1] != 0)


def test_every_gradient_by_random_direction():
    """Directional derivative along a random direction of every tensor at once."""
    p = _model(n_layers=3)
    tok, tgt = _batch(1)
    _, grads = mamba_ext.model_loss_and_grads(tok, tgt, p)
    rng = np.random.default_rng(5)
    for name in p:
        v = rng.standard_normal(p[name].shape)
        h = 1e-5
        up = _loss(tok, tgt, {**p, name: p[name] + h * v})
        down = _loss(tok, tgt, {**p, name: p[name] - h * v})
        fd, an = (up - down) / (2 * h), float(np.sum(grads[name] * v))
        assert abs(fd - an) <= 1e-6 * max(abs(an), 1e-3), (name, fd, an)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_is_bit_identical_and_uses_less_memory(dtype):
    # one thread: bit-identity needs deterministic block kernels, and the
    # recomputed caches are then exactly the forward's
    p = _model(dtype, n_layers=3)
    tok, tgt = _batch(2, B=3, L=9)
    loss0, g0 = mamba_ext.model_loss_and_grads(tok, tgt, p, checkpointing=False, n_threads=1)
    loss1, g1 = mamba_ext.model_loss_and_grads(tok, tgt, p, checkpointing=True, n_threads=1)
    assert loss0 == loss1
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    full = model_workspace_bytes(p, 3, 9, checkpointing=False)
    ckpt = model_workspace_bytes(p, 3, 9, checkpointing=True)
    assert ckpt < full


def test_loss_scale_multiplies_every_gradient_exactly():
    p = _model(np.float32)
    tok, tgt = _batch(3)
    loss1, g1 = mamba_ext.model_loss_and_grads(tok, tgt, p)
    loss8, g8 = mamba_ext.model_loss_and_grads(tok, tgt, p, loss_scale=8.0)
    assert loss8 == loss1                     # the returned loss is never scaled
    for k in g1:
        np.testing.assert_array_equal(g8[k], 8.0 * g1[k], err_msg=k)
    with pytest.raises(ValueError, match="loss_scale"):
        mamba_ext.model_loss_and_grads(tok, tgt, p, loss_scale=float("inf"))


def test_forward_logits_match_loss_and_reference():
    p = _model()
    tok, tgt = _batch(4)
    logits = mamba_ext.model_forward(tok, p)
    ref_logits, ref_loss = reference.model_forward(tok, tgt, p)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-12, atol=1e-13)
    for eps in (1e-5, 1e-2):                   # the eps setting reaches every RMSNorm
        ours = mamba_ext.model_forward(tok, p, eps=eps)
        ref, ref_loss = reference.model_forward(tok, tgt, p, eps=eps)
        np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-13)
        loss, _ = mamba_ext.model_loss_and_grads(tok, tgt, p, eps=eps)
        assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    assert not np.allclose(mamba_ext.model_forward(tok, p, eps=1e-2), logits)


def test_zero_layers_and_float32_agree_with_float64():
    p0 = _model(n_layers=0)
    tok, tgt = _batch(5)
    np.testing.assert_allclose(mamba_ext.model_forward(tok, p0),
                               reference.model_forward(tok, tgt, p0)[0], rtol=1e-12, atol=1e-13)
    p = _model()
    l64, g64 = mamba_ext.model_loss_and_grads(tok, tgt, p)
    l32, g32 = mamba_ext.model_loss_and_grads(tok, tgt, {k: v.astype(np.float32) for k, v in p.items()})
    assert abs(l32 - l64) <= 1e-5 * l64
    for k in g64:
        assert np.max(np.abs(g32[k] - g64[k])) <= 1e-4 * np.max(np.abs(g64[k])), k


def test_token_ids_out_of_range_name_id_and_position():
    p = _model(np.float32)
    tok, tgt = _batch(6)
    bad = tok.copy()
    bad[1, 2] = V
    with pytest.raises(ValueError, match=r"tokens: token id 7 at position \(batch 1, time 2\)"):
        mamba_ext.model_forward(bad, p)
    with pytest.raises(ValueError, match=r"tokens: token id 7 at position \(batch 1, time 2\)"):
        mamba_ext.model_loss_and_grads(bad, tgt, p)
    bad = tgt.copy()
    bad[0, 4] = -1
    with pytest.raises(ValueError, match=r"targets: token id -1 at position \(batch 0, time 4\)"):
        mamba_ext.model_loss_and_grads(tok, bad, p)
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 5\), got \(2, 4\)"):
        mamba_ext.model_loss_and_grads(tok, tgt[:, :4], p)
    with pytest.raises(TypeError, match="tokens"):
        mamba_ext.model_forward(tok.astype(np.float32), p)
    with pytest.raises(ValueError, match="tokens"):
        mamba_ext.model_forward(tok[0], p)
    # unsigned ids are checked as given: 2^63 + 3 must not wrap to a negative int64 id
    big = tok.astype(np.uint64)
    big[1, 3] = 2 ** 63 + 3
    with pytest.raises(ValueError, match=r"tokens: token id 9223372036854775811 at position "
                                         r"\(batch 1, time 3\) is out of range"):
        mamba_ext.model_forward(big, p)
    np.testing.assert_array_equal(mamba_ext.model_forward(tok.astype(np.uint64), p),
                                  mamba_ext.model_forward(tok, p))


def test_empty_batch():
    p = _model(np.float32)
    tok = np.zeros((0, 4), np.int64)
    assert mamba_ext.model_forward(tok, p).shape == (0, 4, V)
    with pytest.raises(ValueError, match="no positions"):
        mamba_ext.model_loss_and_grads(tok, tok, p)


def test_bad_params_are_named():
    p = _model(np.float32)
    tok, tgt = _batch()
    q = dict(p)
    del q["layer1.wConv"]
    with pytest.raises(ValueError, match=r"layer1\.wConv"):
        mamba_ext.model_forward(tok, q)
    with pytest.raises(ValueError, match="unknown.*layerX"):
        mamba_ext.model_forward(tok, {**p, "layerX.foo": p["final_norm"]})
    q = {k: v for k, v in p.items() if not k.startswith("layer0.")}
    with pytest.raises(ValueError, match="layer indices"):
        mamba_ext.model_forward(tok, q)
    with pytest.raises(TypeError, match=r"layer1\.A_log.*float64"):
        mamba_ext.model_forward(tok, {**p, "layer1.A_log": p["layer1.A_log"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"lm_head_bias: expected shape \(7,\)"):
        mamba_ext.model_forward(tok, {**p, "lm_head_bias": np.zeros(6, np.float32)})
    with pytest.raises(ValueError, match="embedding"):
        mamba_ext.model_forward(tok, {**p, "embedding": np.zeros(7, np.float32)})
    q = dict(p)
    q.update({k.replace("layer0.", "layer1."): v for k, v in
              mamba_ext.init_model_params(V, DM, 1, d_state=5, dt_rank=2).items()
              if k.startswith("layer0.")})
    with pytest.raises(ValueError, match="layer1: sizes"):
        mamba_ext.model_forward(tok, q)
    with pytest.raises(ValueError, match="eps"):
        mamba_ext.model_forward(tok, p, eps=0.0)


def test_param_names_and_init():
    names = mamba_ext.model_param_names(2)
    assert names[:3] == ("embedding", "final_norm", "lm_head_bias")
    assert names[3] == "layer0.wInProj" and names[-1] == "layer1.normWeight" and len(names) == 29
    p = mamba_ext.init_model_params(256, 32, 2, seed=0)
    assert tuple(p) == names
    arrays, dims = check_model_params(p)
    assert dims.V == 256 and dims.n_layers == 2 and dims.block.D == 64 and dims.block.N == 16
    assert all(a.dtype == np.float32 for a in p.values())
    assert np.all(p["final_norm"] == 1) and np.all(p["lm_head_bias"] == 0)
    again = mamba_ext.init_model_params(256, 32, 2, seed=0)
    assert all(np.array_equal(p[k], again[k]) for k in p)
    other = mamba_ext.init_model_params(256, 32, 2, seed=1)
    assert not np.array_equal(p["embedding"], other["embedding"])
    assert not np.array_equal(p["layer0.wInProj"], p["layer1.wInProj"])  # derived layer seeds
    tok, tgt = np.random.default_rng(0).integers(0, 256, (2, 2, 16))
    loss, _ = mamba_ext.model_loss_and_grads(tok, tgt, p)
    assert abs(loss - np.log(256)) < 0.05                                  # ~uniform at init


def test_model_param_names_keeps_its_earlier_spelling():
    assert mamba_ext.MODEL_PARAM_NAMES is mamba_ext.model_param_names
    assert mamba_ext.model_param_names(1)[:4] == ("embedding", "final_norm", "lm_head_bias",
                                                  "layer0.wInProj")
    with pytest.raises(ValueError, match="n_layers"):
        mamba_ext.model_param_names(-1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grads_ready_reports_each_gradient_once_when_final(checkpointing):
    """grads_ready(names, grads): the head's two, then each layer's 13 from the last layer
    to the first, the embedding last; at each call the reported entries already hold their
    final values (those returned) and the layers not yet reported are still zero; the
    results equal a call without it, bit for bit. An exception from the callback is
    raised after the backward; a non-callable is refused."""
    params = _model(np.float32, n_layers=3)
    tok, tgt = _batch()
    want_loss, want = mamba_ext.model_loss_and_grads(tok, tgt, params, checkpointing)
    calls = []

    def ready(names, grads):
        calls.append(list(names))
        for k in names:
            assert np.array_equal(grads[k], want[k]), k
        if names[0].startswith("layer"):
            i = int(names[0][5:names[0].index(".")])
            assert not grads[f"layer{i - 1}.wInProj"].any() if i > 0 else True
    loss, grads = mamba_ext.model_loss_and_grads(tok, tgt, params, checkpointing,
                                                 grads_ready=ready)
    assert loss == want_loss and all(np.array_equal(grads[k], want[k]) for k in want)
    names = mamba_ext.model_param_names(3)
    assert calls[0] == ["final_norm", "lm_head_bias"] and calls[-1] == ["embedding"]
    assert [c[0] for c in calls[1:-1]] == [f"layer{i}.wInProj" for i in (2, 1, 0)]
    assert sorted(k for c in calls for k in c) == sorted(names)

    def fails(names, grads):
        raise KeyError("from the callback")
    with pytest.raises(KeyError, match="from the callback"):
        mamba_ext.model_loss_and_grads(tok, tgt, params, grads_ready=fails)
    with pytest.raises(TypeError, match="grads_ready"):
        mamba_ext.model_loss_and_grads(tok, tgt, params, grads_ready=3)
