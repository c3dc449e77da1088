"""The data-parallel scaling benchmark (``mpiexec -n P python -m mamba_ext.bench.distributed``;
the training code it measures is mamba_ext.training.distributed): one training
configuration, docs/distributed.md.

Every rank runs ``--warmup`` + ``--steps`` training steps of the model
``--model LAYERSxDMODEL`` on random bytes, timing per step: compute (loss and
gradients, with each bucket's all-reduce started during the backward; on the GPU also
the read-back of the gradient arena), the wait for the gradient all-reduce after it
(``mamba_ext.distributed``: buckets + Iallreduce) and the
optimizer (CPU: clip + AdamW; GPU: write-back + grad norm + AdamW). With
P = 1 the step is the plain single-process one (no buckets, no staging): the
baseline of the speed-ups. Then the
all-reduce alone on the same bytes (``--comm-reps`` times) for the bus
bandwidth ``2 (P-1)/P * bytes / t``; with ``--amp`` and P > 1 also mixed precision's
streamed reduction of those bytes (FlatStream in ``--bucket-mib`` parts, unscaled by a
DynamicLossScaler) with fp16 on the wire and with float32. Rank 0 prints one table row and, with
``--json FILE``, appends the numbers as one JSON line.

Size letters: P ranks, b per-rank batch, L seqLen, G = P*b global batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _parse_model(text):
    try:
        layers, dm = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYERSxDMODEL like 4x256, got {text!r}") from None
    if layers < 1 or dm < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return layers, dm


def build_parser():
    p = argparse.ArgumentParser(prog="mpiexec -n P python -m mamba_ext.bench.distributed",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=_parse_model, default=(4, 256), metavar="LxDM",
                   help="layers x d_model (d_state 16, expand 2)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--batch", type=int, default=None, metavar="b",
                   help="per-rank batch (weak scaling); default 16")
    p.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="global batch, split over the ranks (strong scaling); excludes --batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per rank (default: the node's cores / its ranks)")
    p.add_argument("--comm-reps", type=int, default=5)
    p.add_argument("--bucket-mib", type=float, default=16.0)
    p.add_argument("--amp", action="store_true",
                   help="--device gpu: mixed precision (a DynamicLossScaler; the tensor-core "
                        "products where the device has them)")
    p.add_argument("--wait", choices=("auto", "block", "poll"), default="auto",
                   help="how a rank waits for the all-reduce (Distributed's blocking: auto, True, "
                        "False)")
    p.add_argument("--label", default="", help="free text for the table row (e.g. weak/strong)")
    p.add_argument("--json", default=None, metavar="FILE", help="append the result as a JSON line")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..distributed import Distributed
    dist = Distributed(check_every=0, bucket_bytes=int(args.bucket_mib * 2 ** 20),
                       blocking={"auto": None, "block": True, "poll": False}[args.wait])
    P, rank = dist.size, dist.rank
    if args.global_batch is not None:
        if args.batch is not None:
            raise SystemExit("--batch and --global-batch exclude each other")
        if args.global_batch % P:
            raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of P = {P}")
        b = args.global_batch // P
    else:
        b = args.batch or 16
    if args.amp and args.device != "gpu":
        raise SystemExit("--amp: with --device gpu only (the CPU's AMP step is train --amp)")
    threads = args.threads or dist.default_threads()
    if args.device == "gpu" and not os.environ.get("MAMBA_EXT_GPU_INDEX"):
        from ..gpu.device import use_adapter
        use_adapter(dist.gpu_index())
    from ..model import init_model_params, model_loss_and_grads
    from ..optim import AdamW, clip_grad_norm
    from ..training.data import ShardedBatches

    layers, dm = args.model
    L = args.seq_len
    data = np.random.default_rng(0).integers(0, 256, 8 * 2 ** 20, dtype=np.uint8)
    shard = ShardedBatches(data, L, b, seed=0, rank=rank, size=P)
    params = init_model_params(256, dm, layers, d_state=16, expand=2, seed=0)
    n_params = sum(a.size for a in params.values())
    t_comp, t_comm, t_opt, t_step = [], [], [], []

    if args.device == "gpu":
        from ..gpu import ResidentTrainer
        from ..gpu.device import gpu
        from ..amp import DynamicLossScaler
        trainer = ResidentTrainer(params, lr=1e-3, clip=1.0,
                                  scaler=DynamicLossScaler() if args.amp else None)
        adapter = gpu().info.get("device", "?") + (", AMP" if args.amp else "")
        phases = []

        def step(k):
            tok, tgt = shard.get(k)
            t0 = time.perf_counter()
            # P = 1: the plain single-GPU step (one submit, no staging) is the baseline;
            # P > 1: gradients streamed into the all-reduce during the backward, comm =
            # the wait after the backward's last submit (read-backs and all-reduces)
            if P == 1:
                trainer.step(tok, tgt)
                comm = 0.0
            else:
                trainer.step(tok, tgt, reduce=dist)   # ends with the grad-stat read: GPU idle
                comm = trainer.last_reduce_s
                phases.append(trainer.last_stream_s)
            dt = time.perf_counter() - t0
            return dt - comm, comm, 0.0, dt
    else:
        adapter = f"{threads} CPU threads/rank"
        opt = AdamW(params, lr=1e-3, weight_decay=0.1, n_threads=threads)

        def step(k):
            tok, tgt = shard.get(k)
            t0 = time.perf_counter()
            # P = 1: the plain single-process step is the baseline; P > 1: each bucket's
            # all-reduce started during the backward (as train runs), comm = the wait after it
            red = dist.reducer(params).begin() if P > 1 else None
            loss, grads = model_loss_and_grads(tok, tgt, params, n_threads=threads,
                                               grads_ready=None if red is None else red.add)
            t1 = time.perf_counter()
            if red is not None:
                grads, loss, _ = red.finish(loss)
            t2 = time.perf_counter()
            clip_grad_norm(grads, 1.0, n_threads=threads)
            opt.step(grads)
            t3 = time.perf_counter()
            return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    for k in range(args.warmup):
        step(k)
    dist.comm.Barrier()
    wall0 = time.perf_counter()
    for k in range(args.warmup, args.warmup + args.steps):
        for acc, v in zip((t_comp, t_comm, t_opt, t_step), step(k)):
            acc.append(v)
    wall = time.perf_counter() - wall0
    wall = dist.comm.allreduce(wall, op=dist.MPI.MAX)

    # the all-reduce alone, on the gradient bytes (every rank enters together)
    grads = {k: np.zeros_like(a) for k, a in params.items()}
    readback = float("nan")
    if args.device == "gpu":        # the host staging alone: arena read-back + write-back
        t = time.perf_counter()
        grads = gpu().read(trainer.gr, trainer.n)
        gpu().write(trainer.gr, grads)
        gpu().sync()
        readback = time.perf_counter() - t
    comm_alone = []
    for _ in range(args.comm_reps):
        dist.comm.Barrier()
        t = time.perf_counter()
        dist.reduce(grads, 0.0)
        comm_alone.append(time.perf_counter() - t)
    nbytes = 4 * (grads.size if isinstance(grads, np.ndarray) else n_params)
    t_ar = statistics.median(comm_alone)
    busbw = 2 * (P - 1) / P * nbytes / t_ar if P > 1 else float("nan")
    wire = {}       # AMP's streamed reduction alone: fp16 / float32 on the wire -> seconds
    if args.amp and P > 1:
        from ..amp import DynamicLossScaler
        unscale = DynamicLossScaler().unscale
        flat = np.ones(nbytes // 4, np.float32)           # (n_params,) fp16 values
        part = max(1, int(args.bucket_mib * 2 ** 20) // 4)
        for fp16 in (True, False):
            ts = []
            for _ in range(args.comm_reps):
                flat[:] = 1.0
                dist.comm.Barrier()
                t = time.perf_counter()
                stream = dist.flat_stream(fp16_wire=fp16)
                for lo in range(0, flat.size, part):
                    stream.add(flat[lo:lo + part], unscale=unscale)
                stream.finish()
                ts.append(time.perf_counter() - t)
            wire["fp16" if fp16 else "float32"] = statistics.median(ts)

    med = lambda v: statistics.median(v) if v else 0.0
    mine = np.array([med(t_comp), med(t_comm), med(t_opt), med(t_step)])
    worst = np.zeros_like(mine)            # (4,) slowest rank of each part
    dist.comm.Allreduce(mine, worst, op=dist.MPI.MAX)
    if rank == 0:
        tokens = args.steps * P * b * L
        row = {"label": args.label, "device": args.device, "model": f"{layers}x{dm}",
               "params": int(n_params), "P": P, "b": b, "G": P * b, "L": L, "threads": threads,
               "adapter": adapter, "steps": args.steps, "tokens_per_s": tokens / wall,
               "step_s": float(worst[3]), "compute_s": float(worst[0]), "comm_s": float(worst[1]),
               "opt_s": float(worst[2]), "allreduce_alone_s": t_ar, "grad_bytes": nbytes,
               "busbw_GBps": busbw / 1e9, "staging_s": readback, "amp_wire_s": wire,
               # effective FLOP/s of one rank by the 6 N FLOP per token rule (forward 2N, backward 4N)
               "flops_per_rank": 6 * n_params * b * L / float(worst[0]),
               "mpi": dist.MPI.Get_library_version().splitlines()[0]}
        print(f"{args.label:8s} {args.device} {layers}x{dm} P={P:<3d} b={b:<4d} G={P * b:<5d} "
              f"L={L} thr={threads:<3d} {row['tokens_per_s']:10.0f} tok/s  step {worst[3] * 1e3:8.1f} ms"
              f"  compute {worst[0] * 1e3:8.1f}  allreduce {worst[1] * 1e3:7.1f}  opt {worst[2] * 1e3:6.1f}"
              f"  | allreduce alone {t_ar * 1e3:7.2f} ms on {nbytes / 1e6:.1f} MB"
              + (f", busbw {busbw / 1e9:.2f} GB/s" if P > 1 else "")
              + (f"; read-back + write-back {readback * 1e3:.1f} ms" if readback == readback else "")
              + ("; AMP's streamed reduction alone: " + ", ".join(
                  f"{k} on the wire {v * 1e3:.2f} ms" for k, v in wire.items()) if wire else "")
              + f"; 6N FLOP/token: {row['flops_per_rank'] / 1e12:.2f} TFLOP/s per rank", flush=True)
        if args.device == "gpu" and P > 1:
            ph = {k: statistics.median(p[k] for p in phases[args.warmup:]) * 1e3 for k in phases[0]}
            print("  rank 0, streamed gradients (median ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in ph.items()), flush=True)
            row["stream_ms"] = ph
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
