"""The GPU model (mamba_ext.gpu.model_forward / model_loss_and_grads; embedding and
cross-entropy kernels) against the golden files, the float64 reference and the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import MODEL_GOLDEN, assert_golden_close, load_golden
from gpu_support import nerr, random_model, require_gpu
from mamba_ext.testing import reference

require_gpu()
import mamba_ext  # noqa: E402
from mamba_ext import gpu as G  # noqa: E402
from mamba_ext.gpu import scan as gpu_scan  # noqa: E402


@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_model_golden(case, monkeypatch):
    monkeypatch.setattr(gpu_scan, "SCAN_CHUNK", 2)
    z = load_golden(case)
    params = {k[2:]: v for k, v in z.items() if k.startswith("w_")}
    loss, grads = G.model_loss_and_grads(z["tokens"], z["targets"], params)
    assert_golden_close("loss", loss, z["loss"], case)
    assert set(grads) == set(params)
    for k, v in grads.items():
        assert_golden_close("g_" + k, v, z["g_" + k], case)
    if "logits" in z:
        assert_golden_close("logits", G.model_forward(z["tokens"], params), z["logits"], case)


@pytest.mark.parametrize("disc,eps", [("zoh", 1e-6), ("euler", 1e-5)])
def test_model_forward_vs_cpu_and_reference(disc, eps):
    params = random_model(V=29, Dm=10, n_layers=2, D=20, N=5, K=3, R=2, seed=13)
    rng = np.random.default_rng(8)
    tok, tgt = rng.integers(0, 29, (3, 17)), rng.integers(0, 29, (3, 17))
    logits = G.model_forward(tok, params, eps=eps, discretization=disc)
    assert logits.shape == (3, 17, 29) and logits.dtype == np.float32
    ref_logits, ref_loss = reference.model_forward(tok, tgt, params, eps=eps, discretization=disc)
    assert nerr(logits, ref_logits) <= 1e-4
    assert nerr(logits, mamba_ext.model_forward(tok, params, eps=eps, discretization=disc)) <= 1e-4
    # the loss of the same forward: cross_entropy_forward_backward's per-row losses
    loss, _ = G.model_loss_and_grads(tok, tgt, params, eps=eps, discretization=disc)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert abs(loss - reference.cross_entropy_forward(ref_logits, tgt)) <= 1e-5 * abs(ref_loss)


def test_model_forward_no_layers_and_empty():
    params = random_model(V=7, Dm=4, n_layers=0, D=8, N=2, K=2, R=1, seed=1)
    tok = np.array([[0, 6, 3]])
    assert nerr(G.model_forward(tok, params), mamba_ext.model_forward(tok, params)) <= 1e-5
    assert G.model_forward(np.zeros((0, 3), np.int64), params).shape == (0, 3, 7)


@pytest.mark.parametrize("wide", [False, True], ids=["default", "wg32-small-blocks"])
@pytest.mark.parametrize("disc", ["zoh", "euler"])
def test_model_vs_cpu(disc, wide, monkeypatch):
    monkeypatch.setattr(gpu_scan, "SCAN_CHUNK", 6)
    if wide:    # the scan's other workgroup layout (tests/gpu/test_scan.py)
        for name, v in (("SCAN_WG", 32), ("SCAN_TS_FORWARD", 4), ("SCAN_TS_BACKWARD", 4),
                        ("SCAN_RB", 2)):
            monkeypatch.setattr(gpu_scan, name, v)
    params = random_model(V=37, Dm=10, n_layers=2, D=20, N=5, K=3, R=2, seed=11)
    rng = np.random.default_rng(3)
    tok = rng.integers(0, 37, (2, 23))
    tgt = rng.integers(0, 37, (2, 23))
    tok[0, :5] = 4       # repeated ids: several rows into one embedding gradient row
    loss, grads = G.model_loss_and_grads(tok, tgt, params, discretization=disc)
    c_loss, c_grads = mamba_ext.model_loss_and_grads(tok, tgt, params, discretization=disc)
    assert abs(loss - c_loss) <= 1e-6 * abs(c_loss)
    for k in params:
        assert nerr(grads[k], c_grads[k]) <= 1e-4, k


def test_model_deterministic():
    params = random_model(V=19, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=4)
    tok = np.random.default_rng(1).integers(0, 19, (2, 30))
    a = G.model_loss_and_grads(tok, tok, params)
    b = G.model_loss_and_grads(tok, tok, params)
    assert a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in params)


def test_model_bad_inputs():
    m = random_model(V=5, Dm=6, n_layers=1, D=12, N=3, K=3, R=1, seed=0)
    with pytest.raises(ValueError, match="token id 5"):
        G.model_loss_and_grads(np.array([[0, 5]]), np.array([[0, 1]]), m)
    with pytest.raises(ValueError, match="token id -1"):
        G.model_forward(np.array([[0, -1]]), m)
    with pytest.raises(ValueError, match="discretization"):
        G.model_forward(np.array([[0, 1]]), m, discretization="exact")
    with pytest.raises(ValueError, match="eps"):
        G.model_forward(np.array([[0, 1]]), m, eps=0.0)
    with pytest.raises(TypeError, match="eps"):
        G.model_loss_and_grads(np.array([[0, 1]]), np.array([[0, 1]]), m, eps="1e-6")
    with pytest.raises(TypeError, match="float32"):
        G.model_forward(np.array([[0, 1]]), {k: v.astype(np.float64) for k, v in m.items()})


def test_model_checkpointing_same_bits_less_memory():
    """Activation checkpointing: one forward cache for all layers, each layer's forward
    run again before its backward. Same kernels in the same order: the loss and every
    gradient are bit-for-bit those without it, and the plan holds less GPU memory."""
    from mamba_ext.gpu.device import gpu
    from mamba_ext.gpu.model import ModelPlan, check_model
    params = random_model(V=23, Dm=12, n_layers=3, D=24, N=6, K=3, R=2, seed=17)
    rng = np.random.default_rng(5)
    tok, tgt = rng.integers(0, 23, (2, 70)), rng.integers(0, 23, (2, 70))
    loss, grads = G.model_loss_and_grads(tok, tgt, params)
    c_loss, c_grads = G.model_loss_and_grads(tok, tgt, params, checkpointing=True)
    assert c_loss == loss
    for k in params:
        assert np.array_equal(c_grads[k], grads[k]), k
    g = gpu()
    arrays, dims = check_model(params)
    held = {}
    for ckpt in (False, True):
        before = g.bytes_allocated
        ModelPlan(arrays, dims, 2, 70, list(arrays), checkpointing=ckpt).train_ops()
        held[ckpt] = g.bytes_allocated - before
    assert held[True] < held[False]
