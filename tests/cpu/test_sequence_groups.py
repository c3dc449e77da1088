"""Sequence groups of the training step (mamba_ext/cpu/model.pyx, "Sequence groups"): a
batch of enough whole sequences runs as groups, each group's forward and backward on one
thread, their gradients summed in group order. The groups must not change what the step
computes beyond the order of the sums over rows, and must keep the results bitwise the
same for any thread count. The tests set the rows of a group (default 256) through the
testing hook."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from mamba_ext import init_model_params, model_loss_and_grads
from mamba_ext.cpu import model as _model
from mamba_ext.model import _sizes, check_model_params


@contextlib.contextmanager
def group_rows(n):
    old = _model._set_group_rows(n)
    try:
        yield
    finally:
        _model._set_group_rows(old)


ONE_PASS = 1 << 40        # more rows than any batch: one pass over the whole batch


def _case(dtype, B=5, L=128, seed=3):
    p = init_model_params(32, 16, 2, d_state=4, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    for k in p:                          # O(1) weights: every gradient well above rounding
        if k.endswith(("wInProj", "wXProj", "wDtProj", "wOutProj")) or k == "embedding":
            p[k] = (0.4 * rng.standard_normal(p[k].shape) / np.sqrt(p[k].shape[-1])).astype(dtype)
    tok = rng.integers(0, 32, (B, L + 1))
    return p, tok[:, :-1].copy(), tok[:, 1:].copy()


def _groups(p, B, L):
    return _model.sequence_groups(_sizes(check_model_params(p)[1], B, L))


def test_groups_follow_the_rows_and_the_slot_budget():
    # this model's slot holds 2,873 gradient values (the head's and one layer's)
    p, _, _ = _case(np.float32)
    with group_rows(200):
        assert _groups(p, 5, 128) == (3, 2)     # 640 // 200 = 3 groups: 2, 2 and 1 sequence
        assert _groups(p, 1, 4096) == (1, 1)    # one sequence: never split
    with group_rows(128):
        assert _groups(p, 5, 128) == (5, 1)
        assert _groups(p, 5, 64) == (2, 3)
    with group_rows(16):
        # the rows allow 2 groups, but a quarter of the workspace holds one slot
        assert _groups(p, 4, 8) == (1, 4)
    with group_rows(ONE_PASS):
        assert _groups(p, 5, 128) == (1, 5)
    # the defaults (256 rows): the benchmark's steps run as 8 groups; a d_model above 256
    # runs as one pass
    assert _groups(init_model_params(256, 64, 2, seed=0), 16, 128) == (8, 2)
    assert _groups(init_model_params(256, 256, 4, seed=0), 8, 512) == (8, 1)
    assert _groups(init_model_params(256, 512, 2, seed=0), 4, 1024) == (1, 4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_groups_equal_one_pass_to_rounding_float64(checkpointing):
    p, x, y = _case(np.float64)
    with group_rows(200):
        assert _groups(p, 5, 128) == (3, 2)
        loss_g, g_g = model_loss_and_grads(x, y, p, checkpointing=checkpointing)
    with group_rows(ONE_PASS):
        loss_1, g_1 = model_loss_and_grads(x, y, p, checkpointing=checkpointing)
    assert loss_g == loss_1                     # each row's loss is computed as before
    for k in g_1:
        scale = np.abs(g_1[k]).max()
        assert scale > 0, k
        np.testing.assert_allclose(g_g[k], g_1[k], rtol=0, atol=1e-12 * scale, err_msg=k)


def test_groups_bitwise_for_any_thread_count_and_checkpointing():
    p, x, y = _case(np.float32)
    with group_rows(200):
        runs = [model_loss_and_grads(x, y, p, n_threads=t) for t in (1, 2, 3, 4)]
        runs.append(model_loss_and_grads(x, y, p, n_threads=2, checkpointing=True))
    loss0, g0 = runs[0]
    for loss, g in runs[1:]:
        assert loss == loss0
        diff = [k for k in g0 if not np.array_equal(g[k], g0[k])]
        assert not diff, f"gradients differ with the thread count or checkpointing: {diff}"


def test_groups_accumulate_into_the_given_gradients():
    """The compiled call's contract: gradients ACCUMULATE into the buffers; with groups,
    their sum is added to what the buffers held (twice the same batch: twice the
    gradients, to rounding)."""
    from mamba_ext.model import _layer_lists
    p, x, y = _case(np.float64)
    arrays, dims = check_model_params(p)
    g = {k: np.zeros_like(a) for k, a in arrays.items()}
    with group_rows(200):
        for _ in range(2):
            _model.loss_and_grads(x, y, arrays["embedding"], arrays["final_norm"],
                                  arrays["lm_head_bias"], _layer_lists(arrays, dims.n_layers),
                                  g["embedding"], g["final_norm"], g["lm_head_bias"],
                                  _layer_lists(g, dims.n_layers), _sizes(dims, *x.shape),
                                  1e-6, 0, 1.0, False, 2)
        _, once = model_loss_and_grads(x, y, p)
    for k in once:
        np.testing.assert_allclose(g[k], 2 * once[k], rtol=1e-12, atol=1e-300, err_msg=k)
