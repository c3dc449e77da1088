"""Bitwise reproducibility of the multi-threaded kernels.

The scan backward sums the per-job shares of dBs/dCs, dA_log and D_vec in a fixed order
(no critical sections), so repeated calls give bitwise equal gradients, and the scan's
results do not depend on its thread count either.
"""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext import init_model_params, mamba1_backward, mamba1_forward, model_loss_and_grads
from mamba_ext.block import init_mamba1_params


def _block_case(dtype):
    # D = 160: two full channel groups of 64 and a partial one; B = 3 sequences, so jobs
    # of one sequence and of one channel group land on different threads
    p = init_mamba1_params(80, d_state=8, seed=2, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (3, 130, 80)).astype(dtype)
    dout = rng.normal(0, 1, x.shape).astype(dtype)
    return p, x, dout


def _run_block(p, x, dout, n_threads, **kw):
    out, cache, state = mamba1_forward(x, p, n_threads=n_threads, return_state=True, **kw)
    dx, g = mamba1_backward(dout, p, cache, n_threads=n_threads)
    return out, state, dx, g


def _assert_same(a, b):
    out_a, st_a, dx_a, g_a = a
    out_b, st_b, dx_b, g_b = b
    np.testing.assert_array_equal(out_a, out_b)
    np.testing.assert_array_equal(st_a[0], st_b[0])
    np.testing.assert_array_equal(dx_a, dx_b)
    diff = [k for k in g_a if not np.array_equal(g_a[k], g_b[k])]
    assert not diff, f"gradients differ between identical calls: {diff}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("disc", ["zoh", "euler"])
def test_block_repeat_calls_bitwise_equal(dtype, disc):
    p, x, dout = _block_case(dtype)
    h0 = np.random.default_rng(1).normal(0, 1, (3, 160, 8)).astype(dtype)
    ref = _run_block(p, x, dout, 2, discretization=disc, h0=h0)
    for _ in range(4):
        _assert_same(_run_block(p, x, dout, 2, discretization=disc, h0=h0), ref)


def test_block_results_independent_of_thread_count():
    p, x, dout = _block_case(np.float32)
    ref = _run_block(p, x, dout, 1)
    for nt in (2, 3, 5):
        _assert_same(_run_block(p, x, dout, nt), ref)


def _model_case():
    p = init_model_params(64, 48, 2, seed=0)     # D = 96: one full and one partial group
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 64, (4, 150))
    tgt = rng.integers(0, 64, (4, 150))
    return p, tok, tgt


def test_model_repeat_calls_bitwise_equal():
    p, tok, tgt = _model_case()
    l0, g0 = model_loss_and_grads(tok, tgt, p, n_threads=2)
    for _ in range(3):
        l1, g1 = model_loss_and_grads(tok, tgt, p, n_threads=2)
        assert l1 == l0
        diff = [k for k in g0 if not np.array_equal(g0[k], g1[k])]
        assert not diff, f"gradients differ between identical calls: {diff}"


def test_model_checkpointing_bitwise_equal():
    p, tok, tgt = _model_case()
    l0, g0 = model_loss_and_grads(tok, tgt, p, checkpointing=False)
    l1, g1 = model_loss_and_grads(tok, tgt, p, checkpointing=True)
    assert l1 == l0
    diff = [k for k in g0 if not np.array_equal(g0[k], g1[k])]
    assert not diff, f"checkpointing changes gradients: {diff}"


def test_model_reused_workspace_stale_contents_and_threads():
    """The model keeps each calling thread's workspace from one call to the next: a call
    after a larger one (stale, non-zero contents; a forward with NaN weights leaves NaN
    everywhere in it) gives the same bits as before, and two threads calling at once
    (each with its own workspace) give the same bits as one thread alone."""
    import threading
    from mamba_ext import model_forward
    p, tok, tgt = _model_case()
    l0, g0 = model_loss_and_grads(tok, tgt, p, n_threads=1)
    big = init_model_params(64, 96, 3, seed=1)
    big = {k: np.full_like(v, np.nan) for k, v in big.items()}
    rng = np.random.default_rng(1)
    bt = rng.integers(0, 64, (5, 170))
    model_loss_and_grads(bt, bt, big, n_threads=1)              # poisons the workspace
    assert np.isnan(model_forward(bt, big, n_threads=1)).all()
    for ckpt in (False, True):
        l1, g1 = model_loss_and_grads(tok, tgt, p, n_threads=1, checkpointing=ckpt)
        assert l1 == l0
        assert not [k for k in g0 if not np.array_equal(g0[k], g1[k])]
    results = [None, None]

    def run(i):
        results[i] = model_loss_and_grads(tok, tgt, p, n_threads=1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for l2, g2 in results:
        assert l2 == l0
        assert not [k for k in g0 if not np.array_equal(g0[k], g2[k])]


# Shapes whose products straddle OpenBLAS's small-matrix bound (10^6 multiply-adds, below
# which its AVX-512 kernel sets sum in another order) once split over 2-8 threads: x_proj's
# and dt_proj's products, and in_proj's backward, whose dx rows are balanced against dW's
# columns (linear.pyx, blas_unit).
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d_model, B, L", [(64, 2, 256), (48, 5, 200), (96, 1, 600)])
def test_block_bitwise_on_1_to_8_threads(dtype, d_model, B, L):
    p = init_mamba1_params(d_model, seed=1, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, d_model)).astype(dtype)
    dout = rng.standard_normal(x.shape).astype(dtype)
    ref = _run_block(p, x, dout, 1)
    for nt in range(2, 9):
        _assert_same(_run_block(p, x, dout, nt), ref)
