"""Generation on the GPU (kernels/recurrent.wgsl, mamba_ext.gpu.recurrent.GpuStepper,
generate(device="gpu"), sample --device gpu) against the CPU's compiled step."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import nerr, random_model, require_gpu

require_gpu()
from mamba_ext.gpu.model import check_model  # noqa: E402
from mamba_ext.gpu.recurrent import GpuStepper  # noqa: E402
from mamba_ext.recurrent import generate, init_state, step  # noqa: E402


@pytest.mark.parametrize("disc", ["zoh", "euler"])
@pytest.mark.parametrize("N,K", [(5, 3), (16, 4), (20, 1)])
def test_gpu_step_matches_cpu_step(disc, N, K):
    """Logits of every step and the final state, from a non-zero state, batch 3; a new
    state uploaded after step 3 (each step runs the command buffer encoded during the
    previous one: what is written before it counts)."""
    params = random_model(V=23, Dm=12, n_layers=2, D=24, N=N, K=K, R=2, seed=N + K)
    rng = np.random.default_rng(3)
    state = init_state(params, 3, discretization=disc)
    for i in range(len(state.h)):
        state.h[i][...] = rng.standard_normal(state.h[i].shape)
        state.conv[i][...] = rng.standard_normal(state.conv[i].shape)
    arrays, dims = check_model(params)
    st = GpuStepper(arrays, dims, 3, state.eps, disc == "zoh")
    st.set_state(state.h, state.conv)
    logits = np.empty((3, 23), np.float32)
    for t in range(6):
        if t == 3:
            for i in range(len(state.h)):
                state.h[i][...] = rng.standard_normal(state.h[i].shape)
            st.set_state(state.h, state.conv)
        ids = rng.integers(0, 23, 3)
        want, state = step(ids, params, state)
        st.step(ids, logits)
        assert nerr(logits, want) <= 1e-4, t
    h = [np.zeros_like(a) for a in state.h]
    c = [np.zeros_like(a) for a in state.conv]
    st.get_state(h, c)
    for i in range(len(h)):
        assert nerr(h[i], state.h[i]) <= 1e-4
        if c[i].size:                                       # in_proj outputs of the last steps
            assert nerr(c[i], state.conv[i]) <= 1e-5


def test_generate_on_gpu_equals_cpu():
    """Greedy and sampled generation (ragged prompts, a stop sequence) give the CPU's tokens."""
    params = random_model(V=31, Dm=16, n_layers=2, D=32, N=8, K=4, R=2, seed=7)
    prompts = [np.array([1, 5, 9, 2]), np.array([3, 3])]
    a = generate(params, prompts, 12)
    b = generate(params, prompts, 12, device="gpu")
    assert np.array_equal(a, b)
    kw = dict(temperature=0.8, top_k=10, top_p=0.9, stop=[[a[0, 3]]])
    a = generate(params, prompts, 12, rng=np.random.default_rng(1), **kw)
    b = generate(params, prompts, 12, rng=np.random.default_rng(1), device="gpu", **kw)
    assert np.array_equal(a, b)


def test_generate_on_gpu_refuses():
    params = random_model(V=11, Dm=8, n_layers=1, D=16, N=4, K=3, R=1, seed=1)
    with pytest.raises(ValueError, match="device"):
        generate(params, [[1, 2]], 3, device="tpu")
    with pytest.raises(ValueError, match="float32"):
        generate(params, [[1, 2]], 3, device="gpu", weights_dtype="float16")


def test_sample_command_on_gpu(tmp_path, capsys):
    """python -m mamba_ext sample --device gpu: the same greedy text as on the CPU."""
    from mamba_ext.__main__ import main
    from mamba_ext.training.loop import TrainConfig, train
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n" * 50)
    cfg = TrainConfig(data=str(corpus), d_model=16, n_layers=1, d_state=4, seq_len=16, batch=4,
                      steps=3, threads=1, checkpoint_every=0)
    train(cfg, tmp_path / "run", progress=None, log=lambda s: None)
    outs = []
    for dev in ("cpu", "gpu"):
        assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ",
                     "--tokens", "12", "--temperature", "0", "--device", dev]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("def ")
