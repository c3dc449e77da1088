"""Recurrent inference (mamba_ext.recurrent): step() one token at a time equals the
full forward at every position — against the golden model files, the float64 NumPy
reference (both discretizations, several eps) and mamba_ext.model_forward — plus
greedy generation, state branching, constant state size, and bad input; then the
compiled step's own cases: several channel blocks and thread counts, float16 weight
storage, the prefill, ragged prompts, the sampling filters against Hugging Face's logits
warpers, stop sequences, and bad sampling values.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_golden_close, load_golden, optional

from mamba_ext._validate import BlockDims, block_param_shapes
from mamba_ext import model_forward
from mamba_ext.recurrent import STOPPED, filter_logits, generate, init_state, sample_logits, step
from mamba_ext.testing import reference as ref


def _random_params(seed, V=13, Dm=6, D=12, N=3, K=4, R=2, n_layers=2, dtype=np.float32):
    rng = np.random.default_rng(seed)
    p = {"embedding": rng.normal(0, 0.5, (V, Dm)), "final_norm": rng.normal(1, 0.2, Dm),
         "lm_head_bias": rng.normal(0, 0.3, V)}
    for i in range(n_layers):
        for name, shape in block_param_shapes(BlockDims(Dm=Dm, D=D, N=N, K=K, R=R)).items():
            if name == "A_log":
                v = rng.uniform(-2, 2, shape)
            elif name == "bDtProj":
                v = rng.uniform(-2, 0.5, shape)
            elif name.startswith("b"):
                v = rng.normal(0, 0.3, shape)
            elif name in ("D_vec", "normWeight"):
                v = rng.normal(1, 0.3, shape)
            else:
                v = rng.normal(0, 1 / np.sqrt(shape[-1]), shape)
            p[f"layer{i}.{name}"] = v
    return {k: v.astype(dtype) for k, v in p.items()}


def _run_steps(params, tokens, **kw):
    """logits (B, L, V) of step() fed tokens[:, t] for t = 0..L-1."""
    state = init_state(params, tokens.shape[0], **kw)
    return np.stack([step(tokens[:, t], params, state)[0] for t in range(tokens.shape[1])], axis=1)


def _reference_logits(params, tokens, eps, discretization):
    """float64 reference model forward with a chosen eps and discretization."""
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = w["embedding"][tokens]                                   # (B, L, Dm)
    i = 0
    while f"layer{i}.wInProj" in w:
        h = ref.block_forward(h, ref.block_params_of_layer(w, i), eps, discretization)
        i += 1
    return ref.rmsnorm(h, w["final_norm"], eps) @ w["embedding"].T + w["lm_head_bias"]


@pytest.mark.parametrize("case", ["model_1layer", "model_2layer"])
def test_step_reproduces_golden_logits(case):
    g = load_golden(case)
    params = {k[2:]: v for k, v in g.items() if k.startswith("w_")}
    logits = _run_steps(params, g["tokens"])                  # zoh, eps 1e-6: the golden semantics
    assert_golden_close("logits", logits, g["logits"], case)


SHAPES = [  # V, Dm, D, N, K, R, layers, B, L
    (13, 6, 12, 3, 4, 2, 2, 2, 9),
    (7, 4, 8, 1, 1, 1, 1, 3, 5),        # dState 1, dConv 1 (empty conv tail)
    (11, 5, 10, 4, 4, 1, 3, 1, 2),      # seqLen < dConv
    (17, 8, 16, 4, 2, 3, 1, 2, 12),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V%d_Dm%d_D%d_N%d_K%d_R%d_l%d_B%d_L%d" % s)
@pytest.mark.parametrize("discretization", ["zoh", "euler"])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_step_matches_float64_reference_every_position(shape, discretization, eps):
    V, Dm, D, N, K, R, nl, B, L = shape
    for dtype, rule in ((np.float32, "golden"), (np.float64, 1e-11)):
        p = _random_params(sum(shape), V, Dm, D, N, K, R, nl, dtype)
        tokens = np.random.default_rng(L).integers(0, V, (B, L))
        ours = _run_steps(p, tokens, eps=eps, discretization=discretization)
        want = _reference_logits(p, tokens, eps, discretization)
        assert ours.dtype == dtype
        if rule == "golden":
            assert_golden_close("logits", ours, want.astype(np.float32), "random")
        else:
            np.testing.assert_allclose(ours, want, rtol=0, atol=rule * np.abs(want).max())


def test_discretization_and_eps_change_the_result():
    # the settings are really used: each one alone moves the logits well past rounding
    p = _random_params(5)
    tokens = np.random.default_rng(0).integers(0, 13, (2, 6))
    base = _run_steps(p, tokens)
    tiny = 1e-3 * np.abs(base).max()
    assert np.abs(_run_steps(p, tokens, discretization="euler") - base).max() > tiny
    assert np.abs(_run_steps(p, tokens, eps=0.05) - base).max() > tiny


@pytest.mark.parametrize("discretization", ["zoh", "euler"])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_step_matches_model_forward(discretization, eps):
    p = _random_params(9, V=19, Dm=8, D=16, N=4, K=4, R=2, n_layers=2)
    tokens = np.random.default_rng(1).integers(0, 19, (3, 14))
    full = model_forward(tokens, p, eps=eps, discretization=discretization)
    ours = _run_steps(p, tokens, eps=eps, discretization=discretization)
    # both float32: the golden README rule for a float32 re-implementation
    assert_golden_close("logits", ours, full, "random")


def test_greedy_generate_equals_rerunning_the_forward():
    p = _random_params(11, V=23, Dm=8, D=16, N=4, K=3, R=1, n_layers=2)
    prompt = np.array([[3, 1, 4], [15, 9, 2]])
    out = generate(p, prompt, 12)
    ctx = prompt
    for _ in range(12):                           # the quadratic way: whole forward each token
        nxt = np.argmax(model_forward(ctx, p)[:, -1], axis=-1)
        ctx = np.concatenate([ctx, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(out, ctx[:, prompt.shape[1]:])


def test_sampling_is_seeded_and_in_range():
    p = _random_params(12)
    prompt = np.array([[0], [5]])
    a = generate(p, prompt, 20, temperature=1.0, rng=np.random.default_rng(3))
    b = generate(p, prompt, 20, temperature=1.0, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 20) and a.min() >= 0 and a.max() < 13
    assert generate(p, prompt, 0).shape == (2, 0)


def test_state_has_constant_size_and_copy_branches():
    p = _random_params(13)
    state = init_state(p, 2)
    sizes = [a.shape for a in state.h + state.conv]
    assert sizes == [(2, 12, 3)] * 2 + [(2, 12, 3)] * 2   # h (B, D, N) and conv tail (B, D, K-1)
    rng = np.random.default_rng(0)
    for _ in range(50):
        step(rng.integers(0, 13, 2), p, state)
    assert [a.shape for a in state.h + state.conv] == sizes and state.position == 50
    branch = state.copy()
    la, _ = step(np.array([1, 2]), p, state)
    lb, _ = step(np.array([1, 2]), p, branch)             # same token: same logits
    np.testing.assert_array_equal(la, lb)
    lc, _ = step(np.array([7, 7]), p, branch)             # branch moves on alone
    ld, _ = step(np.array([7, 7]), p, state)
    np.testing.assert_array_equal(lc, ld)
    assert not np.array_equal(la, lc)


def test_params_replaced_between_steps_are_revalidated():
    p = _random_params(14)
    state = init_state(p, 1)
    step(np.array([0]), p, state)
    with pytest.raises(ValueError, match="state: built for 2 layer"):   # dConv 3, not 4
        step(np.array([0]), _random_params(14, K=3), state)
    other = _random_params(15, n_layers=1)
    with pytest.raises(ValueError, match="call init_state"):
        step(np.array([0]), other, state)


@pytest.mark.parametrize("call, exc, match", [
    (lambda p, s: step(np.array([1, 2, 3]), p, s), ValueError, r"token_ids: expected shape \(2,\)"),
    (lambda p, s: step(np.array([[1, 2]]), p, s), ValueError, r"token_ids: expected shape \(2,\)"),
    (lambda p, s: step(np.array([1, 13]), p, s), ValueError, "token id 13 .* out of range"),
    (lambda p, s: step(np.array([1.0, 2.0]), p, s), TypeError, "integer array"),
    (lambda p, s: init_state(p, 0), ValueError, r"batch: expected an integer in \[1, "),
    (lambda p, s: init_state(p, 2, discretization="rk4"), ValueError, "discretization"),
    (lambda p, s: init_state(p, 2, eps=-1.0), ValueError, "eps"),
    (lambda p, s: init_state({k: v for k, v in p.items() if k != "final_norm"}, 2), ValueError,
     "final_norm"),
    (lambda p, s: generate(p, np.zeros((1, 0), np.int64), 3), ValueError, "prompt: expected at least one"),
    (lambda p, s: generate(p, np.zeros((1, 1), np.int64), -1), ValueError, "n_tokens"),
])
def test_bad_input(call, exc, match):
    p = _random_params(16)
    with pytest.raises(exc, match=match):
        call(p, init_state(p, 2))


# --- the compiled step (mamba_ext.cpu.recurrent) and sampling ---

WIDE = dict(V=37, Dm=24, D=600, N=5, K=4, R=3, n_layers=2)   # D over two channel blocks


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("discretization", ["zoh", "euler"])
def test_step_equals_forward_every_position_wide_batched(n_threads, discretization):
    p = _random_params(21, **WIDE)
    tokens = np.random.default_rng(2).integers(0, WIDE["V"], (3, 11))
    full = model_forward(tokens, p, discretization=discretization)
    state = init_state(p, 3, discretization=discretization)
    ours = np.stack([step(tokens[:, t], p, state, n_threads=n_threads)[0]
                     for t in range(tokens.shape[1])], axis=1)
    assert_golden_close("logits", ours, full, "random")


def _rounded_to_half(p):
    """The params with the arrays stored as float16 rounded (what weights_dtype float16 reads)."""
    half = ("wInProj", "wXProj", "wDtProj", "wOutProj")
    return {k: (v.astype(np.float16).astype(np.float32)
                if k == "embedding" or k.split(".")[-1] in half else v) for k, v in p.items()}


def test_float16_weights_equal_the_forward_of_the_rounded_weights():
    p = _random_params(22, **WIDE)
    tokens = np.random.default_rng(3).integers(0, WIDE["V"], (2, 9))
    full = model_forward(tokens, _rounded_to_half(p))
    state = init_state(p, 2)
    ours = np.stack([step(tokens[:, t], p, state, weights_dtype="float16")[0]
                     for t in range(tokens.shape[1])], axis=1)
    assert ours.dtype == np.float32
    assert_golden_close("logits", ours, full, "random")
    # and the rounding is real: float32 weights give visibly different logits
    assert np.abs(_run_steps(p, tokens) - ours).max() > 1e-5 * np.abs(ours).max()


@pytest.mark.parametrize("B, Dm, D", [(1, 13, 26), (2, 24, 56), (3, 40, 78), (5, 8, 16),
                                     (3, 16, 530), (5, 16, 530)])
def test_float16_weights_any_batch_and_width(B, Dm, D):
    """The float16 product's paths (short rows: in fours and one by one, batch rows in pairs
    and alone, 16-, 8- and 1-wide steps along the input; rows of 512 and more (D 530: x_proj
    and out_proj) one by one, batch rows in fours and alone) against the forward of the
    rounded weights."""
    p = _random_params(40 + B, V=31, Dm=Dm, D=D, N=4, K=3, R=3, n_layers=2)
    tokens = np.random.default_rng(B).integers(0, 31, (B, 5))
    full = model_forward(tokens, _rounded_to_half(p))
    state = init_state(p, B)
    ours = np.stack([step(tokens[:, t], p, state, weights_dtype="float16")[0]
                     for t in range(tokens.shape[1])], axis=1)
    assert_golden_close("logits", ours, full, "random")


def test_prefill_then_steps_equal_steps_alone():
    # generate's chunked prefill leaves the same state as feeding the prompt step by step
    p = _random_params(23, V=29, Dm=8, D=16, N=4, K=4, R=2, n_layers=3)
    prompt = np.random.default_rng(4).integers(0, 29, (2, 70))      # > one SCAN_CHUNK? any L
    out = generate(p, prompt, 15)
    state = init_state(p, 2)
    for t in range(prompt.shape[1]):
        logits, _ = step(prompt[:, t], p, state)
    want = []
    for _ in range(15):
        nxt = np.argmax(logits, axis=-1)
        want.append(nxt)
        logits, _ = step(nxt, p, state)
    np.testing.assert_array_equal(out, np.stack(want, axis=1))


def test_ragged_prompts_equal_one_by_one():
    p = _random_params(24, V=23, Dm=8, D=16, N=4, K=3, R=1, n_layers=2)
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6, 5]]
    together = generate(p, prompts, 10)
    for b, pr in enumerate(prompts):
        np.testing.assert_array_equal(together[b], generate(p, np.array([pr]), 10)[0])


def test_float16_generation_runs_and_mostly_agrees():
    p = _random_params(25, **WIDE)
    prompt = np.random.default_rng(5).integers(0, WIDE["V"], (2, 6))
    a = generate(p, prompt, 8)
    b = generate(p, prompt, 8, weights_dtype="float16")
    assert b.shape == a.shape and b.min() >= 0 and b.max() < WIDE["V"]
    assert (a[:, 0] == b[:, 0]).all()            # the first token comes from the same prefill


def _hf_filtered(logits, temperature, top_k, top_p):
    torch = optional("torch", "reference of the sampling filters")
    lp = optional("transformers.generation.logits_process", "reference of the sampling filters")
    s = torch.tensor(logits, dtype=torch.float64)
    s = lp.TemperatureLogitsWarper(temperature)(None, s)
    if top_k:
        s = lp.TopKLogitsWarper(top_k)(None, s)
    if top_p < 1:
        s = lp.TopPLogitsWarper(top_p)(None, s)
    return s.numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 10, 0.8), (1.0, 1, 1.0), (2.0, 0, 0.05),
    (1.0, 100, 1.0)])
def test_filters_keep_the_tokens_hugging_face_keeps(temperature, top_k, top_p):
    logits = np.random.default_rng(6).normal(0, 3, (4, 50))
    ours = filter_logits(logits, temperature, top_k, top_p)
    hf = _hf_filtered(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(hf))
    np.testing.assert_allclose(ours[np.isfinite(ours)], hf[np.isfinite(hf)], rtol=1e-12)


def test_top_k_one_and_tiny_top_p_are_greedy_and_sampling_is_seeded():
    p = _random_params(26)
    prompt = np.array([[0, 1], [5, 2]])
    greedy = generate(p, prompt, 12)
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(generate(p, prompt, 12, temperature=1.5, top_k=1, rng=rng), greedy)
    np.testing.assert_array_equal(generate(p, prompt, 12, temperature=1.0, top_p=1e-9, rng=rng), greedy)
    a = generate(p, prompt, 30, temperature=1.0, top_k=5, top_p=0.9, rng=np.random.default_rng(7))
    b = generate(p, prompt, 30, temperature=1.0, top_k=5, top_p=0.9, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, greedy)


def test_sampling_draws_follow_the_filtered_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 20000))
    ids = sample_logits(logits, 1.0, 0, 0.7, np.random.default_rng(1))  # top-p keeps {0, 1}
    freq = np.bincount(ids, minlength=4) / ids.size
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.015)


def test_stop_sequence_ends_that_sequence_only():
    p = _random_params(27)
    prompt = np.array([[0, 1], [5, 2]])
    free = generate(p, prompt, 12)
    stop = [list(free[0, 3:5])]                  # row 0 generates it at positions 3-4
    out = generate(p, prompt, 12, stop=stop)
    row0_end = next(j for j in range(1, 12) if list(free[0, j - 1:j + 1]) == stop[0]) + 1
    np.testing.assert_array_equal(out[0, :row0_end], free[0, :row0_end])   # stop tokens kept (HF)
    assert (out[0, row0_end:] == STOPPED).all()
    hit1 = [j + len(stop[0]) for j in range(12 - 1) if list(free[1, j:j + 2]) == stop[0]]
    end1 = hit1[0] if hit1 else 12
    np.testing.assert_array_equal(out[1, :end1], free[1, :end1])
    # a stop sequence may straddle the prompt and the output, as HF matches its end
    out2 = generate(p, prompt[:1], 5, stop=[[1, int(free[0, 0])]])
    assert out2[0, 0] == free[0, 0] and (out2[0, 1:] == STOPPED).all()


@pytest.mark.parametrize("kw, exc, match", [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="1"), TypeError, "temperature"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_p=0.0), ValueError, r"top_p: expected a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(stop=[[]]), ValueError, r"stop\[0\]: expected at least one"),
    (dict(stop=[[99]]), ValueError, r"stop\[0\]: token id 99"),
    (dict(stop="ab"), TypeError, "stop"),
    (dict(stop=[np.array([2 ** 63 + 5], np.uint64)]), ValueError,
     r"stop\[0\]: token id 9223372036854775813 at position \(batch 0, time 0\) does not fit"),
    (dict(weights_dtype="int8"), ValueError, "weights_dtype"),
    (dict(n_threads=0), ValueError, "n_threads"),
])
def test_bad_sampling_values(kw, exc, match):
    p = _random_params(28)
    with pytest.raises(exc, match=match):
        generate(p, np.array([[1, 2]]), 3, **kw)


def test_float16_weights_need_float32_and_the_half_range():
    p64 = _random_params(29, dtype=np.float64)
    with pytest.raises(ValueError, match="weights_dtype: float16 weights need float32"):
        generate(p64, np.array([[1]]), 2, weights_dtype="float16")
    p = _random_params(29)
    p["layer1.wOutProj"] = p["layer1.wOutProj"] * 0 + 1e5
    with pytest.raises(ValueError, match="layer1.wOutProj has values beyond the float16 range"):
        generate(p, np.array([[1]]), 2, weights_dtype="float16")
    with pytest.raises(ValueError, match=r"prompt\[1\]: token id 13 at position 0 is out of range"):
        generate(p, [[1], [13]], 2)
    # an unsigned id past int64 is named as given (not wrapped to a negative one)
    with pytest.raises(ValueError, match=r"prompt: token id 9223372036854775813 at position "
                                         r"\(batch 0, time 1\) does not fit"):
        generate(p, np.array([[1, 2 ** 63 + 5]], np.uint64), 2)
