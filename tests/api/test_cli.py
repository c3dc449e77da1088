"""The command line: ``python -m mamba_ext`` / ``mamba-ext`` list the commands, every
command's --help shows every default, and the generation benchmark runs."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mamba_ext.__main__ import COMMANDS, main


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n  {name} " in out
    assert main([]) == 2 and main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_python_dash_m_help_exits_0():
    r = subprocess.run([sys.executable, "-m", "mamba_ext", "--help"], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=120)
    assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS), r.stderr


def test_console_script_help_exits_0():
    script = shutil.which("mamba-ext", path=os.path.dirname(sys.executable)) or shutil.which("mamba-ext")
    assert script is not None, "the mamba-ext console script is not installed ([project.scripts])"
    r = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS), r.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help_shows_every_default(command, capsys):
    mod = importlib.import_module(f"mamba_ext.cli.{command}")
    parser = mod.build_parser()
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())       # undo argparse's line wrapping
    options = [a for a in parser._actions
               if a.option_strings and a.default is not argparse.SUPPRESS and a.help is not argparse.SUPPRESS]
    assert options
    for a in options:
        assert a.help, f"{command} {a.option_strings[0]}: no help text"
        assert f"(default: {a.default})" in text, f"{command} {a.option_strings[0]}: default not shown"


def test_generation_benchmark_runs(capsys):
    assert main(["bench", "--generation", "--tokens", "8", "--models", "tiny", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "generation benchmark" in out and "recurrent step()" in out and "faster" in out
    assert "float16 weights" in out and "prefill 512" in out and "cap" in out


def test_block_benchmark_prints_bound_and_thread_scaling(capsys, monkeypatch):
    """bench (CPU): the table, the bound line and, with more than one thread, the thread
    scaling (one thread measured in a child process with the BLAS limited too)."""
    from mamba_ext.bench import cpu
    monkeypatch.setattr(cpu, "_cores", lambda: 2)
    monkeypatch.setattr(cpu, "SETTLE_S", 0.0)      # (its one-thread child gets it too)
    assert main(["bench", "--size", "a", "--repeat", "1", "--no-torch", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "ours/bound" in out and "size a: bound =" in out
    m = re.search(r"size a: thread scaling: 1 thread ([\d.]+) ms, 2 threads ([\d.]+) ms: "
                  r"speed-up ([\d.]+)x, efficiency (\d+)%", out)
    assert m, out
    one, two, speedup = float(m.group(1)), float(m.group(2)), float(m.group(3))
    # the printed times are rounded to 0.1 ms, the speed-up is of the unrounded ones
    assert one > 0 and two > 0
    assert (one - 0.05) / (two + 0.05) - 0.01 <= speedup <= (one + 0.05) / (two - 0.05) + 0.01
    # every GEMM of the block against the best operand layout of its shape
    rows = re.findall(r"^  (\w+ (?:forward|dinput|dweight)) +(TN|NN|NT): +([\d.]+) GFLOP/s; best "
                      r"(NN|NT|TN|TT) +([\d.]+): ([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == [n for n, *_ in cpu.block_gemms("a")] and len(rows) == 12
    for _name, lay, ours, best_lay, best, ratio in rows:
        assert 0 < float(ours) <= float(best) and float(ratio) <= 1.0
        assert lay != best_lay or float(ratio) == 1.0
    assert re.search(r"size a: GEMMs alone \(SciPy sgemm, best of 10\), ours / best operand "
                     r"layout of the shape: worst \w+ \w+ [\d.]+", out)
    assert re.search(r"^BLAS: SciPy's ", out, re.M)        # which BLAS, which kernels


def test_blas_note_names_avx2_kernels_on_an_avx512_cpu():
    """The bench's BLAS line: a hint exactly where OpenBLAS runs its AVX2 kernels on a CPU
    with AVX-512 (its detection does not know the CPU), and what the BLAS says of itself."""
    from mamba_ext.bench import cpu
    cfg = "OpenBLAS 0.3.30 DYNAMIC_ARCH NO_AFFINITY {} MAX_THREADS=64"
    note = cpu.blas_note(cfg.format("Haswell"), {"avx2", "avx512f"})
    assert note and "OPENBLAS_CORETYPE=SKYLAKEX" in note and "Haswell" in note
    assert cpu.blas_note(cfg.format("Zen"), {"avx512f"})
    assert cpu.blas_note(cfg.format("SkylakeX"), {"avx512f"}) is None
    assert cpu.blas_note(cfg.format("Haswell"), {"avx2"}) is None
    assert cpu.blas_note(None, {"avx512f"}) is None
    own = cpu.blas_note(cfg.format("Haswell"), {"avx512f"}, "avx512")
    assert "mamba_ext's AVX-512 sgemm" in own and "Haswell" in own
    import pathlib
    import scipy
    libs = pathlib.Path(scipy.__file__).parent.parent / "scipy.libs"   # a pip wheel's OpenBLAS
    if sys.platform.startswith("linux") and any("openblas" in p.name for p in libs.glob("*")):
        assert cpu.blas_config().startswith("OpenBLAS ")


def test_block_gemms_are_the_linears_calls():
    """The GEMMs the bench times are the ones linear.pyx issues: forward T,N (OC, M, IC),
    dinput N,N (IC, M, OC), dweight N,T (IC, OC, M), for the block's four linears."""
    from mamba_ext.bench import cpu
    Dm, D, N, K, R, B, L = cpu.SIZES["c"]
    g = {name: (ta + tb, m, n, k) for name, ta, tb, m, n, k in cpu.block_gemms("c")}
    assert g["in_proj forward"] == ("TN", 2 * D, B * L, Dm)
    assert g["x_proj dinput"] == ("NN", D, B * L, R + 2 * N)
    assert g["dt_proj dweight"] == ("NT", R, D, B * L)
    assert sum(2 * m * n * k for _, m, n, k in g.values()) == cpu.gemm_flops("c")


