"""Recurrent inference (mamba_ext.recurrent): step() one token at a time equals the
full forward at every position — against the golden model files, the float64 NumPy
reference (both discretizations, several eps) and mamba_ext.model_forward — plus
greedy generation, state branching, constant state size, and bad input.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_golden_close, load_golden

from mamba_ext._validate import BlockDims, block_param_shapes
from mamba_ext.recurrent import generate, init_state, step
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
    from mamba_ext import model_forward
    p = _random_params(9, V=19, Dm=8, D=16, N=4, K=4, R=2, n_layers=2)
    tokens = np.random.default_rng(1).integers(0, 19, (3, 14))
    full = model_forward(tokens, p, eps=eps, discretization=discretization)
    ours = _run_steps(p, tokens, eps=eps, discretization=discretization)
    # both float32: the golden README rule for a float32 re-implementation
    assert_golden_close("logits", ours, full, "random")


def test_greedy_generate_equals_rerunning_the_forward():
    from mamba_ext import model_forward
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
