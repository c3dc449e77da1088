"""mamba_ext.bench.init_compare (docs/training_quality.md): an arm runs and writes its JSON
(seed recorded); the tables of one seed and of several seeds."""
from __future__ import annotations

import json

import pytest

from mamba_ext.bench import init_compare as ic


def _res(config, arm, seed, final, val):
    return dict(config=config, arm=arm, seed=seed, steps=10, final_loss=final, val_loss=val)


def test_run_writes_one_arm(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "r" / "a.json"
    assert ic.main(["run", "--arm", "mamba", "--config", "default", "--steps", "3", "--threads",
                    "1", "--data", str(corpus), "--seed", "5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["arm"] == "mamba" and r["seed"] == 5 and r["steps"] == 3 and len(r["losses"]) == 3
    assert 0 < r["final_loss"] < 6 and 0 < r["val_loss"] < 6


def test_tables():
    one = ic.table([_res("default", "mamba", 0, 1.31, 1.70), _res("default", "mambapy", 0, 1.30,
                                                                  1.71)])
    assert "| default | 10 | not run | 1.3100 / 1.7000 | 1.3000 / 1.7100 |" in one
    many = ic.table([_res("default", "mamba", 0, 1.3, 1.70), _res("default", "mambapy", 0, 1.3, 1.72),
                     _res("default", "mamba", 1, 1.3, 1.74), _res("default", "mambapy", 1, 1.3, 1.71)])
    lines = many.splitlines()
    assert "| default | 0 | 10 | 1.3000 / 1.7000 | 1.3000 / 1.7200 | -0.0200 |" in lines
    assert "| default | 1 | 10 | 1.3000 / 1.7400 | 1.3000 / 1.7100 | +0.0300 |" in lines
    assert "| default | mean of 2 | | 1.3000 / 1.7200 | 1.3000 / 1.7150 | +0.0050 |" in lines


def test_bad_arm_refused():
    with pytest.raises(SystemExit):
        ic.main(["run", "--arm", "nope", "--out", "x.json"])
