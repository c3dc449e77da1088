"""Data-parallel training over MPI, the implementation (``mpi4py``; imported through
mamba_ext.distributed): P processes ("ranks"), one model replica each, one global batch
per step.

Install: ``pip install "mamba_ext[mpi]"`` (mpi4py and the ``mpich`` wheel, which
brings ``libmpi`` and ``mpiexec``); a system Open MPI / MPICH or Slurm's
``srun`` works too. Run: ``mpiexec -n P python -m mamba_ext train --distributed``
(docs/distributed.md).

One step on every rank:

1. the rank's slice of the global batch (:class:`ShardedBatches`: one global,
   epoch-permuted stream of disjoint windows of the corpus; rank ``r`` takes
   samples ``[r*b, (r+1)*b)`` of each global batch of ``P*b``);
2. loss and gradients of its slice (the CPU model computes every gradient in
   one compiled call; the GPU trainer in one submit);
3. :class:`GradReducer`: the gradients are copied into a few preallocated,
   contiguous buckets (default 16 MiB each, the last layers first) and each
   bucket is all-reduced in place with a non-blocking ``Iallreduce`` as soon as
   it is filled (bucket ``i`` can travel while bucket ``i+1`` is filled, as far
   as the MPI library progresses in the background: docs/distributed.md). The
   copy also scales by ``1/P``: the sum over ranks of per-rank means / P is
   the global mean (every rank holds ``b*L`` positions). The loss and the AMP
   overflow flag travel in one extra small float64 all-reduce;
4. clipping and AdamW on the reduced gradients: the same inputs and the same
   arithmetic on every rank, so the weights stay bitwise identical; every
   ``check_every`` steps a CRC32 checksum of the weights is all-gathered and a
   mismatch stops the job with :class:`DivergenceError`.

Faults: every collective is non-blocking and waited for with a deadline
(``timeout`` seconds, :meth:`Distributed.wait`: ``Waitall`` under a watchdog
thread, or ``Testall`` polling); a rank that waits longer
(another rank died, hung or raised) prints which step and collective it was
waiting for and calls ``MPI_Abort``, which ends every rank of the job. A rank
that dies is also noticed by ``mpiexec`` itself, which then kills the others.

Size letters: P ranks, b per-rank batch, L seqLen, G = P*b global batch.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import zlib
from collections.abc import Mapping

import numpy as np

from ..cpu.half import fp16_bits, sum_fp16_rows
from .data import ShardedBatches, stream_batches

__all__ = ["Distributed", "DistributedError", "DivergenceError", "GradReducer", "ShardedBatches",
           "allreduce_grads", "reduce_flat", "launcher_world_size", "require_mpi",
           "weights_checksum", "DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT", "DEFAULT_CHECK_EVERY"]

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024   # 4 Mi float32 per bucket: a few buckets for 10^7..10^8 params
DEFAULT_TIMEOUT = 300.0                    # s a rank waits in one collective before aborting the job
DEFAULT_CHECK_EVERY = 100                  # steps between weight-checksum comparisons
POLL_YIELD_S = 2.0                         # s a polling wait yields the core between polls
                                           # before it sleeps (sleeps slow the all-reduce)

# Environment variables by which launchers announce the number of processes:
# Open MPI's mpirun/mpiexec, MPICH's Hydra (and Intel MPI), MVAPICH2, Slurm's srun
# (SLURM_STEP_NUM_TASKS is set for a job step, not in the batch script itself).
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                       "SLURM_STEP_NUM_TASKS")


class DistributedError(RuntimeError):
    """A distributed run cannot go on (configuration differs between ranks, ...)."""


class DivergenceError(DistributedError):
    """The ranks' weights are no longer identical."""


