"""Analytic block gradients against float64 central finite differences.

The configurations and the checker live in mamba_ext/testing/gradcheck.py (the
``python -m mamba_ext gradcheck`` command runs the same ones): dState 1, dConv 1,
seqLen < dConv, seqLen 1, batch > 1, softplus extremes (|delta| up to 30),
A_log just inside / at / beyond the clamp bounds, tiny inputs where the RMSNorm
eps matters, Euler discretisation, a sequence longer than the scan's chunk.
Loss = sum(out * dout), dout random; error = max|fd - analytic| / max|analytic|
per tensor, required <= 1e-6.
"""
import sys

import numpy as np
import pytest
from conftest import assert_clamped_grad_zero, clamped_mask

import mamba_ext
from mamba_ext.cli import bench, gradcheck
from mamba_ext.testing.gradcheck import CONFIGS, THRESHOLD, check_case, finite_differences, relative_errors

NAMES = mamba_ext.BLOCK_PARAM_NAMES


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gradients_match_finite_differences(config):
    case = CONFIGS[config]()
    errs, _ = check_case(case)
    assert set(errs) == {"x", *NAMES}
    bad = {name: f"{e:.3g}" for name, e in errs.items() if not e <= THRESHOLD}
    assert not bad, f"{config}: relative error above {THRESHOLD:g} for {bad}"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_alog_grad_exactly_zero_at_and_beyond_clamp(dtype):
    case = CONFIGS["alog_clamp"](dtype)
    A = case.params["A_log"]
    _, cache = mamba_ext.mamba1_forward(case.x, case.params)
    _, grads = mamba_ext.mamba1_backward(case.dout, case.params, cache)
    # includes A_log == -10 and == 5 exactly, and -10 - 2^-10, 5 + 2^-10, -25, 12
    assert assert_clamped_grad_zero(grads["A_log"], A) == 10
    assert np.all(grads["A_log"][~clamped_mask(A)] != 0)   # 5 - 2^-10, -10 + 2^-10 are live


def test_checker_detects_a_wrong_gradient():
    """The FD comparison is sharp enough to see a 1e-5 relative slip in one element."""
    case = CONFIGS["basic"]()
    errs, analytic = check_case(case)
    assert max(errs.values()) <= THRESHOLD
    wrong = dict(analytic)
    wrong["wConv"] = analytic["wConv"].copy()
    wrong["wConv"][1, 2] += 1e-5 * np.max(np.abs(analytic["wConv"]))
    fd = finite_differences(  # differences of wConv only, the other tensors fixed
        lambda t: mamba_ext.mamba1_forward(case.x, {**case.params, "wConv": t["wConv"]}, n_threads=1)[0],
        {"wConv": case.params["wConv"]}, case.dout)
    assert relative_errors(wrong, fd)["wConv"] > 5e-6
    assert relative_errors(analytic, fd)["wConv"] <= THRESHOLD


def test_gradcheck_command_passes_and_prints_every_tensor(capsys):
    assert gradcheck.main(["--config", "basic", "--config", "alog_clamp"]) == 0
    text = capsys.readouterr().out
    for name in ("x", *NAMES):
        assert f"\n{name} " in text
    assert "gradcheck PASSED" in text


def test_gradcheck_command_exit_status_on_failure(capsys):
    assert gradcheck.main(["--config", "basic", "--threshold", "1e-300"]) == 1
    assert "gradcheck FAILED" in capsys.readouterr().out


# --- the bench command (runs, prints its table; no timing is asserted) -----------------------

def test_bench_command_runs_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)      # as if torch were not installed
    assert bench.main(["--size", "a", "--repeat", "1", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "torch not installed" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("a "))
    assert row[1:8] == ["64", "128", "16", "4", "4", "2", "256"]
    assert float(row[8]) > 0 and float(row[13]) > 0       # fwd+bwd ms, bound ms
