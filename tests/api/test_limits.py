"""Limits and all-or-nothing updates (issue 13): size-like arguments have bounds with a
ValueError naming the limit; no size wraps around; AdamW.step changes nothing when it
refuses; layer keys parse strictly."""
from __future__ import annotations

import numpy as np
import pytest

import mamba_ext
from mamba_ext import AdamW, clip_grad_norm
from mamba_ext._validate import check_n_threads, max_threads
from mamba_ext.model import model_workspace_bytes
from mamba_ext.recurrent import generate, init_state


def _model(**kw):
    return mamba_ext.init_model_params(11, 4, 2, d_state=2, seed=0, **kw)


def _block():
    p = _model()
    return {k[len("layer0."):]: v for k, v in p.items() if k.startswith("layer0.")}


@pytest.mark.parametrize("bad", [1000, 65536, 2 ** 40, max_threads() + 1, 0, -1])
def test_n_threads_beyond_the_limit_is_refused_everywhere(bad):
    limit = max_threads()
    assert 64 <= limit <= 1024
    p = _model()
    tok = np.zeros((1, 3), np.int64)
    calls = [
        lambda: mamba_ext.mamba1_forward(np.zeros((1, 2, 4), np.float32), _block(), n_threads=bad),
        lambda: mamba_ext.model_forward(tok, p, n_threads=bad),
        lambda: mamba_ext.model_loss_and_grads(tok, tok, p, n_threads=bad),
        lambda: AdamW(p, n_threads=bad),
        lambda: clip_grad_norm({"x": np.ones(3)}, 1.0, n_threads=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=rf"n_threads: expected None or an integer in \[1, {limit}\]"):
            call()


def test_n_threads_at_the_limit_and_types():
    assert check_n_threads(None) == 0 and check_n_threads(max_threads()) == max_threads()
    assert check_n_threads(np.int32(3)) == 3
    for bad in (True, 2.0, "4"):
        with pytest.raises(TypeError, match="n_threads"):
            check_n_threads(bad)


def test_workspace_formula_in_python_equals_the_compiled_one():
    """model._workspace_bytes_exact (Python integers) guards the compiled formula against
    overflow: the two must agree wherever the compiled one cannot wrap."""
    from mamba_ext.model import _workspace_bytes_exact, check_model_params
    for nl in (0, 1, 3):
        p = mamba_ext.init_model_params(13, 4, nl, d_state=3, d_conv=2)
        _, dims = check_model_params(p)
        for B, L in ((0, 0), (1, 1), (2, 63), (3, 64), (2, 65), (5, 1000)):
            for cp in (False, True):
                assert model_workspace_bytes(p, B, L, cp) == _workspace_bytes_exact(dims, B, L, cp, 4)


def test_workspace_bytes_never_wraps():
    p = _model()
    small = model_workspace_bytes(p, 2, 5)
    assert small > 0 and model_workspace_bytes(p, 2, 5, checkpointing=True) < small
    assert model_workspace_bytes(p, 0, 0) == 0
    for B, L in ((2 ** 40, 2 ** 40), (2 ** 55, 1), (1, 2 ** 55)):
        with pytest.raises(ValueError, match="more than the"):
            model_workspace_bytes(p, B, L)
    for B, L in ((2 ** 62, 1), (1, 2 ** 64)):
        with pytest.raises(ValueError, match=r"(batch|seq_len): expected an integer in \[0, "):
            model_workspace_bytes(p, B, L)
    with pytest.raises(ValueError, match=r"batch: expected an integer in \[0, "):
        model_workspace_bytes(p, -1, 5)
    with pytest.raises(TypeError, match="seq_len"):
        model_workspace_bytes(p, 1, 5.0)
    # monotone in every size: no silent wrap to a small number anywhere below the limit
    prev = 0
    for e in range(0, 40):
        try:
            b = model_workspace_bytes(p, 1, 2 ** e)
        except ValueError:
            break
        assert b > prev
        prev = b


@pytest.mark.parametrize("call, name", [
    (lambda p: init_state(p, 0), "batch"),
    (lambda p: init_state(p, 2 ** 56), r"state h|init_state\(batch=.*GiB"),
    (lambda p: init_state(p, 2 ** 62), "batch"),
    (lambda p: init_state(p, True), "batch"),
    (lambda p: generate(p, np.zeros((1, 1), np.int64), -1), "n_tokens"),
    (lambda p: generate(p, np.zeros((1, 1), np.int64), 2 ** 62), "n_tokens"),
    (lambda p: generate(p, np.zeros((2 ** 4, 1), np.int64), 2 ** 56), "the output"),
    (lambda p: generate(p, np.zeros((1, 1), np.int64), 2, temperature="0.5"), "temperature"),
    (lambda p: mamba_ext.init_model_params(2 ** 31, 4, 1), "vocab_size"),
    (lambda p: mamba_ext.init_model_params(2 ** 30, 2 ** 30, 1), "embedding"),
    (lambda p: mamba_ext.init_mamba1_params(2 ** 30, expand=4), "dInner"),
    (lambda p: mamba_ext.init_mamba1_params(4, d_state=0), "d_state"),
])
def test_size_arguments_have_limits(call, name):
    with pytest.raises((TypeError, ValueError), match=name):
        call(_model())


def test_adamw_step_is_all_or_nothing():
    params = {"a": np.ones(5, np.float32), "b": np.ones(3, np.float32), "c": np.ones(2, np.float32)}
    opt = AdamW(params, lr=0.1)
    grads = {k: np.full_like(v, 0.5) for k, v in params.items()}
    assert opt.step(grads)
    before = ({k: v.copy() for k, v in params.items()}, {k: v.copy() for k, v in opt.exp_avg.items()},
              opt.step_count)
    params["c"].flags.writeable = False                # a later parameter became read-only
    with pytest.raises(ValueError, match=r"params\['c'\].*nothing was updated"):
        opt.step(grads)
    for k in params:
        np.testing.assert_array_equal(params[k], before[0][k])
        np.testing.assert_array_equal(opt.exp_avg[k], before[1][k])
    assert opt.step_count == before[2]
    params["c"].flags.writeable = True
    opt.exp_avg["b"] = np.zeros(4, np.float32)        # a moment replaced by one of another shape
    with pytest.raises(TypeError, match=r"exp_avg\['b'\]"):
        opt.step(grads)
    np.testing.assert_array_equal(params["a"], before[0]["a"])
    opt.exp_avg["b"] = before[1]["b"].copy()
    opt.n_threads = 10 ** 6
    with pytest.raises(ValueError, match="n_threads"):
        opt.step(grads)
    opt.n_threads = 0
    assert opt.step(grads) and opt.step_count == before[2] + 1


@pytest.mark.parametrize("key", ["layer00.wInProj", "layer\u0660.wInProj", "layer+0.wInProj",
                                 "layer 0.wInProj", "layer0x.wInProj", "layer1234567890.wInProj",
                                 "Layer0.wInProj", "layer0.wInProj.x"])
def test_layer_keys_parse_strictly(key):
    p = _model()
    q = dict(p)
    q[key] = q["layer0.wInProj"].copy()
    with pytest.raises(ValueError, match="unknown parameter"):
        mamba_ext.model_forward(np.zeros((1, 2), np.int64), q)


def test_non_string_keys_are_unknown():
    q = dict(_model())
    q[0] = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="unknown parameter"):
        mamba_ext.model_forward(np.zeros((1, 2), np.int64), q)
