"""The C of the CPU kernels (mamba_ext/cpu/csrc/*.h) compiled and tested as plain C.

* every header compiles on its own as ISO C99 and C11 (-Wall -Wextra -Werror -pedantic),
  with and without -fopenmp;
* the C test programs tests/csrc/test_mx_*.c (math helpers against double libm over a
  dense sweep, the scan chunk kernels against a double reference and finite differences,
  the row kernels, conv1d, threads/workspace) are built with -std=c11 -Wall -Wextra
  -Werror, with and without -fopenmp, and must print OK and exit 0.

The compiler is $CC, else Python's, else ``cc``. Without one (or without OpenMP support
for the -fopenmp variants) the tests skip locally and FAIL under CI=true.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CSRC = REPO / "mamba_ext" / "cpu" / "csrc"
HEADERS = sorted(p.name for p in CSRC.glob("*.h"))
PROGRAMS = sorted(p.stem for p in HERE.glob("test_mx_*.c"))
OPENMP = ["", "-fopenmp"]


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(msg: str):
    if _ci():
        pytest.fail("CI=true: " + msg, pytrace=False)
    pytest.skip(msg)


def compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        _unavailable(f"no C compiler ({cc[0] if cc else 'CC'} not on PATH); "
                     "the C tests of the kernel headers need one (apt-get install gcc)")
    return cc[:1]                      # the driver only: our own flags below


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def cc(tmp_path_factory):
    cc = compiler()
    probe = tmp_path_factory.mktemp("probe") / "omp.c"
    probe.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
    has_omp = run(cc + ["-fopenmp", str(probe), "-o", str(probe.with_suffix(""))]).returncode == 0
    return cc, has_omp


def flags_for(cc, openmp: str) -> list[str]:
    cc_cmd, has_omp = cc
    if openmp and not has_omp:
        _unavailable(f"{cc_cmd[0]} has no OpenMP (omp.h / -fopenmp); install gcc or libomp-dev")
    return cc_cmd + ([openmp] if openmp else [])


def test_every_header_and_program_is_listed():
    assert {"mx_compat.h", "mx_constants.h", "mx_math.h", "mx_scan.h"} <= set(HEADERS)
    assert {"test_mx_math", "test_mx_scan"} <= set(PROGRAMS)


@pytest.mark.parametrize("openmp", OPENMP)
@pytest.mark.parametrize("std", ["c99", "c11"])
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(cc, tmp_path, header, std, openmp):
    src = tmp_path / "tu.c"
    src.write_text(f'#include "{header}"\nint mx_translation_unit_not_empty;\n')
    r = run(flags_for(cc, openmp) + [f"-std={std}", "-pedantic", "-Wall", "-Wextra", "-Werror",
                                     "-O2", "-I", str(CSRC), "-c", str(src), "-o",
                                     str(tmp_path / "tu.o")])
    assert r.returncode == 0, f"{header} (-std={std} {openmp}):\n{r.stderr}"


@pytest.mark.parametrize("openmp", OPENMP)
@pytest.mark.parametrize("program", PROGRAMS)
def test_c_program(cc, tmp_path, program, openmp):
    exe = tmp_path / program
    r = run(flags_for(cc, openmp) + ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2",
                                     "-I", str(CSRC), str(HERE / f"{program}.c"), "-o", str(exe),
                                     "-lm", "-lpthread"])
    assert r.returncode == 0, f"building {program} ({openmp or 'no OpenMP'}):\n{r.stderr}"
    r = run([str(exe)], timeout=300)
    print(r.stdout)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK (0 failures)"), \
        f"{program} ({openmp or 'no OpenMP'}) failed:\n{r.stdout}\n{r.stderr}"
