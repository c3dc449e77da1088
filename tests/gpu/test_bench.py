"""The GPU benchmark (mamba_ext.bench.gpu, ``bench --device gpu``): the block sizes and
the whole-model training-step mode print what they measured; bad options are refused."""
from __future__ import annotations

import math
import re

import pytest

from gpu_support import require_gpu

g = require_gpu()
from mamba_ext.bench import gpu as gb  # noqa: E402
from mamba_ext.bench import sizes  # noqa: E402
from mamba_ext.cli import bench as cli  # noqa: E402


def test_train_step_mode_prints_tokens_per_second(monkeypatch, capsys):
    monkeypatch.setitem(sizes.TRAIN_STEPS, "2x32", (19, 32, 3, 2, 24))
    r = gb.train_step("2x32", steps=2, warmup=1)
    assert r["tokens_s"] == pytest.approx(2 * 24 / r["ms"] * 1e3)
    assert r["tokens_s_pipelined"] == pytest.approx(2 * 24 / r["ms_pipelined"] * 1e3)
    assert r["mem"] > 0 and abs(r["loss"] - math.log(19)) < 0.5
    assert cli.main(["--device", "gpu", "--train-step", "2x32", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"model V 19, 3 layers x d_model 32, B 2 x L 24, fp32 WGSL(?: \([^)]*\))?: "
                     r"step ([\d.]+) ms "
                     r"= ([\d,]+) tokens/s .* GPU memory (\d+) MiB, loss ([\d.]+)", out)
    assert line, out
    assert float(line.group(1)) > 0 and int(line.group(2).replace(",", "")) > 0
    pipe = re.search(r"pipelined \(the next step submitted before this one's loss is read back, "
                     r"as train runs\): ([\d.]+) ms = ([\d,]+) tokens/s", out)
    assert pipe and float(pipe.group(1)) > 0, out
    ck = gb.train_step("2x32", steps=2, warmup=1, checkpointing=True)
    assert ck["loss"] == r["loss"] and ck["mem"] < r["mem"]     # same step, less memory
    eu = gb.train_step("2x32", steps=2, warmup=1, discretization="euler")
    assert eu["loss"] != r["loss"] and abs(eu["loss"] - r["loss"]) < 0.05   # other b_bar, close
    assert cli.main(["--device", "gpu", "--train-step", "2x32", "--repeat", "2",
                     "--discretization", "euler"]) == 0
    assert re.search(r"fp32 WGSL(?: \([^)]*\))?, Euler: step", capsys.readouterr().out)


def test_sizes_and_modes():
    assert sizes.SIZES["d"] == (768, 1536, 16, 4, 48, 8, 2048)
    assert set(sizes.TRAIN_STEPS) == {"24x768", "4x256", "24x768-L8192"}
    for argv in (["--train-step", "4x256"],                              # CPU
                 ["--device", "gpu", "--checkpointing"],                 # without --train-step
                 ["--device", "gpu", "--train-step", "9x9"],             # unknown model
                 ["--device", "gpu", "--size", "e"],
                 ["--discretization", "euler"],                          # CPU
                 ["--device", "gpu", "--size", "a", "--discretization", "euler"],  # ZOH baselines
                 ["--device", "gpu", "--discretization", "foh"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
