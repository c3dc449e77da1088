"""Files named by the user are regular files, checked before any byte is read: a FIFO
never blocks, a device (/dev/zero, /dev/urandom) is never read (issue 27, point 6)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


def _run(argv, timeout=60):
    r = subprocess.run([sys.executable, "-m", "mamba_ext", *argv], capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stderr


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "/dev/urandom", "folder"])
def test_checkpoint_loader_refuses_special_files(what, fifo, tmp_path):
    from mamba_ext.io import checkpoint
    path = {"fifo": fifo, "folder": tmp_path}.get(what, what)
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(ValueError, match="must be a regular file"):
        checkpoint.load(path)


def test_a_symlink_to_a_device_is_refused_as_its_target(tmp_path):
    from mamba_ext.io import checkpoint
    link = tmp_path / "model.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="character device"):
        checkpoint.load(link)


def test_corpus_refuses_special_files(fifo):
    from mamba_ext.training.data import load_corpus
    with pytest.raises(ValueError, match="--data.*regular file.*FIFO"):
        load_corpus(str(fifo))
    assert np.array_equal(load_corpus(__file__, 10), np.frombuffer(open(__file__, "rb").read(10),
                                                                    np.uint8))


@pytest.mark.parametrize("argv", [
    ["sample", "--checkpoint", "{fifo}", "--tokens", "2"],
    ["sample", "--checkpoint", "/dev/zero", "--tokens", "2"],
    ["train", "--data", "{fifo}", "--steps", "1", "--out", "{out}"],
    ["train", "--data", "/dev/urandom", "--steps", "1", "--out", "{out}"],
])
def test_cli_gives_one_clear_line_and_never_hangs(argv, fifo, tmp_path):
    argv = [a.format(fifo=fifo, out=tmp_path / "run") for a in argv]
    rc, err = _run(argv)
    assert rc != 0 and "regular file" in err and "Traceback" not in err, err
