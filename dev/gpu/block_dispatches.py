"""Every dispatch of a block's forward + backward in order, each timed alone (dev/README.md):
index, kernel, workgroup grid, GPU us (median of 3 passes of that dispatch alone, after a
warm-up), and the pass of all of them for scale. Shows which of the 13 products (same
kernel name) takes what: the grid says which (x: N / BN, y: M / BM, z: K slices).

    MAMBA_EXT_GPU_BACKEND=dawn MAMBA_EXT_GPU_CHECKS=none python3 dev/gpu/block_dispatches.py d --amp
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("size", nargs="?", default="d")
    ap.add_argument("--amp", action="store_true")
    a = ap.parse_args(argv)
    from mamba_ext._validate import BLOCK_PARAM_NAMES, BlockDims
    from mamba_ext.bench.gpu import SIZES, _time_ops, init_params
    from mamba_ext.constants import DEFAULT_EPS
    from mamba_ext.gpu import scan
    from mamba_ext.gpu.block import BlockPlan
    from mamba_ext.gpu.device import gpu
    Dm, D, N, K, R, B, L = SIZES[a.size]
    g = gpu()
    plan = BlockPlan(BlockDims(Dm=Dm, D=D, N=N, K=K, R=R), B, L, DEFAULT_EPS, "zoh",
                     scan.layout_key(), f16=a.amp)
    params = init_params(Dm, D, N, K, R)
    plan.upload_params({k: params[k] for k in BLOCK_PARAM_NAMES})
    rng = np.random.default_rng(1)
    g.write(plan.x, rng.standard_normal((B, L, Dm)).astype(np.float32))
    g.write(plan.dout, rng.standard_normal((B, L, Dm)).astype(np.float32))
    ops = plan.fwd + plan.bwd
    whole, _ = _time_ops(g, ops, [plan.gr], 7, warmup_s=0.5)
    print(f"block {a.size}{' AMP' if a.amp else ''}: {len(ops)} dispatches, pass {whole:.3f} ms",
          flush=True)
    tot = 0.0
    for i, op in enumerate(ops):
        t, w = _time_ops(g, [op], [], 3, warmup=2)
        t = t if t is not None else w
        tot += t
        print(f"  {i:3d} {op.name:32s} {str(op.grid):18s} {1e3 * t:9.1f} us")
    print(f"  each alone, summed: {tot:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
