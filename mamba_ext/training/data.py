"""Byte-level training data: vocabulary = the 256 byte values.

The default corpus needs nothing outside Python: the standard library's own
``.py`` sources (``sysconfig.get_paths()["stdlib"]``), read in sorted path order
(deterministic; ``site-packages``, test folders and caches skipped) and capped
at ``max_bytes``. ``--data PATH`` uses any file's bytes instead.

``train`` reads :class:`ShardedBatches`, one stream for one process and for P ranks
alike: the corpus cut into disjoint windows, each epoch a permutation of them
(``default_rng([seed, epoch])``), step ``k`` the next ``P*b`` windows (rank ``r`` the
``r``-th ``b`` of them). A run and its resumption, with any number of ranks, read the
same windows in the same order; the checkpoint keeps the stream position.
:class:`ByteBatches` draws random windows per step instead (``default_rng([seed, k])``)
and holds the held-out split every source shares; :class:`ContiguousBatches` reads
contiguous windows for ``--carry-state``.
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
    ``train --init-from`` gives the ids of a Hugging Face tokenizer), a pure function of
    ``(seed, step)``.

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


class ShardedBatches:
    """Per-rank batches of one global, deterministic stream of corpus windows: the
    training data of every ``train`` run, one process (rank 0 of 1) or P ranks.

    The training part of the corpus (``ByteBatches``' split: the last 2% is
    held out) is cut into ``W = (size - 1) // L`` disjoint windows of
    ``L + 1`` bytes (window ``i`` starts at byte ``i*L``; its last byte is the
    target of its last position). Epoch ``e`` visits all windows once, in the
    order ``default_rng([seed, e]).permutation(W)``; global sample ``s`` is
    window ``perm_{s // W}[s % W]``. Step ``k`` consumes the ``G = P*b``
    samples ``[S_k, S_k + G)``, where ``S_k`` = ``position(k)``; rank ``r``
    takes ``[S_k + r*b, S_k + (r+1)*b)`` in that order. So the ranks' samples
    are disjoint, their union is what one process with batch ``G`` reads, and
    a run resumed with another P (``start_step``, ``start_position`` from the
    checkpoint) continues the very same stream at its first unread sample.

    ``val_batches()``: the held-out batches of ``ByteBatches`` (batch ``b``).
    """

    def __init__(self, data, seq_len: int, batch: int, seed: int = 0, rank: int = 0,
                 size: int = 1, start_step: int = 0, start_position: int = 0,
                 val_fraction: float = 0.02):
        for name, v, lo in (("size", size, 1), ("rank", rank, 0), ("start_step", start_step, 0),
                            ("start_position", start_position, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"ShardedBatches: {name}: expected an integer >= {lo}, got {v!r}")
        if rank >= size:
            raise ValueError(f"ShardedBatches: rank: expected 0 <= rank < size = {size}, got {rank}")
        self._split = ByteBatches(data, seq_len, batch, seed, val_fraction)
        self.seq_len, self.batch, self.seed = self._split.seq_len, self._split.batch, int(seed)
        self.rank, self.size = int(rank), int(size)
        self.global_batch = self.batch * self.size
        self.train = self._split.train
        self.n_windows = (self.train.size - 1) // self.seq_len
        if self.n_windows < 1:
            raise ValueError(f"data: the training part of the corpus has {self.train.size} bytes; "
                             f"seq_len {self.seq_len} needs at least {self.seq_len + 1}")
        self.start_step, self.start_position = int(start_step), int(start_position)
        self._perms = {}

    def position(self, step: int) -> int:
        """Global samples consumed before step ``step`` (the stream position)."""
        return self.start_position + (int(step) - self.start_step) * self.global_batch

    def rank_positions(self, step: int) -> list:
        """The first sample of each rank's slice at step ``step``."""
        s = self.position(step)
        return [s + r * self.batch for r in range(self.size)]

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            if len(self._perms) > 2:
                self._perms.clear()
            p = self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
                self.n_windows)
        return p

    def window_starts(self, samples) -> np.ndarray:
        """Corpus offsets of the windows of global sample numbers ``samples``."""
        samples = np.asarray(samples, dtype=np.int64)
        epoch, idx = np.divmod(samples, self.n_windows)
        starts = np.empty(samples.shape, np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            starts[sel] = self._perm(int(e))[idx[sel]] * self.seq_len
        return starts

    def samples(self, step: int) -> np.ndarray:
        """Global sample numbers of this rank's slice of step ``step``, (b,)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"ShardedBatches: step: expected an integer, got {type(step).__name__}")
        first = self.position(step) + self.rank * self.batch
        if first < 0:
            raise ValueError(f"ShardedBatches: step {step} lies before the stream start")
        if first + self.batch > np.iinfo(np.int64).max:
            raise ValueError(f"ShardedBatches: step {step} lies beyond the stream's int64 sample "
                             f"numbers")
        return np.arange(first, first + self.batch, dtype=np.int64)

    def get(self, step: int):
        """``(tokens, targets)`` int64 (b, L) of this rank at step ``step``."""
        return self._split._windows(self.train, self.window_starts(self.samples(step)))

    def __iter__(self):
        """This rank's batches from ``start_step`` on, without end (``get`` of
        each step in turn)."""
        step = self.start_step
        while True:
            yield self.get(step)
            step += 1

    def val_batches(self, n_batches: int = 4):
        return self._split.val_batches(n_batches)

    def state(self, step: int) -> dict:
        """The stream position a checkpoint written before step ``step`` stores (its
        ``extra["distributed"]``, also for one process: the ranks' slices of it)."""
        return {"world_size": self.size, "batch_per_rank": self.batch,
                "global_batch": self.global_batch, "data_position": self.position(step),
                "rank_positions": self.rank_positions(step), "data_order": "sharded-stream/1"}


def stream_batches(corpus, seq_len: int, batch: int, seed: int, rank: int = 0, size: int = 1,
                   start_step: int = 0, state: dict | None = None) -> ShardedBatches:
    """Rank ``rank`` of ``size``'s :class:`ShardedBatches` of a run at step ``start_step``:
    from the position of a checkpoint's ``state`` (``ShardedBatches.state``, any world
    size) or, without one, ``start_step * size * batch`` (the stream's start for a new run).
    """
    position = int(state["data_position"]) if state is not None else start_step * size * batch
    return ShardedBatches(corpus, seq_len, batch, seed, rank, size, start_step=start_step,
                          start_position=position)
