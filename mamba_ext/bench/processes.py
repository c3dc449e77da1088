"""``python -m mamba_ext.bench.processes``: P independent processes of a plain library call,
started together, each training the same model on its own batch: the host's own ceiling for
data-parallel CPU training (no communication), and a check that processes do not fight
over the cores (each uses ``--threads`` threads, its BLAS included).

Each process is a fresh interpreter (``multiprocessing``'s spawn) that imports mamba_ext
and calls it, nothing configured: it runs ``--warmup`` steps, waits for the others, then
times ``--steps`` training steps (model_loss_and_grads + AdamW). The table gives, per P,
the tokens/s of all processes together, of one process, the speed-up over P = 1 and the
weak-scaling efficiency (speed-up / P).

``--sync``: the processes wait for each other before every step (a barrier, no data
exchanged), as the ranks of a data-parallel job do at its all-reduce; a step is then timed
from one barrier to the next. Against the free-running processes this separates what lock
step costs on the host (all processes in the same phase at once, and each step as slow as
the slowest process) from what the communication of a real job adds.

Size letters: P processes, b batch per process, L seqLen.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _worker(model, batch, seq_len, threads, warmup, steps, barrier, queue, sync):
    import numpy as np

    from mamba_ext import AdamW, init_model_params, model_loss_and_grads
    layers, dm = model
    params = init_model_params(256, dm, layers, seed=0)
    opt = AdamW(params, lr=1e-3, n_threads=threads)
    tok = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1))
    x, y = tok[:, :-1], tok[:, 1:]

    def step():
        opt.step(model_loss_and_grads(x, y, params, n_threads=threads)[1])

    for _ in range(warmup):
        step()
    barrier.wait()
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        if sync:
            barrier.wait()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    queue.put(batch * seq_len / statistics.median(times))


def run_processes(P, model=(4, 256), batch=16, seq_len=256, threads=2, warmup=2, steps=6,
                  sync=False):
    """Tokens/s of each of P processes started together (a list of P floats); ``sync``:
    in lock step (a barrier after every step)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(P), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(model, batch, seq_len, threads, warmup, steps,
                                               barrier, queue, sync)) for _ in range(P)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark process exited with status {p.exitcode}")
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mamba_ext.bench.processes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="4x256", help="LAYERSxDMODEL (vocab 256, d_state 16)")
    ap.add_argument("--batch", type=int, default=16, help="b, per process")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="n_threads of each process")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("-P", "--processes", default="1,2,4,8", help="comma-separated counts")
    ap.add_argument("--sync", action="store_true",
                    help="lock step: the processes wait for each other after every step")
    args = ap.parse_args(argv)
    try:
        model = tuple(int(v) for v in args.model.lower().split("x"))
        counts = [int(v) for v in args.processes.split(",") if v]
    except ValueError:
        ap.error("--model LAYERSxDMODEL and -P N,N,... take integers")
    if len(model) != 2 or min(model) < 1 or not counts or min(counts) < 1:
        ap.error("--model needs two positive sizes and -P positive counts")
    if min(args.batch, args.seq_len, args.threads, args.steps) < 1 or args.warmup < 0:
        ap.error("--batch, --seq-len, --threads and --steps must be >= 1, --warmup >= 0")
    print(f"model {model[0]} x {model[1]}, b {args.batch} x L {args.seq_len} per process, "
          f"{args.threads} threads each, median of {args.steps} steps after {args.warmup}"
          + (", in lock step (a barrier after every step)" if args.sync else ""))
    print("| P | tokens/s, all | tokens/s, one process | speed-up | efficiency |")
    print("|---|---|---|---|---|")
    base = None
    for P in counts:
        rates = run_processes(P, model, args.batch, args.seq_len, args.threads, args.warmup,
                              args.steps, args.sync)
        total = sum(rates)
        base = base or (total / P if P == 1 else None)
        sp = f"{total / base:.2f}x" if base else "-"
        eff = f"{total / base / P:.0%}" if base else "-"
        print(f"| {P} | {total:,.0f} | {statistics.median(rates):,.0f} | {sp} | {eff} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
