"""Test an INSTALLED mamba_ext wheel with the test suite of a source tree.

Usage: python wheels/test_installed.py <source tree>    (cibuildwheel's test-command)

Runs from an empty temporary folder (so ``import mamba_ext`` finds the installed wheel,
never the source tree): ``python -m mamba_ext gradcheck``, then pytest on
<source tree>/tests. Optional test dependencies that a release runner lacks (torch, a
Vulkan/Metal driver for the GPU tests, a C compiler for the C-API and C-header tests) skip
with their reason: CI is unset for the run. The wheel-building test of tests/packaging is
deselected (it would build another wheel from the sources); the check that the installed
distribution lists its data files runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not os.path.isdir(os.path.join(argv[1], "tests")):
        print(__doc__, file=sys.stderr)
        return 2
    tests = os.path.join(os.path.abspath(argv[1]), "tests")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONPATH")}
    with tempfile.TemporaryDirectory() as empty:
        run = dict(env=env, cwd=empty)
        where = subprocess.run([sys.executable, "-c", "import mamba_ext; print(mamba_ext.__file__)"],
                               capture_output=True, text=True, check=True, **run).stdout.strip()
        print("testing the installed", where, flush=True)
        if os.path.abspath(where).startswith(os.path.abspath(argv[1]) + os.sep):
            print("mamba_ext is imported from the source tree, not from the wheel", file=sys.stderr)
            return 1
        rc = subprocess.call([sys.executable, "-m", "mamba_ext", "gradcheck"], **run)
        if rc:
            return rc
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                tests, "-k", "not test_wheel_ships_kernels_pxd_header_stubs_and_modules"],
                               **run)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
