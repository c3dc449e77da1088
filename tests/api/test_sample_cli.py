"""``python -m mamba_ext sample``: several prompts in one batch, greedy = temperature 0,
top-k 1 = greedy, seeded sampling, --stop, float16 weights, and one-line errors for bad
values (temperature inf/NaN/negative, top-p outside (0, 1], top-k < 0, empty --stop)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mamba_ext.__main__ import main
from mamba_ext.recurrent import generate
from mamba_ext.training.loop import TrainConfig, load_training_checkpoint, train

TEXT = b"The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n" * 30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    (tmp / "corpus.txt").write_bytes(TEXT)
    cfg = TrainConfig(data=str(tmp / "corpus.txt"), d_model=16, n_layers=1, d_state=4, seq_len=16,
                      batch=4, steps=20, lr=1e-2, warmup=2, checkpoint_every=20, threads=1)
    train(cfg, tmp / "run", progress=None, log=lambda s: None)
    return str(tmp / "run")


def _sample(capsys, run, *argv):
    rc = main(["sample", "--checkpoint", run, *argv])
    assert rc == 0
    return capsys.readouterr().out.splitlines()


def _ids(text):
    return np.frombuffer(text.encode(), np.uint8).astype(np.int64)


def test_several_prompts_greedy_equal_generate(run, capsys):
    lines = _sample(capsys, run, "--prompt", "The q", "--prompt", "def", "--tokens", "6", "--greedy")
    ck = load_training_checkpoint(run + "/checkpoint.safetensors")
    want = generate(ck["params"], [_ids("The q"), _ids("def")], 6, eps=ck["config"].eps)
    assert len(lines) == 2
    for line, prompt, row in zip(lines, ["The q", "def"], want):
        assert line.encode("utf-8", "surrogateescape") == \
            (prompt.encode() + bytes(row.astype(np.uint8))).decode("utf-8", "replace").encode()
    assert _sample(capsys, run, "--prompt", "The q", "--prompt", "def", "--tokens", "6",
                   "--temperature", "0") == lines
    assert _sample(capsys, run, "--prompt", "The q", "--prompt", "def", "--tokens", "6",
                   "--temperature", "1.0", "--top-k", "1", "--seed", "3") == lines


def test_seeded_sampling_and_float16_weights(run, capsys):
    a = _sample(capsys, run, "--prompt", "T", "--tokens", "40", "--top-p", "0.9", "--top-k", "20",
                "--seed", "5")
    b = _sample(capsys, run, "--prompt", "T", "--tokens", "40", "--top-p", "0.9", "--top-k", "20",
                "--seed", "5")
    assert a == b
    h = _sample(capsys, run, "--prompt", "T", "--tokens", "5", "--greedy", "--weights-dtype", "float16")
    assert len(h) == 1 and h[0].startswith("T")


def test_stop_string_ends_the_sample_and_is_kept(run, capsys):
    free = _sample(capsys, run, "--prompt", "The q", "--tokens", "30", "--greedy")[0]
    gen = free[len("The q"):]
    stop = gen[2:4]
    assert len(stop) == 2 and stop.isascii()
    out = _sample(capsys, run, "--prompt", "The q", "--tokens", "30", "--greedy", "--stop", stop)[0]
    cut = gen.index(stop) + len(stop)
    assert out == "The q" + gen[:cut]


@pytest.mark.parametrize("argv, text", [
    (["--temperature", "inf"], "--temperature must be a finite"),
    (["--temperature", "nan"], "--temperature must be a finite"),
    (["--temperature", "-1"], "--temperature must be a finite"),
    (["--top-p", "0"], "--top-p: expected a number in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: expected a number in (0, 1]"),
    (["--top-p", "nan"], "--top-p: expected a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--stop", ""], "--stop must not be empty"),
])
def test_bad_values_are_one_line_errors(argv, text):
    r = subprocess.run([sys.executable, "-m", "mamba_ext", "sample", "--checkpoint", "x", *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and text in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