def test_model_step_benchmark(capsys, monkeypatch):
    """bench --model-step: a whole training step against its bound; bad names refused."""
    from mamba_ext.bench import cpu
    monkeypatch.setitem(cpu.MODEL_STEPS, "1x16", (31, 16, 1, 2, 24))
    monkeypatch.setattr(cpu, "SETTLE_S", 0.0)
    assert main(["bench", "--model-step", "1x16", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"model 1 x 16, vocab 31, B 2 x L 24: training step \(forward, backward, AdamW\) "
                  r"([\d.]+) ms = [\d,]+ tokens/s; bound ([\d.]+) ms .*step/bound ([\d.]+) "
                  r"\(steps: medians of 1; the ratio: median of 3 rounds of ours then the bound, "
                  r"([\d.]+) ([\d.]+) ([\d.]+)\)", out)
    assert m, out
    step, bound, ratio = (float(m.group(i)) for i in (1, 2, 3))
    rounds = sorted(float(m.group(i)) for i in (4, 5, 6))
    # step/bound is the median of the rounds' own ratios (each a step, then the bound right
    # after it), not the printed step median over the printed bound median
    assert step > 0 and bound > 0 and rounds[0] > 0 and abs(ratio - rounds[1]) <= 0.006
    # the same step as a plain library call and after configure_threads(), each in its own
    # process (the child gets the configuration added above)
    m = re.search(r"model step 1x16 +plain +([\d.]+) ms +configured +([\d.]+) ms +"
                  r"plain/configured ([\d.]+)", out)
    assert m, out
    plain, conf, r = (float(m.group(i)) for i in (1, 2, 3))
    # the printed times are rounded to 0.1 ms, the ratio is of the unrounded ones
    assert plain > 0 and conf > 0
    assert (plain - 0.05) / (conf + 0.05) - 0.01 <= r <= (plain + 0.05) / (conf - 0.05) + 0.01
    for argv in (["bench", "--model-step", "9x9"], ["bench", "--model-step", "1x16", "--device", "gpu"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("sync", [False, True])
def test_processes_benchmark(capsys, sync):
    """python -m mamba_ext.bench.processes: P processes of a plain call started together,
    free-running or in lock step (--sync); one table row per P, efficiency = speed-up / P."""
    from mamba_ext.bench import processes
    argv = ["-P", "1,2", "--model", "1x16", "--batch", "2", "--seq-len", "8", "--threads", "1",
            "--steps", "2", "--warmup", "1"] + (["--sync"] if sync else [])
    assert processes.main(argv) == 0
    out = capsys.readouterr().out
    assert ("in lock step" in out) == sync, out
    rows = re.findall(r"^\| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)x \| (\d+)% \|$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    one = float(rows[0][1].replace(",", ""))
    total = float(rows[1][1].replace(",", ""))
    assert one > 0 and abs(float(rows[1][3]) - total / one) <= 0.01
    assert abs(int(rows[1][4]) - 100 * total / one / 2) <= 1
    with pytest.raises(SystemExit) as e:
        processes.main(["-P", "0"])
    assert e.value.code == 2


def test_cli_modules_are_thin():
    """Each command module only parses arguments and calls the library (no maths, no
    benchmark loops): a loose but honest bound on its size."""
    cli = Path(importlib.import_module("mamba_ext.cli").__file__).parent
    for path in cli.glob("*.py"):
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        assert len(lines) < 120, f"{path.name}: {len(lines)} lines"


def test_bound_ratio_is_taken_round_by_round():
    """bench.cpu.interleaved_ratio: ours, then the bound right after it, per round; the
    median of the rounds' ratios (a drifting machine moves both within a round)."""
    from mamba_ext.bench.cpu import interleaved_ratio
    calls, ours, bound = [], iter([3.0, 6.0, 4.0]), iter([2.0, 4.0, 1.0])
    ratio, runs = interleaved_ratio(lambda: calls.append("ours") or next(ours),
                                    lambda: calls.append("bound") or next(bound), rounds=3)
    assert calls == ["ours", "bound"] * 3
    assert runs == [(3.0, 2.0), (6.0, 4.0), (4.0, 1.0)] and ratio == 1.5
