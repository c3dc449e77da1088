"""The distributed options of ``python -m mamba_ext train`` (the command line's side of
mamba_ext.training.distributed): parse them, make the job's Distributed, choose this
rank's GPU adapter and CPU threads."""
from __future__ import annotations

import math

from ..training.distributed import (DEFAULT_CHECK_EVERY, DEFAULT_TIMEOUT, Distributed,
                                    launcher_world_size)


def add_arguments(parser) -> None:
    """The distributed options of ``python -m mamba_ext train``."""
    g = parser.add_argument_group("distributed (MPI; docs/distributed.md)")
    g.add_argument("--distributed", action="store_true",
                   help="data-parallel over the MPI ranks: run as  mpiexec -n P python -m mamba_ext "
                        "train --distributed ...  (automatic when mpiexec/mpirun/srun started "
                        "more than one process); --batch is then the per-rank batch")
    g.add_argument("--check-every", type=int, default=DEFAULT_CHECK_EVERY, metavar="N",
                   help="compare a checksum of the weights across ranks every N steps (0: only "
                        "at the start and the end)")
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help="seconds a rank waits in one all-reduce before it aborts the job "
                        "(a rank died or hung)")
    g.add_argument("--gpu-index", type=int, default=None, metavar="I",
                   help="with --device gpu: the adapter to use (default: the rank on its node "
                        "modulo the adapters found)")


def from_args(args, log) -> Distributed | None:
    """The :class:`Distributed` of the parsed command line, or None for a
    single-process run; also chooses this rank's GPU adapter (``gpu.device.use_adapter``)
    and CPU threads."""
    n = launcher_world_size()
    if args.gpu_index is not None and args.gpu_index < 0:
        raise ValueError(f"--gpu-index: expected an adapter index >= 0, got {args.gpu_index}")
    if not args.distributed and n <= 1:
        if args.gpu_index is not None:
            from ..gpu.device import use_adapter
            use_adapter(args.gpu_index)
        return None
    if args.check_every < 0:
        raise ValueError(f"--check-every: expected an integer >= 0, got {args.check_every}")
    if not (math.isfinite(args.dist_timeout) and args.dist_timeout > 0):
        raise ValueError(f"--dist-timeout: expected a number of seconds > 0, got {args.dist_timeout}")
    dist = Distributed(timeout=args.dist_timeout, check_every=args.check_every)
    if not args.distributed and dist.is_root:
        log(f"distributed: {dist.size} processes started by an MPI launcher (--distributed implied)")
    if args.threads is None:
        args.threads = dist.default_threads()
    if args.device == "gpu":
        from ..gpu.device import use_adapter
        use_adapter(dist.gpu_index(args.gpu_index))
    return dist
