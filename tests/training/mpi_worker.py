"""Run under ``mpiexec -n 2`` by tests/training/test_distributed.py.

    python mpi_worker.py MODE CORPUS OUT_DIR

MODE ``api``: the checks that need two ranks, results as JSON in
OUT_DIR/result.json (written by rank 0) for the test to assert on.
MODE ``gpu``: P=2 against P=1 with ``--device gpu``, JSON likewise.
MODE ``kill`` / ``hang``: a training run in which rank 1 is killed with
SIGKILL / stops answering (sleeps) at step 3; the job must end with an error.
"""
import copy
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from mamba_ext.distributed import Distributed, DivergenceError, GradReducer, allreduce_grads
from mamba_ext.training.loop import TrainConfig, train

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
QUIET = dict(progress=None, log=lambda s: None)


def tiny(corpus, **kw):
    cfg = dict(data=corpus, d_model=32, n_layers=1, d_state=8, seq_len=32, batch=4, steps=6,
               lr=1e-2, warmup=3, checkpoint_every=3, threads=1)
    cfg.update(kw)
    return TrainConfig(**cfg)


def example(corpus):
    """The loop of docs/distributed.md ("Python API"), quoted there verbatim."""
    corpus_bytes = np.fromfile(corpus, np.uint8)
    from mpi4py import MPI
    from mamba_ext.distributed import allreduce_grads, ShardedBatches
    import mamba_ext

    comm = MPI.COMM_WORLD
    data = ShardedBatches(corpus_bytes, seq_len=32, batch=4, seed=0,
                          rank=comm.rank, size=comm.size)          # this rank's slice of each global batch
    params = mamba_ext.init_model_params(256, 32, 1, seed=0)         # the same seed on every rank
    opt = mamba_ext.AdamW(params, lr=1e-3)
    for step in range(3):
        tokens, targets = data.get(step)
        loss, grads = mamba_ext.model_loss_and_grads(tokens, targets, params)
        allreduce_grads(grads, comm)      # in place: the mean over ranks, the same bits everywhere
        mamba_ext.clip_grad_norm(grads, 1.0)
        opt.step(grads)
    return params


