"""Byte-level training data: vocabulary = the 256 byte values.

The default corpus needs nothing outside Python: the standard library's own
``.py`` sources (``sysconfig.get_paths()["stdlib"]``), read in sorted path order
(deterministic; ``site-packages``, test folders and caches skipped) and capped
at ``max_bytes``. ``--data PATH`` uses any file's bytes instead.

Batches are a pure function of ``(seed, step)``: batch ``k`` draws its random
windows from ``numpy.random.default_rng([seed, k])``, so a resumed run sees
exactly the batches an uninterrupted run would, with no RNG state to save.
"""
from __future__ import annotations

import os
import sysconfig

import numpy as np

from ..io.files import read_regular

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The standard library's .py sources, concatenated in sorted path order, capped."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    b = f.read(max_bytes - total)
            except OSError:
                continue
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                return b"".join(chunks)
    if total == 0:
        raise RuntimeError(f"no .py files found under the standard library folder {root!r}; "
                           f"pass --data PATH with a text file")
    return b"".join(chunks)


def load_corpus(path=None, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The corpus as a uint8 array: the file at ``path`` (whole, up to
    ``max_bytes``), or the standard-library corpus when ``path`` is None."""
    if path is None:
        raw = stdlib_corpus(max_bytes)
    else:
        raw = read_regular(path, "the corpus (--data)", max_bytes=max_bytes)
    return np.frombuffer(raw, dtype=np.uint8)


class ByteBatches:
    """Random (tokens, targets) windows of a byte corpus (or of any integer token ids:
    ``train --init-from`` gives the ids of a Hugging Face tokenizer).

    The last ``val_fraction`` of the corpus is held out for :meth:`val_batches`
    (when the corpus is long enough to hold out at least one batch window).
    """

    def __init__(self, data: np.ndarray, seq_len: int, batch: int, seed: int = 0,
                 val_fraction: float = 0.02):
        arr = np.asarray(data)        # token ids (any integer dtype) or bytes
        data = (arr if arr.dtype.kind in "ui" else np.asarray(data, dtype=np.uint8)).reshape(-1)
        self.seq_len, self.batch, self.seed = int(seq_len), int(batch), int(seed)
        if self.seq_len < 1 or self.batch < 1:
            raise ValueError(f"seq_len and batch must be >= 1, got {seq_len}, {batch}")
        need = self.seq_len + 1
        if data.size < need:
            raise ValueError(f"data: the corpus has {data.size} bytes; seq_len {self.seq_len} "
                             f"needs at least {need}")
        n_val = int(data.size * val_fraction)
        if n_val < need or data.size - n_val < need:
            n_val = 0
        self.train = data[:data.size - n_val]
        self.val = data[data.size - n_val:]

    def _windows(self, data: np.ndarray, starts: np.ndarray):
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        w = data[idx].astype(np.int64)          # (B, L+1)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    def get(self, step: int):
        """``(tokens, targets)`` int64 (batch, seq_len) of training step ``step``."""
        rng = np.random.default_rng([self.seed, int(step)])
        starts = rng.integers(0, self.train.size - self.seq_len, size=self.batch)
        return self._windows(self.train, starts)

    def val_batches(self, n_batches: int = 4):
        """Up to ``n_batches`` fixed, evenly spaced held-out batches (none if no held-out data)."""
        if self.val.size < self.seq_len + 1:
            return []
        hi = self.val.size - self.seq_len - 1
        starts = np.linspace(0, hi, n_batches * self.batch).astype(np.int64)
        return [self._windows(self.val, s) for s in starts.reshape(n_batches, self.batch)]


class ContiguousBatches(ByteBatches):
    """Contiguous windows for training with the state carried across steps
    (``train --carry-state``, truncated backpropagation through time).

    The training part of the corpus is cut into ``batch`` streams of equal length; step
    ``k`` reads window ``k mod n_windows`` of every stream (``seq_len`` tokens and their
    next-token targets), so row ``b`` of step ``k`` continues row ``b`` of step ``k-1``, and
    the scan and conv state the model reached at the end of one step is the right state to
    start the next from. When the streams are used up the next pass starts again at their
    beginnings: :meth:`starts_pass` is then true and the carried state is reset to zeros.
    The held-out batches are those of :class:`ByteBatches`.
    """

    def __init__(self, data: np.ndarray, seq_len: int, batch: int, seed: int = 0,
                 val_fraction: float = 0.02):
        super().__init__(data, seq_len, batch, seed, val_fraction)
        self.stream_len = self.train.size // self.batch
        self.n_windows = (self.stream_len - 1) // self.seq_len
        if self.n_windows < 1:
            raise ValueError(f"data: {self.train.size} training tokens make {self.batch} streams of "
                             f"{self.stream_len}; seq_len {self.seq_len} needs streams of at least "
                             f"{self.seq_len + 1} (lower --batch or --seq-len)")

    def get(self, step: int):
        """``(tokens, targets)`` int64 (batch, seq_len): window ``step mod n_windows`` of
        every stream."""
        k = int(step) % self.n_windows
        starts = np.arange(self.batch, dtype=np.int64) * self.stream_len + k * self.seq_len
        return self._windows(self.train, starts)

    def starts_pass(self, step: int) -> bool:
        """Whether step ``step`` reads the first window of the streams (state reset)."""
        return int(step) % self.n_windows == 0
