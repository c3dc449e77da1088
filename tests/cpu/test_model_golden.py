"""The whole model against the golden model_* files of tests/data/golden.

Rule (docs/semantics.md): logits and every g_* within
2e-5 * max|ref| + 1e-4 * |ref|; loss relative error <= 1e-6.
"""
import numpy as np
import pytest

import mamba_ext
from conftest import MODEL_GOLDEN, assert_golden_close, load_golden
from mamba_ext.testing import reference


def _case(name):
    d = load_golden(name)
    V, Dm, N, K, D, R, n_layers, B, L = (int(v) for v in d["dims"])
    params = {k[2:]: v for k, v in d.items() if k.startswith("w_")}
    assert sorted(params) == sorted(mamba_ext.MODEL_PARAM_NAMES(n_layers))
    assert params["embedding"].shape == (V, Dm) and d["tokens"].shape == (B, L)
    assert params["layer0.A_log"].shape == (D, N) and params["layer0.wConv"].shape == (D, K)
    return d, params


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_model_matches_golden(case, checkpointing):
    d, params = _case(case)
    logits = mamba_ext.model_forward(d["tokens"], params)
    assert logits.dtype == np.float32
    assert_golden_close("logits", logits, d["logits"], case)
    loss, grads = mamba_ext.model_loss_and_grads(d["tokens"], d["targets"], params,
                                                 checkpointing=checkpointing)
    assert type(loss) is float
    assert_golden_close("loss", loss, d["loss"], case)
    assert list(grads) == list(mamba_ext.MODEL_PARAM_NAMES(len(params) // 13))
    failures = []
    for name in params:
        assert grads[name].dtype == np.float32 and grads[name].shape == params[name].shape
        try:
            assert_golden_close("g_" + name, grads[name], d["g_" + name], case)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_model_float64_matches_reference_and_golden(case):
    """float64 run of the golden weights: the independent float64 reference to
    ~1e-12, and the float32 golden files within their tolerance."""
    d, params = _case(case)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    logits = mamba_ext.model_forward(d["tokens"], p64)
    loss, grads = mamba_ext.model_loss_and_grads(d["tokens"], d["targets"], p64)
    ref_logits, ref_loss = reference.model_forward(d["tokens"], d["targets"], p64)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-11, atol=1e-12 * np.abs(ref_logits).max())
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert_golden_close("loss", loss, d["loss"], case)
    for name in params:
        assert_golden_close("g_" + name, grads[name], d["g_" + name], case)