def api(corpus, out):
    res = {"size": COMM.Get_size()}
    mine = example(corpus)
    theirs = COMM.allgather(mine)
    res["example_same_weights"] = all(np.array_equal(theirs[0][k], theirs[1][k]) for k in mine)
    res["example_moved"] = any(not np.array_equal(mine[k], v) for k, v in
                               __import__("mamba_ext").init_model_params(256, 32, 1, seed=0).items())

    # 1. allreduce_grads: mean over ranks, bitwise the same everywhere, several buckets
    rng = np.random.default_rng(RANK)
    grads = {"a": rng.standard_normal((300, 7)).astype(np.float32),
             "b": rng.standard_normal(1000).astype(np.float32),
             "c": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    mine = {k: v.copy() for k, v in grads.items()}
    others = COMM.allgather(mine)
    allreduce_grads(grads, COMM, bucket_bytes=4096)
    expect = {k: (others[0][k].astype(np.float64) + others[1][k]) / 2 for k in grads}
    res["allreduce_max_err"] = max(float(np.max(np.abs(grads[k] - expect[k]))) for k in grads)
    gathered = COMM.allgather(grads)
    res["allreduce_identical"] = all(np.array_equal(gathered[0][k], gathered[1][k]) for k in grads)

    # 2. the AMP overflow decision is all-reduced: one rank overflowing skips everywhere
    dist = Distributed(COMM, timeout=60)
    flat = np.ones(10, np.float32)
    _, loss, overflow = dist.reduce(flat, loss=float(RANK), overflow=RANK == 1)
    res["overflow_any"], res["loss_mean"] = COMM.allgather(overflow), loss

    # 2b. FlatStream (the GPU trainer's streamed all-reduce): parts added one by one
    flat = np.random.default_rng(10 + RANK).standard_normal(50).astype(np.float32)
    both = COMM.allgather(flat.copy())
    stream = dist.flat_stream()
    for lo, hi in ((30, 50), (0, 7), (7, 30)):
        stream.add(flat[lo:hi])
    loss, overflow = stream.finish(float(RANK), False)
    res["stream_max_err"] = float(np.max(np.abs(flat - (both[0].astype(np.float64) + both[1]) / 2)))
    res["stream_scalars"] = [loss, overflow]

    # 2b'. mixed precision: loss-scaled fp16 values travel as fp16 (an all-gather), summed in
    # rank order and unscaled after: at P = 2 with a power-of-two scale the same bits as the
    # float32 path (unscale, then all-reduce); parts summed by progress() or by finish()
    from mamba_ext.amp import DynamicLossScaler, round_fp16
    scaler = DynamicLossScaler()                              # scale 2**14
    base = round_fp16(np.random.default_rng(30 + RANK).standard_normal(40).astype(np.float32)
                      * np.float32(300))
    base[5] = np.float32(2.0 ** -20)                          # an fp16 subnormal
    wired = {}
    for wire in (True, False):
        flat = base.copy()
        stream = dist.flat_stream(fp16_wire=wire)
        stream.add(flat[0:25], unscale=scaler.unscale)
        for _ in range(50):
            stream.progress()
        stream.add(flat[25:40], unscale=scaler.unscale)
        stream.finish()
        wired[wire] = flat
    both = COMM.allgather(base)
    expect = (both[0].astype(np.float64) + both[1]) / 2 / scaler.scale
    res["fp16_wire_bitwise"] = bool(np.array_equal(wired[True], wired[False]))
    res["fp16_wire_max_rel_err"] = float(np.max(np.abs(wired[True] - expect) / np.abs(expect)))
    auto = dist.flat_stream()
    res["fp16_wire_auto"] = [auto.uses_fp16(1 << 20), auto.uses_fp16(1000)]

    # 2c. the all-reduce overlapped with the backward (grads_ready -> GradReducer.add):
    # the same buckets and sums as the reduction after it, so the same bits
    import mamba_ext
    params = mamba_ext.init_model_params(64, 32, 3, seed=1)
    tok = np.random.default_rng(20 + RANK).integers(0, 64, (2, 32))
    red = GradReducer(COMM, params, bucket_bytes=20000)
    loss, grads = mamba_ext.model_loss_and_grads(tok, tok, params, grads_ready=red.begin().add)
    after = {k: v.copy() for k, v in red.finish(loss, False)[0].items()}
    loss, grads = mamba_ext.model_loss_and_grads(tok, tok, params)
    views = red.reduce(grads, loss)[0]
    res["overlap_buckets"] = len(red.buckets)
    res["overlap_bitwise"] = all(np.array_equal(after[k], views[k]) for k in views)

    # 3. P=2, per-rank batch b=4, k=6 steps vs P=1 batch 8 on the same samples
    p2 = train(tiny(corpus), os.path.join(out, "p2"), dist=Distributed(COMM, check_every=1),
               **QUIET)
    if RANK == 0:
        p1 = train(tiny(corpus, batch=8), os.path.join(out, "p1"),
                   dist=Distributed(MPI.COMM_SELF), **QUIET)
        res["p2_vs_p1_max_abs"] = max(float(np.max(np.abs(p2["params"][k] - p1["params"][k])))
                                      for k in p1["params"])
        res["p2_vs_p1_max_rel_loss"] = max(abs(a - b) / b for a, b in zip(p2["losses"], p1["losses"]))
        res["weights_moved"] = max(float(np.max(np.abs(p1["params"][k]))) for k in p1["params"])
    # 4. resume with P=2 continues exactly (also AMP: the scaler state is restored)
    for amp in (False, True):
        cfg = tiny(corpus, amp=amp, steps=8)
        full = train(copy.deepcopy(cfg), os.path.join(out, f"full{amp}"), dist=Distributed(COMM),
                     **QUIET)
        part = os.path.join(out, f"part{amp}")
        train(copy.deepcopy(cfg), part, dist=Distributed(COMM), stop_after=4, **QUIET)
        COMM.Barrier()   # the root's checkpoint is on disk before the others read it
        resumed = train(copy.deepcopy(cfg), part, resume=os.path.join(part, "checkpoint.safetensors"),
                        dist=Distributed(COMM), **QUIET)
        res[f"resume_exact_amp{amp}"] = (resumed["losses"] == full["losses"] and all(
            np.array_equal(resumed["params"][k], full["params"][k]) for k in full["params"]))

    # 5. divergence: weights that differ on one rank stop the job with a clear error
    params = {"w": np.zeros(8, np.float32)}
    if RANK == 1:
        params["w"][3] = 1e-7
    try:
        Distributed(COMM).check_weights(7, lambda: params, force=True)
        res["divergence"] = None
    except DivergenceError as e:
        res["divergence"] = str(e)
    if RANK == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(res, f)


def gpu(corpus, out):
    """--device gpu on both ranks (each its own wgpu device): P=2 x b=4 vs P=1 x b=8, in
    float32 and with AMP (keys prefixed amp_: each rank's gradients rounded to fp16 and
    unscaled, then reduced)."""
    import mamba_ext
    res = {}
    init = mamba_ext.init_model_params(256, 32, 1, d_state=8, seed=0)     # tiny()'s model
    for amp in (False, True):
        cfg, tag = dict(device="gpu", steps=4, amp=amp), "amp_" if amp else ""
        p2 = train(tiny(corpus, **cfg), os.path.join(out, tag + "g2"),
                   dist=Distributed(COMM, check_every=1), **QUIET)
        if RANK == 0:
            p1 = train(tiny(corpus, batch=8, **cfg), os.path.join(out, tag + "g1"),
                       dist=Distributed(MPI.COMM_SELF), **QUIET)
            diff = np.concatenate([np.abs(p2["params"][k] - p1["params"][k]).ravel() for k in init])
            moved = np.concatenate([np.abs(p1["params"][k] - init[k]).ravel() for k in init])
            res[tag + "p2_vs_p1_max_abs"] = float(diff.max())
            res[tag + "mean_diff_over_mean_move"] = float(diff.mean() / moved.mean())
            res[tag + "losses"] = [p2["losses"], p1["losses"]]
            res[tag + "skipped"] = [p2["skipped_steps"], p1["skipped_steps"]]
    if RANK == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(res, f)


class _Fault(Distributed):
    """Rank 1 fails at step 3: killed (SIGKILL) or hung (stops answering)."""
    mode = None

    def reducer(self, template):     # the CPU step's all-reduce starts here
        if self.rank == 1 and self.step == 3:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        return super().reducer(template)


def fault(mode, corpus, out):
    _Fault.mode = mode
    dist = _Fault(COMM, timeout=float(os.environ.get("MX_TEST_TIMEOUT", "5")),
                  blocking=os.environ.get("MX_TEST_BLOCKING", "1") == "1")
    cfg = tiny(corpus, steps=10, checkpoint_every=2)
    train(cfg, out, dist=dist, **QUIET)
    print("UNREACHABLE: the job went on after the fault", flush=True)


if __name__ == "__main__":
    mode, corpus, out = sys.argv[1:4]
    if mode in ("api", "gpu"):
        globals()[mode](corpus, out)
    else:
        fault(mode, corpus, out)
