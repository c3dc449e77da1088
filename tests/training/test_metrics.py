"""The per-step metrics file (metrics.jsonl) of a training run."""
import copy
import json

import numpy as np
import pytest

from mamba_ext.training.loop import TrainConfig, train
from mamba_ext.training.metrics import MetricsFile

TEXT = (b"def add(a, b):\n    return a + b\n\n" * 20 + b"The quick brown fox. " * 40) * 10


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_bytes(TEXT)
    return TrainConfig(data=str(p), d_model=32, n_layers=1, d_state=8, seq_len=32, batch=4,
                       steps=9, lr=1e-2, warmup=3, checkpoint_every=4, threads=1)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("amp", [False, True])
def test_one_line_per_step_then_the_held_out_loss(cfg, tmp_path, amp):
    cfg.amp = amp
    res = train(cfg, tmp_path / "run", progress=None, log=lambda s: None)
    rows = _lines(res["metrics"])
    assert res["metrics"] == str(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 10)) + [9]
    steps, last = rows[:-1], rows[-1]
    assert [r["loss"] for r in steps] == res["losses"]
    assert last == {"step": 9, "held_out": pytest.approx(res["val_loss"])}
    for r in steps:
        assert r["lr"] > 0 and r["tokens_per_s"] > 0 and r["skipped"] >= 0
        if amp:
            assert r["grad_norm"] is None        # CPU mixed precision does not compute it
        else:
            assert r["grad_norm"] > 0
    assert steps[-1]["skipped"] == res["skipped_steps"]


def test_resume_keeps_the_steps_of_the_checkpoint(cfg, tmp_path):
    out = tmp_path / "run"
    part = train(copy.deepcopy(cfg), out, progress=None, log=lambda s: None, stop_after=6)
    assert [r["step"] for r in _lines(part["metrics"])] == [1, 2, 3, 4, 5, 6, 6]
    full = train(copy.deepcopy(cfg), tmp_path / "full", progress=None, log=lambda s: None)
    res = train(copy.deepcopy(cfg), out, resume=part["checkpoint"], progress=None,
                log=lambda s: None)
    rows = _lines(res["metrics"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 9]
    got = [r["loss"] for r in rows if "loss" in r]
    assert got == [r["loss"] for r in _lines(full["metrics"]) if "loss" in r]
    # a run killed after step 6 resumes from its checkpoint of step 4: the lines after
    # step 4 go, atomically, before the first new one
    MetricsFile(res["metrics"], 4).close()
    assert [r["step"] for r in _lines(res["metrics"])] == [1, 2, 3, 4]


def test_non_finite_values_are_null(tmp_path):
    m = MetricsFile(str(tmp_path / "m.jsonl"), 0)
    m.step(0, float("nan"), 1e-3, float("inf"), 1, np.float32(5.0))
    m.finish(1, None)
    assert _lines(tmp_path / "m.jsonl") == [
        {"step": 1, "loss": None, "lr": 1e-3, "grad_norm": None, "skipped": 1,
         "tokens_per_s": 5.0}, {"step": 1, "held_out": None}]