def launcher_world_size() -> int:
    """Number of processes an MPI launcher (mpiexec, mpirun, srun) started, read
    from its environment variables; 1 when none is set (a plain ``python``) or
    when ``MAMBA_EXT_DISTRIBUTED=0`` switches the detection off."""
    if os.environ.get("MAMBA_EXT_DISTRIBUTED", "").strip() == "0":
        return 1
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def require_mpi():
    """``mpi4py.MPI``, or an ImportError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"distributed training needs mpi4py and an MPI library: "
                          f"pip install \"mamba_ext[mpi]\" (mpi4py + the mpich wheel), or "
                          f"mpi4py built against your system MPI ({e})") from None
    return MPI


def _float_dtype(what, dtype):
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{what}: expected float32 or float64 arrays, got {dtype}")
    return dtype


# --------------------------------------------------------------- gradients

class GradReducer:
    """Preallocated contiguous buckets for all-reducing a fixed set of gradients.

    ``template``: name -> array (or shape) of the gradients, in the model's
    parameter order; the buckets take them in reverse order (the backward
    produces the last layers first), whole tensors, closed at ``bucket_bytes``
    (a tensor larger than that gets a bucket of its own). ``views``: name ->
    array of the tensor's shape inside its bucket; pass ``views`` itself as the
    gradients to skip the copy in.
    """

    def __init__(self, comm, template: Mapping, *, dtype=np.float32,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, waiter=None):
        if not isinstance(template, Mapping) or not template:
            raise TypeError("GradReducer: template: expected a non-empty mapping name -> array or shape")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) \
                or bucket_bytes < 1:
            raise ValueError(f"GradReducer: bucket_bytes: expected an integer >= 1, got {bucket_bytes!r}")
        self.comm = comm
        self.dtype = _float_dtype("GradReducer: dtype", dtype)
        self.shapes = {k: tuple(np.shape(v)) if isinstance(v, np.ndarray) else tuple(v)
                       for k, v in template.items()}
        cap = max(1, int(bucket_bytes) // self.dtype.itemsize)
        groups, cur, n = [], [], 0
        for name in reversed(list(self.shapes)):
            size = int(np.prod(self.shapes[name], dtype=np.int64))
            if cur and n + size > cap:
                groups.append(cur)
                cur, n = [], 0
            cur.append(name)
            n += size
        groups.append(cur)
        self.buckets = []   # each (n_i,) contiguous, of self.dtype
        self.views = {}
        self.bucket_of = {}
        for i, names in enumerate(groups):
            sizes = [int(np.prod(self.shapes[k], dtype=np.int64)) for k in names]
            buf = np.zeros(sum(sizes), self.dtype)
            off = 0
            for k, s in zip(names, sizes):
                self.views[k] = buf[off:off + s].reshape(self.shapes[k])
                self.bucket_of[k] = i
                off += s
            self.buckets.append(buf)
        self.groups = groups
        self.n = sum(b.size for b in self.buckets)
        self.scalars = np.zeros(2, np.float64)   # (2,): loss, overflow flag
        self._wait = waiter or _plain_wait

    def _check(self, grads: Mapping):
        if not isinstance(grads, Mapping):
            raise TypeError(f"allreduce_grads: grads: expected a mapping name -> array, "
                            f"got {type(grads).__name__}")
        if set(grads) != set(self.shapes):
            missing = sorted(set(self.shapes) - set(grads))
            unknown = sorted(map(str, set(grads) - set(self.shapes)))
            raise ValueError(f"allreduce_grads: grads: missing {missing}, unknown {unknown} "
                             f"(the names must stay the same from step to step)")
        for k, g in grads.items():
            self._check_one(k, g)

    def _check_one(self, k, g):
        if not isinstance(g, np.ndarray) or g.dtype != self.dtype:
            raise TypeError(f"allreduce_grads: grads[{k!r}]: expected a {self.dtype} array, got "
                            f"{getattr(g, 'dtype', type(g).__name__)}")
        if g.shape != self.shapes[k]:
            raise ValueError(f"allreduce_grads: grads[{k!r}]: expected shape {self.shapes[k]}, "
                             f"got {g.shape}")

    def reduce(self, grads: Mapping, loss: float = 0.0, overflow: bool = False, *,
               average: bool = True, what: str = "gradients"):
        """All-reduce ``grads`` (sum over ranks; divided by P when ``average``).

        Returns ``(views, loss, overflow)``: ``views`` holds the reduced
        gradients (identical on every rank), ``loss`` the mean of the ranks'
        losses and ``overflow`` True if any rank passed True. The same as
        :meth:`begin`, :meth:`add` of every gradient, :meth:`finish`.
        """
        self._check(grads)
        self.begin(average=average)
        for names in self.groups:
            for k in names:
                self._put(k, grads[k])
            self._progress()
        return self.finish(loss, overflow, what=what)

    def begin(self, *, average: bool = True) -> "GradReducer":
        """Start a reduction whose gradients arrive in parts (:meth:`add`), e.g. from
        ``model_loss_and_grads(grads_ready=reducer.add)`` during the backward; then
        :meth:`finish`. Returns the reducer."""
        # the mean: every rank scales by 1/P while it copies into the bucket (one pass),
        # then the all-reduce sums; for P a power of two this equals (sum)/P exactly
        self._inv = self.dtype.type(1.0 / self.comm.Get_size() if average else 1.0)
        self._missing = [len(names) for names in self.groups]    # per bucket: not yet added
        self._added = set()
        self._reqs = []
        return self

    def add(self, names, grads: Mapping) -> None:
        """Copy the gradients ``names`` (final from now on) into their buckets, scaled, and
        start the all-reduce of every bucket that is then complete (non-blocking, in
        place). Every rank adds the same names in the same order."""
        if getattr(self, "_missing", None) is None:
            raise RuntimeError("GradReducer.add: call begin() first")
        for k in names:
            if k not in self.shapes or k in self._added:
                why = "added twice" if k in self._added else "not a gradient of this reducer"
                raise ValueError(f"GradReducer.add: {k!r} is {why}")
            self._check_one(k, grads[k])
            self._put(k, grads[k])
        self._progress()

    def _put(self, k, g):
        """Gradient ``k`` (checked) into its bucket, scaled; the bucket's all-reduce
        started when it is then complete."""
        from mpi4py import MPI
        if self._inv != 1:
            np.multiply(g, self._inv, out=self.views[k])
        elif g is not self.views[k]:
            np.copyto(self.views[k], g)
        self._added.add(k)
        i = self.bucket_of[k]
        self._missing[i] -= 1
        if self._missing[i] == 0:
            self._reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, self.buckets[i], op=MPI.SUM))

    def _progress(self):
        """Let MPI progress the buckets started so far."""
        from mpi4py import MPI
        if self._reqs:
            MPI.Request.Testall(self._reqs)

    def finish(self, loss: float = 0.0, overflow: bool = False, *, what: str = "gradients"):
        """Wait for every bucket (all must have been added) and all-reduce ``loss`` and
        ``overflow``: ``(views, mean loss, any overflow)`` as :meth:`reduce`."""
        from mpi4py import MPI
        if getattr(self, "_missing", None) is None:
            raise RuntimeError("GradReducer.finish: call begin() first")
        if any(self._missing):
            missing = sorted(set(self.shapes) - self._added)
            raise ValueError(f"GradReducer.finish: gradients never added: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        P = self.comm.Get_size()
        self.scalars[:] = (float(loss), 1.0 if overflow else 0.0)
        reqs = self._reqs + [self.comm.Iallreduce(MPI.IN_PLACE, self.scalars, op=MPI.SUM)]
        self._missing = self._reqs = None
        self._wait(reqs, what)
        return self.views, float(self.scalars[0]) / P, bool(self.scalars[1] > 0)


# float32 elements of a part from which mixed precision's parts travel as fp16 by default
# (FlatStream: the conversions cost more than the halved bytes save below it)
FP16_WIRE_MIN = 1 << 20


class FlatStream:
    """All-reduce of one flat float array in parts, each started as soon as it is
    ready: the GPU trainer reads its gradient arena back layer by layer while the
    backward of the layers below still runs (:meth:`ResidentTrainer.step
    <mamba_ext.gpu.trainer.ResidentTrainer.step>`). ``add(part)`` scales a writeable
    contiguous 1-D view by 1/P (the mean, as in :meth:`GradReducer.reduce`),
    starts its non-blocking all-reduce in place and returns its request (``Test()``
    tells when that part is on its way; the part is final after :meth:`finish`);
    ``finish(loss, overflow)`` all-reduces those two in float64 and waits for
    everything (``waiter``, e.g. :meth:`Distributed.wait` with its deadline): (mean
    loss, any overflow). Every rank adds the same parts in the same order.

    Mixed precision, ``add(part, unscale=...)``: the part holds loss-scaled gradients
    rounded to fp16 and ``unscale`` divides gradients by the scale in place
    (``DynamicLossScaler.unscale``). With ``fp16_wire`` such a part travels as fp16
    values: an all-gather of 2 bytes per value, summed on every rank in float32 in rank
    order, then unscaled and divided by P (in :meth:`progress` once it has arrived, or
    in :meth:`finish`). The ring all-reduce of float32 moves 2(P-1)/P x 4 bytes per
    value into each rank, the all-gather (P-1) x 2: fewer for P <= 3, so ``fp16_wire``
    None (the default) means P in (2, 3) and parts of at least :data:`FP16_WIRE_MIN`
    values (below, the conversions cost more than the bytes save: docs/distributed.md).
    The results: for P = 2 and a scale that is a power of two (DynamicLossScaler's
    defaults) the same bits as the float32 path
    (scaling by powers of two commutes with the one rounding of a two-term sum, barring
    float32 underflow); otherwise equal to float32 rounding (the float32 path scales
    by 1/P before an all-reduce whose order MPI chooses)."""

    def __init__(self, comm, *, average: bool = True, waiter=None, what: str = "gradients",
                 fp16_wire: bool | None = None, pool: list | None = None):
        from mpi4py import MPI
        self.MPI, self.comm, self.P = MPI, comm, comm.Get_size()
        self.average, self.waiter, self.what = average, waiter or _plain_wait, what
        self.fp16_wire = None if fp16_wire is None else bool(fp16_wire)
        # the fp16 parts' buffers, kept by the caller from one step's stream to the next
        # (``pool``, a list: entry k serves the k-th fp16 part while its size holds):
        # fresh ones cost page faults on every step
        self.pool = [] if pool is None else pool
        self.reqs = []
        # fp16 parts not yet summed: [(request, sent (n,) and received (P, n) fp16 bits, part,
        # unscale)]; the sent copy is kept alive until its all-gather is done
        self.gathers = []
        self._n16 = 0           # fp16 parts added so far (the next one's pool entry)

    def add(self, part: np.ndarray, *, unscale=None):
        if not isinstance(part, np.ndarray) or part.ndim != 1 or not part.flags.c_contiguous \
                or not part.flags.writeable:
            raise TypeError("FlatStream.add: part: expected a writeable, contiguous 1-D array")
        _float_dtype("FlatStream.add: part", part.dtype)
        if unscale is not None and self.uses_fp16(part.size):
            if part.dtype != np.float32:
                raise TypeError("FlatStream.add: a part with unscale travels as fp16: expected "
                                f"float32, got {part.dtype}")
            k, self._n16 = self._n16, self._n16 + 1
            if k < len(self.pool) and self.pool[k][1].shape == (self.P, part.size):
                sent, got = self.pool[k]
            else:
                sent = np.empty(part.size, np.uint16)                # (n,) fp16 bits: exact
                got = np.empty((self.P, part.size), np.uint16)       # (P, n)
                self.pool[k:k + 1] = [(sent, got)]
            fp16_bits(part, sent)
            req = self.comm.Iallgather(sent, got)
            self.gathers.append((req, (sent, got), part, unscale))
        else:
            if unscale is not None:
                unscale([part])
            if self.average and self.P != 1:
                np.multiply(part, part.dtype.type(1.0 / self.P), out=part)
            req = self.comm.Iallreduce(self.MPI.IN_PLACE, part, op=self.MPI.SUM)
        self.reqs.append(req)
        self.MPI.Request.Testall(self.reqs)      # let MPI progress before the next part
        return req

    def uses_fp16(self, n: int) -> bool:
        """Whether a part of ``n`` elements added with ``unscale`` travels as fp16."""
        if self.P == 1:
            return False
        if self.fp16_wire is None:
            return self.P in (2, 3) and n >= FP16_WIRE_MIN
        return self.fp16_wire

    def _sum_gathered(self, done_only: bool):
        """The fp16 parts that have arrived (all with ``done_only`` False: the caller has
        waited): part = unscale(sum over ranks in rank order) / P."""
        keep = []
        for item in self.gathers:
            req, (_, got), part, unscale = item
            if done_only and not req.Test():
                keep.append(item)
                continue
            sum_fp16_rows(got, part)
            unscale([part])
            if self.average:
                np.multiply(part, np.float32(1.0 / self.P), out=part)
        self.gathers = keep

    def progress(self) -> None:
        """Let MPI advance the all-reduces started so far (most MPI libraries move a
        non-blocking collective only inside MPI calls), and sum the fp16 parts that
        have arrived; call it while waiting."""
        if self.reqs:
            self.MPI.Request.Testall(self.reqs)
        if self.gathers:
            self._sum_gathered(done_only=True)

    def finish(self, loss: float = 0.0, overflow: bool = False):
        scalars = np.array([float(loss), 1.0 if overflow else 0.0])   # (2,) float64
        self.reqs.append(self.comm.Iallreduce(self.MPI.IN_PLACE, scalars, op=self.MPI.SUM))
        self.waiter(self.reqs, self.what)
        self._sum_gathered(done_only=False)
        self.reqs = []
        return float(scalars[0]) / self.P, bool(scalars[1] > 0)


def reduce_flat(comm, flat: np.ndarray, loss: float = 0.0, overflow: bool = False, *,
                average: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES, waiter=None,
                what: str = "gradients"):
    """All-reduce one contiguous float array in place, in ``bucket_bytes`` slices
    (one flat buffer, so no copy). Returns ``(flat, mean loss, any overflow)``."""
    if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous \
            or not flat.flags.writeable:
        raise TypeError("reduce_flat: flat: expected a writeable, contiguous 1-D array")
    _float_dtype("reduce_flat: flat", flat.dtype)
    stream = FlatStream(comm, average=average, waiter=waiter, what=what)
    step = max(1, int(bucket_bytes) // flat.itemsize)
    for lo in range(0, flat.size, step):
        stream.add(flat[lo:lo + step])
    loss, overflow = stream.finish(loss, overflow)
    return flat, loss, overflow


def _plain_wait(reqs, what):
    from mpi4py import MPI
    MPI.Request.Waitall(reqs)


_REDUCERS = {}


def allreduce_grads(grads: Mapping, comm=None, *, average: bool = True,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float | None = None) -> Mapping:
    """All-reduce a dict of gradients over ``comm`` (default ``MPI.COMM_WORLD``),
    in place: afterwards every rank holds the sum over ranks (the mean when
    ``average``, the default), bitwise the same on every rank.

    The arrays are copied into a few preallocated contiguous buckets (kept for
    the next call with the same names, shapes and dtype), each bucket is
    all-reduced with a non-blocking ``Iallreduce`` started as soon as it is
    filled, and the result is copied back into ``grads``' arrays. Returns
    ``grads``. ``timeout``: seconds to wait before ``MPI_Abort`` (None: wait
    as long as it takes).
    """
    MPI = require_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"allreduce_grads: comm: expected None or an mpi4py communicator, got "
                        f"{type(comm).__name__}")
    if not isinstance(grads, Mapping) or not grads:
        raise TypeError("allreduce_grads: grads: expected a non-empty mapping name -> array")
    for k, g in grads.items():      # all or nothing: refused before any array is written
        if not isinstance(g, np.ndarray):
            raise TypeError(f"allreduce_grads: grads[{k!r}]: expected a numpy array, got "
                            f"{type(g).__name__}")
        if not g.flags.writeable:
            raise ValueError(f"allreduce_grads: grads[{k!r}] is read-only; the reduction works "
                             f"in place (nothing was reduced)")
    dtypes = {np.asarray(g).dtype for g in grads.values()}
    if len(dtypes) != 1:
        raise TypeError(f"allreduce_grads: grads: expected one float dtype, got {sorted(map(str, dtypes))}")
    dtype = _float_dtype("allreduce_grads: grads", dtypes.pop())
    key = (comm.py2f(), tuple((k, np.shape(v)) for k, v in grads.items()), dtype.str,
           int(bucket_bytes), timeout)
    red = _REDUCERS.get(key)
    if red is None:
        if len(_REDUCERS) > 8:
            _REDUCERS.clear()
        waiter = None if timeout is None else Distributed(comm, timeout=timeout).wait
        red = _REDUCERS[key] = GradReducer(comm, grads, dtype=dtype, bucket_bytes=bucket_bytes,
                                           waiter=waiter)
    views, _, _ = red.reduce(grads, average=average)
    for k, g in grads.items():
        np.copyto(g, views[k])
    return grads


# ------------------------------------------------------------ the hook object

def weights_checksum(arrays: Mapping) -> int:
    """CRC32 of the weights' bytes in name order (bitwise identity check)."""
    crc = 0
    for k in sorted(arrays):
        crc = zlib.crc32(np.ascontiguousarray(arrays[k]).view(np.uint8), crc)
    return crc


