"""Runs that fail say so (issue 13): every step skipped or a non-finite loss ends in
TrainingFailed / exit status 1 with one clear line; summary.json is always valid JSON with
the real skip counts; stale temporary files of a killed run are removed at the start; a
run killed at any moment (during a checkpoint write too) resumes bit-identically."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mamba_ext.training import loop
from mamba_ext.training.loop import TrainConfig, TrainingFailed, train

TEXT = (b"def f(x):\n    return x + 1\n\n" * 20 + b"The quick brown fox jumps over the lazy dog.\n" * 20) * 4


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_bytes(TEXT)
    return str(p)


def _cfg(corpus, **kw):
    d = dict(data=corpus, d_model=8, n_layers=1, d_state=2, seq_len=8, batch=2, steps=6, warmup=2,
             checkpoint_every=0, threads=1)
    d.update(kw)
    return TrainConfig(**d)


def _strict_json(path):
    def no_constants(c):
        raise AssertionError(f"{path}: {c} is not valid JSON")
    return json.loads(open(path, encoding="utf-8").read(), parse_constant=no_constants)


def test_diverging_run_fails_with_the_real_skip_count(corpus, tmp_path):
    with pytest.raises(TrainingFailed, match="not finite") as e:
        train(_cfg(corpus, lr=1e30, steps=10), tmp_path / "out", progress=None, log=lambda s: None)
    s = _strict_json(tmp_path / "out" / "summary.json")
    assert s["status"] == "failed" and s["final_loss"] is None and s["steps_run"] == 10
    assert 0 < s["skipped_steps"] < 10 and s["skipped_steps"] == e.value.summary["skipped_steps"]
    assert "lower --lr" in s["error"]


def test_run_whose_steps_are_all_skipped_fails(corpus, tmp_path, monkeypatch):
    real = loop.model_loss_and_grads

    def nan_grads(*a, **k):
        loss, grads = real(*a, **k)
        for g in grads.values():
            g[...] = np.nan
        return loss, grads
    monkeypatch.setattr(loop, "model_loss_and_grads", nan_grads)
    with pytest.raises(TrainingFailed, match="every one of the 6 steps was skipped"):
        train(_cfg(corpus), tmp_path / "out", progress=None, log=lambda s: None)
    s = _strict_json(tmp_path / "out" / "summary.json")
    assert s["skipped_steps"] == 6 == s["steps_run"] and s["status"] == "failed"
    assert s["final_loss"] is not None      # the loss itself was finite: only the steps failed


def test_zero_steps_write_valid_json(corpus, tmp_path):
    res = train(_cfg(corpus, steps=0), tmp_path / "out", progress=None, log=lambda s: None)
    s = _strict_json(tmp_path / "out" / "summary.json")
    assert res["steps_run"] == 0 and s["final_loss"] is None and s["status"] == "ok"


def test_cli_failure_is_one_line_and_exit_1(corpus, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mamba_ext", "train", "--data", corpus, "--d-model", "8",
                        "--n-layers", "1", "--d-state", "2", "--seq-len", "8", "--batch", "2",
                        "--steps", "8", "--lr", "1e30", "--threads", "1", "--quiet",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training failed: the loss is not finite")


@pytest.mark.parametrize("argv, rc, text", [
    (["train", "--threads", "100000"], 2, "--threads: n_threads: expected None or an integer in [1, "),
    (["train", "--batch", "0"], 2, "--batch: expected an integer in [1, "),
    (["train", "--lr", "nan"], 2, "--lr: expected a finite number"),
    (["train", "--resume", "/nonexistent/x"], 2, "no checkpoint at"),
    (["sample", "--checkpoint", "/nonexistent/x"], 1, "No such file"),
    (["sample", "--checkpoint", "x", "--temperature", "inf"], 2, "--temperature must be a finite"),
    (["gradcheck", "--threads", "100000"], 2, "--threads must be in [1, "),
    (["gradcheck", "--threads", "1000"], 2, "--threads must be in [1, "),
    (["bench", "--threads", "1000"], 2, "--threads must be in [1, "),
])
def test_cli_argument_errors_are_one_line(argv, rc, text):
    r = subprocess.run([sys.executable, "-m", "mamba_ext", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == rc, r.stderr
    assert "Traceback" not in r.stderr and text in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_stale_temporaries_are_removed_at_start(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = [out / ".checkpoint.safetensors.k1ll3d.tmp", out / ".summary.json.x_y.tmp",
             out / ".loss.png.abc.tmp"]
    for f in stale:
        f.write_bytes(b"half a checkpoint")
    mine = out / "notes.tmp"
    mine.write_bytes(b"not ours")
    logs = []
    train(_cfg(corpus, steps=2), out, progress=None, log=logs.append)
    assert not any(f.exists() for f in stale) and mine.exists()
    assert sum("left by an interrupted write" in s for s in logs) == 3
    assert not [f for f in os.listdir(out) if f.endswith(".tmp") and f != "notes.tmp"]


def test_resume_rejects_a_config_edited_into_nonsense(corpus, tmp_path):
    """The config of a checkpoint is validated as a whole (here: through from_dict)."""
    train(_cfg(corpus, steps=2), tmp_path / "out", progress=None, log=lambda s: None)
    good = loop.load_training_checkpoint(tmp_path / "out" / "checkpoint.safetensors")["config"]
    for field, value in (("lr", "0.004"), ("eps", 1e-16 * 0), ("batch", 2.0), ("amp", 1),
                         ("seed", -1), ("betas", [0.9]), ("threads", 100000)):
        d = copy.deepcopy(good.to_dict())
        d[field] = value
        with pytest.raises((TypeError, ValueError), match=f"config.{field}"):
            TrainConfig.from_dict(d)


# ---- kill -9 at random moments, checkpoint writes included ----------------------------------

_CHILD = r"""
import sys
from mamba_ext.training.loop import TrainConfig, train
cfg = TrainConfig(data=sys.argv[1], d_model=16, n_layers=1, d_state=4, seq_len=16, batch=4,
                  steps=int(sys.argv[3]), warmup=3, checkpoint_every=1, threads=1)
