"""API corners of issue 27, point 8: clear TypeError/ValueError instead of AttributeError or
OverflowError, all-or-nothing in place updates, paths that survive a change of folder."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mamba_ext import init_model_params
from mamba_ext.recurrent import generate
from mamba_ext.training.distributed import ShardedBatches


def test_generate_rng_must_be_a_generator():
    p = init_model_params(11, 8, 1, d_state=2, seed=0)
    with pytest.raises(TypeError, match="rng: expected None or a numpy.random.Generator"):
        generate(p, [[1, 2]], 3, temperature=1.0, rng=3)
    out = generate(p, [[1, 2]], 3, temperature=1.0, rng=np.random.default_rng(0))
    assert out.shape == (1, 3)


def test_sharded_batches_far_steps_are_a_value_error():
    data = np.frombuffer(b"abcdefghij" * 50, np.uint8)
    s = ShardedBatches(data, 8, 4, seed=1)
    with pytest.raises(ValueError, match="beyond the stream"):
        s.get(2 ** 62)
    with pytest.raises(TypeError, match="step: expected an integer"):
        s.get(1.5)
    tok, tgt = s.get(10 ** 6)          # far, but representable: served
    assert tok.shape == (4, 8)


def test_allreduce_grads_refuses_bad_comm_and_read_only_arrays_before_writing():
    from conftest import optional
    optional("mpi4py.MPI", 'pip install "mamba_ext[mpi]"')
    from mamba_ext.training.distributed import allreduce_grads
    g = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    with pytest.raises(TypeError, match="comm: expected None or an mpi4py communicator"):
        allreduce_grads(g, comm="x")
    ro = np.full(2, 5.0, np.float32)
    ro.flags.writeable = False
    g = {"a": np.full(3, 2.0, np.float32), "b": ro}
    with pytest.raises(ValueError, match=r"grads\['b'\] is read-only"):
        allreduce_grads(g)
    np.testing.assert_array_equal(g["a"], 2.0)       # nothing was written


def test_train_stores_the_data_path_absolute(tmp_path, monkeypatch):
    from mamba_ext.__main__ import main
    from mamba_ext.training.loop import load_training_checkpoint
    (tmp_path / "corpus.txt").write_bytes(b"def f(x):\n    return x\n" * 200)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", "corpus.txt", "--d-model", "8", "--n-layers", "1",
                 "--d-state", "2", "--seq-len", "8", "--batch", "2", "--steps", "2",
                 "--out", "run", "--quiet"]) == 0
    ck = load_training_checkpoint(str(tmp_path / "run" / "checkpoint.safetensors"))
    assert ck["config"].data == os.path.join(str(tmp_path), "corpus.txt")
    monkeypatch.chdir(tmp_path.parent)                  # resume from another folder
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "3", "--quiet"]) == 0
