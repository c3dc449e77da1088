"""Data-parallel training over MPI: the public import path (re-exports; the code is in
mamba_ext.training.distributed, the command line's options in mamba_ext.cli.distributed,
the scaling benchmark in mamba_ext.bench.distributed).

``from mamba_ext.distributed import allreduce_grads, ShardedBatches`` for a
training loop of your own; ``Distributed`` is the object
``mamba_ext.training.loop.train(dist=...)`` takes. Implementation and design:
``mamba_ext.training.distributed`` and docs/distributed.md.
"""
from .training.distributed import (DEFAULT_BUCKET_BYTES, DEFAULT_CHECK_EVERY, DEFAULT_TIMEOUT,
                                   Distributed, DistributedError, DivergenceError, FlatStream,
                                   GradReducer,
                                   ShardedBatches, allreduce_grads, launcher_world_size,
                                   reduce_flat, require_mpi, weights_checksum)

__all__ = ["allreduce_grads", "reduce_flat", "FlatStream", "ShardedBatches", "GradReducer", "Distributed",
           "DistributedError", "DivergenceError", "launcher_world_size", "require_mpi",
           "weights_checksum", "DEFAULT_BUCKET_BYTES", "DEFAULT_CHECK_EVERY", "DEFAULT_TIMEOUT"]
