"""Copy the source files of a mamba_ext checkout (tracked + untracked, not
ignored by git) into a fresh folder, so that a wheel is built from sources
only: in-place build products (*.so, generated *.c, build/) never leak in, and
the build never writes into the checkout.

Used by wheels/build.sh and tests/packaging/test_wheel.py.
Usage: python wheels/copy_source.py REPO DEST
"""
import os
import shutil
import subprocess
import sys

_SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache"}


def source_files(repo):
    """Relative paths of the checkout's source files."""
    try:
        out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):      # not a git checkout
        files = []
        for d, dirs, names in os.walk(repo):
            dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.startswith(".venv")]
            rel = os.path.relpath(d, repo)
            for f in names:
                generated = rel == os.path.join("mamba_ext", "cpu") and f.endswith((".c", ".cpp"))
                if not generated and not f.endswith((".so", ".pyd", ".o")):
                    files.append(os.path.normpath(os.path.join(rel, f)))
        return files


def copy_source(repo, dest):
    for f in source_files(repo):
        src = os.path.join(repo, f)
        if os.path.isfile(src):                           # listed but deleted: skip
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, f))


if __name__ == "__main__":
    copy_source(*sys.argv[1:3])