class Distributed:
    """What the training loop (``mamba_ext.training.loop.train(dist=...)``)
    needs from the distributed run: rank and size, the sharded data, the
    gradient reduction, weight checks, checkpoint data state, the deadline.

    ``comm``: an ``mpi4py`` communicator (default ``MPI.COMM_WORLD``);
    ``timeout``: seconds one collective may wait before the job is aborted;
    ``check_every``: steps between weight-checksum comparisons (0: only at the
    start and the end); ``bucket_bytes``: gradient bucket size; ``blocking``:
    how :meth:`wait` waits (None: block under a watchdog thread when MPI gives
    ``MPI_THREAD_MULTIPLE``, else poll).
    """

    def __init__(self, comm=None, *, timeout: float = DEFAULT_TIMEOUT,
                 check_every: int = DEFAULT_CHECK_EVERY,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, blocking: bool | None = None,
                 stream=None):
        MPI = require_mpi()
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout: expected a finite number of seconds > 0, got {timeout!r}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every: expected an integer >= 0, got {check_every!r}")
        self.timeout, self.check_every, self.bucket_bytes = float(timeout), check_every, bucket_bytes
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.blocking = (MPI.Query_thread() == MPI.THREAD_MULTIPLE if blocking is None
                         else bool(blocking))
        launched = launcher_world_size()
        if comm is None and self.size == 1 and launched > 1:
            raise DistributedError(
                f"the launcher started {launched} processes but MPI sees only this one: mpi4py "
                f"loaded another MPI library than the launcher's (e.g. the mpich wheel under a "
                f"system Open MPI mpirun), or srun ran without an MPI plugin (srun --mpi=pmix). "
                f"Use the mpiexec of the MPI that mpi4py loads "
                f"({MPI.Get_library_version().splitlines()[0].strip()}), or set MPI4PY_LIBMPI; "
                f"MAMBA_EXT_DISTRIBUTED=0 turns the launcher detection off")
        self.is_root = self.rank == 0
        self.stream = stream if stream is not None else sys.stderr
        self.step = None          # the step in flight (for messages)
        self._reducer = None
        self._wire_pool = []        # FlatStream's fp16 buffers, reused step after step
        self.data = None

    # -- deadline -------------------------------------------------------------
    def wait(self, reqs, what: str) -> None:
        """Wait for ``reqs``; past ``timeout`` seconds print why and abort the job.

        ``blocking`` (MPI_THREAD_MULTIPLE, which mpi4py asks for): block in
        ``Waitall``, where every MPI library progresses its collectives best
        (Open MPI's non-blocking collectives advance only inside MPI calls), while
        a watchdog timer thread aborts the job at the deadline. Otherwise poll
        ``Testall`` (which drives the progress too), giving the core away between polls
        (``sched_yield``) for the first :data:`POLL_YIELD_S` seconds, then backing off to
        1 ms sleeps, so that a waiting rank leaves the cores to ranks still computing.
        """
        MPI = self.MPI
        if self.blocking:
            timer = threading.Timer(self.timeout, self._expired, (what, self.step))
            timer.daemon = True
            timer.start()
            try:
                MPI.Request.Waitall(reqs)
            finally:
                timer.cancel()
            return
        start = time.monotonic()
        delay = 0.0
        while not MPI.Request.Testall(reqs):
            now = time.monotonic()
            if now > start + self.timeout:
                self._expired(what, self.step)
            if now < start + POLL_YIELD_S:
                os.sched_yield() if hasattr(os, "sched_yield") else time.sleep(0)
                continue
            if delay:
                time.sleep(delay)
            delay = min(delay * 2 if delay else 1e-5, 1e-3)

    def _expired(self, what, step):
        self.abort(f"no answer within {self.timeout:g} s in the all-reduce of {what}"
                   f"{'' if step is None else f' at step {step}'}: another rank died, hung or "
                   f"failed. Aborting the job (the last checkpoint stays valid).")

    def abort(self, message: str, code: int = 3):
        """Print ``message`` (prefixed with this rank) and end every rank of the job."""
        try:
            self.stream.write(f"\nmamba_ext.distributed: rank {self.rank}/{self.size}: {message}\n")
            self.stream.flush()
            # the launcher forwards our output through its own pipes and stops reading
            # them when it tears the job down: give it a moment to pass the message on
            time.sleep(1.0)
        finally:
            self.comm.Abort(code)
        os._exit(code)   # pragma: no cover - Abort does not return

    def _gather_u64(self, value: int, what: str) -> list:
        out = np.zeros(self.size, np.uint64)          # (P,)
        mine = np.array([value], np.uint64)
        self.wait([self.comm.Iallgather(mine, out)], what)
        return [int(v) for v in out]

    # -- set-up and checks ----------------------------------------------------
    def check_same(self, value: int, what: str, error=DistributedError) -> None:
        """All ranks must hold the same ``value`` (e.g. a checksum); else raise
        ``error`` on every rank, naming the ranks that differ from rank 0."""
        values = self._gather_u64(value, what)
        bad = [r for r, v in enumerate(values) if v != values[0]]
        if bad:
            raise error(f"ranks disagree on {what} (checksums): rank 0 has {values[0]:#010x}, "
                        + ", ".join(f"rank {r} has {values[r]:#010x}" for r in bad))

    def start(self, config: dict, params: Mapping) -> None:
        """Check that every rank runs the same configuration on the same weights."""
        import json
        # threads may differ per node (cores / ranks of that node)
        text = json.dumps({k: v for k, v in config.items() if k != "threads"},
                          sort_keys=True).encode()
        self.check_same(zlib.crc32(text), "the training configuration")
        self.check_same(weights_checksum(params), "the initial weights")

    def check_weights(self, step: int, params_fn, force: bool = False) -> None:
        """Every ``check_every`` steps (after step ``step``) compare the weights'
        checksums; ``params_fn()`` gives the weights (read back only then)."""
        if not force and not (self.check_every and step % self.check_every == 0):
            return
        self.check_same(weights_checksum(params_fn()), f"the weights after step {step}",
                        DivergenceError)

    # -- data -------------------------------------------------------------------
    def shard(self, corpus, seq_len: int, batch: int, seed: int, start_step: int = 0,
              state: dict | None = None) -> ShardedBatches:
        """This rank's :class:`ShardedBatches` (data.stream_batches); ``state``: a
        checkpoint's ``extra["distributed"]`` (the stream position to continue at), or None."""
        self.data = stream_batches(corpus, seq_len, batch, seed, self.rank, self.size,
                                   start_step, state)
        return self.data

    # -- gradients ------------------------------------------------------------
    def flat_stream(self, fp16_wire: bool | None = None) -> FlatStream:
        """A :class:`FlatStream` over this job's ranks, waited for under the deadline."""
        return FlatStream(self.comm, waiter=self.wait, what="gradients", fp16_wire=fp16_wire,
                          pool=self._wire_pool)

    def reduce(self, grads, loss: float = 0.0, overflow: bool = False):
        """Mean of ``grads`` over ranks (a dict, through the buckets, or one
        flat array, in place), mean loss, any overflow: ``(grads, loss, overflow)``."""
        what = "gradients"
        if isinstance(grads, np.ndarray):
            return reduce_flat(self.comm, grads, loss, overflow, bucket_bytes=self.bucket_bytes,
                               waiter=self.wait, what=what)
        return self.reducer(grads).reduce(grads, loss, overflow, what=what)

    def reducer(self, template: Mapping) -> GradReducer:
        """The job's :class:`GradReducer` for gradients like ``template`` (built on first
        use, under the job's deadline): ``reducer(params).begin()``, then
        ``model_loss_and_grads(..., grads_ready=r.add)`` starts each bucket's all-reduce
        during the backward, and ``r.finish(loss, overflow)`` waits for the rest."""
        if self._reducer is None:
            dtypes = {np.asarray(g).dtype for g in template.values()}
            self._reducer = GradReducer(self.comm, template, dtype=dtypes.pop() if len(dtypes) == 1
                                        else np.float32, bucket_bytes=self.bucket_bytes,
                                        waiter=self.wait)
        return self._reducer

    def _node(self):
        """This node's ranks (a communicator; collective on first use)."""
        if getattr(self, "_node_comm", None) is None:
            self._node_comm = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        return self._node_comm

    def default_threads(self) -> int:
        """CPU threads per rank (collective over the node's ranks): the cores this
        rank may run on, divided among the node's ranks when they all share the
        same cores (no binding), kept whole when the launcher bound each rank to
        its own (Open MPI's --bind-to, srun --cpus-per-task)."""
        node = self._node()
        mine = (tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity")
                else tuple(range(os.cpu_count() or 1)))
        shared = all(a == mine for a in node.allgather(mine))
        return max(1, len(mine) // node.Get_size() if shared else len(mine))

    def gpu_index(self, explicit: int | None = None) -> int:
        """The adapter of this rank: ``explicit``, or the rank on this node
        modulo the number of adapters found (``mamba_ext.gpu.device.adapter_count``)."""
        if explicit is not None:
            return int(explicit)
        from ..gpu.device import adapter_count
        local_rank = self._node().Get_rank()
        return local_rank % max(1, adapter_count())