train(cfg, sys.argv[2], resume=sys.argv[4] if len(sys.argv) > 4 else None, progress=None,
      log=lambda s: None)
"""
STEPS = 200


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def test_kill_during_training_and_checkpoint_writes_then_resume_is_exact(corpus, tmp_path):
    """kill -9 a training process (checkpoint written every step, so many kills land
    inside a write) a few times, resuming each time; the checkpoint is always whole and
    the final result equals the uninterrupted run's, bit for bit."""
    full = train(TrainConfig(data=corpus, d_model=16, n_layers=1, d_state=4, seq_len=16, batch=4,
                             steps=STEPS, warmup=3, checkpoint_every=1, threads=1),
                 tmp_path / "full", progress=None, log=lambda s: None)
    out = tmp_path / "killed"
    ckpt = out / "checkpoint.safetensors"
    rng = np.random.default_rng(0)
    kills, steps_seen = 0, []
    for _ in range(4):
        args = [sys.executable, "-c", _CHILD, corpus, str(out), str(STEPS)]
        args += [str(ckpt)] if ckpt.exists() else []
        before = _mtime(ckpt)
        child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while child.poll() is None and _mtime(ckpt) == before and time.monotonic() < deadline:
            time.sleep(0.002)                              # until it has written a checkpoint
        time.sleep(float(rng.uniform(0.0, 0.03)))          # then a moment of its next steps
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        child.wait(timeout=120)
        assert ckpt.exists(), child.stderr.read().decode()
        steps_seen.append(loop.load_training_checkpoint(ckpt)["step"])   # always whole
    resumed = train(TrainConfig(steps=STEPS, threads=1), out, resume=str(ckpt), progress=None,
                    log=lambda s: None)
    assert kills >= 3, steps_seen          # the runs were really cut short
    assert resumed["losses"] == full["losses"]
    for k, v in full["params"].items():
        np.testing.assert_array_equal(resumed["params"][k], v, err_msg=k)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_sample_takes_a_prompt_that_is_not_utf8(corpus, tmp_path):
    train(_cfg(corpus, steps=2), tmp_path / "out", progress=None, log=lambda s: None)
    prompt = b"ab\xff\xfe"                    # not UTF-8: fed to the byte model as these bytes
    r = subprocess.run([os.fsencode(sys.executable), b"-m", b"mamba_ext", b"sample", b"--checkpoint",
                        os.fsencode(tmp_path / "out"), b"--prompt", prompt, b"--tokens", b"4",
                        b"--temperature", b"0"], capture_output=True, timeout=120)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith(b"ab\xef\xbf\xbd")     # printed with replacement characters


def test_a_run_whose_updates_are_all_void_fails(corpus, tmp_path):
    """lr 1e300: every element's update overflows, the optimizer's per-element guard
    leaves every weight unchanged; that is no step at all (issue 27, point 4)."""
    with pytest.raises(TrainingFailed, match="every one of the 5 steps was skipped"):
        train(_cfg(corpus, lr=1e300, steps=5), tmp_path / "out", progress=None,
              log=lambda s: None)
    s = _strict_json(tmp_path / "out" / "summary.json")
    assert s["status"] == "failed" and s["skipped_steps"] == 5


def test_resume_with_fewer_steps_than_done_is_refused_and_harmless(corpus, tmp_path):
    """--resume with --steps below the checkpoint's step must not rewrite the checkpoint
    into one that nothing can load (issue 27, point 3)."""
    out = tmp_path / "out"
    train(_cfg(corpus, steps=3), out, progress=None, log=lambda s: None)
    ck = out / loop.CHECKPOINT_NAME
    before = ck.read_bytes()
    with pytest.raises(ValueError, match="at step 3 already"):
        train(_cfg(corpus, steps=1), out, resume=str(ck), progress=None, log=lambda s: None)
    assert ck.read_bytes() == before
    loop.load_training_checkpoint(str(ck))                       # still loadable
    res = train(_cfg(corpus, steps=4), out, resume=str(ck), progress=None, log=lambda s: None)
    assert res["steps_run"] == 1
