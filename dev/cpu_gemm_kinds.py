"""Each product of a layer (forward, dX, dW) on SciPy's BLAS and on mamba_ext's AVX-512
sgemm (dev/README.md): what `mamba_ext.cpu.linear.set_gemm("auto")` should pick on this CPU.

    python dev/cpu_gemm_kinds.py [--rows 1024,4096] [--shapes 256x1024,512x256] [--rounds 15]

A shape is ICxOC (a linear layer x (M, IC) -> (M, OC)); the default shapes are the 4 x 256
model's and size c's. Each product is timed alone through mamba_ext.cpu.steps on the core's
threads, the kinds interleaved over --rounds rounds (medians); GFLOP/s per kind, "auto"
(this CPU's choice) last. Run it on an idle machine: another job's load shows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mamba_ext.cpu import linear, steps

DEFAULT_SHAPES = "256x1024,512x48,16x512,512x256,256x256,768x3072,1536x80,48x1536,1536x768"


def rates(M: int, IC: int, OC: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    """kind -> GFLOP/s of (forward, dX, dW) of x (M, IC) @ W (OC, IC)^T: each product timed
    once per kind per round, the kinds interleaved round by round (the machine's drift
    then falls on all of them alike), medians over the rounds."""
    rng = np.random.default_rng(M + IC + OC)
    x = rng.standard_normal((M, IC)).astype(np.float32)
    w = (rng.standard_normal((OC, IC)) * 0.01).astype(np.float32)
    dout = rng.standard_normal((M, OC)).astype(np.float32)
    out, dx, dw = np.empty((M, OC), np.float32), np.zeros_like(x), np.zeros_like(w)
    calls = (lambda: steps.linear_forward(out, x, w, None),
             lambda: steps.linear_backward(dx, None, None, dout, x, w),
             lambda: steps.linear_backward(None, dw, None, dout, x, w))
    prev = linear.set_gemm("auto")
    kinds = []
    for kind in ("blas", "avx512", "auto"):
        try:
            linear.set_gemm(kind)
            kinds.append(kind)
        except ValueError:              # no AVX-512F on this CPU
            pass
    times = {k: [[], [], []] for k in kinds}
    try:
        for _ in range(rounds):
            for kind in kinds:
                linear.set_gemm(kind)
                for i, call in enumerate(calls):
                    call()                      # warm: the kind's buffers, the operands
                    t = time.perf_counter()
                    call()
                    times[kind][i].append(time.perf_counter() - t)
    finally:
        linear.set_gemm(prev)
    flop = 2.0 * M * IC * OC
    return {k: tuple(flop / statistics.median(ts) / 1e9 for ts in v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1024,4096", help="M values, comma-separated")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="ICxOC, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(f"BLAS: {linear.blas_config() or 'not OpenBLAS'} (kernels {linear.blas_corename()!r}); "
          f"auto: products on {linear.gemm_kernel()}, weight gradients (IC >= 256) on "
          f"{linear.gemm_kernel(weight_gradient=True)}")
    print("GFLOP/s forward / dX / dW")
    for M in (int(m) for m in args.rows.split(",")):
        for shape in args.shapes.split(","):
            IC, OC = (int(v) for v in shape.lower().split("x"))
            got = rates(M, IC, OC, args.rounds)
            row = "   ".join(f"{k} {f:4.0f} {x:4.0f} {w:4.0f}" for k, (f, x, w) in got.items())
            print(f"M {M:6d} IC {IC:5d} OC {OC:5d}:   {row}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
