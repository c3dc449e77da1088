"""The GPU scan's and conv's layout constants (mamba_ext.gpu.scan: SCAN_CHUNK, SCAN_WG,
SCAN_TS_FORWARD, SCAN_TS_BACKWARD, SCAN_RB, SCAN_SUM_PARTS, SCAN_SUBGROUP_SUMS;
mamba_ext.gpu.conv1d: CONV_RPI_FORWARD, CONV_BACKWARD_TILES, CONV_BACKWARD_BLOCKS, CONV_TILES
(one value: the backward's tile)) swept at block d, mixed precision,
alternated over two rounds: the whole block's pass (GPU ms, median of 7 after 0.5 s of
passes), its scan dispatches and its conv dispatches in passes of their own, and the largest
difference of dx and the gradients from the first setting's (max |difference| / max |value|).
A setting is NAME=VALUE[,...] over those names without the prefix (e.g. TS_BACKWARD=8,RB=2,
RPI_FORWARD=8); "default" is the modules'.

    MAMBA_EXT_GPU_BACKEND=dawn MAMBA_EXT_GPU_CHECKS=none \\
        python3 dev/gpu/scan_sweep.py default "TS_FORWARD=4" "CHUNK=32" "RPI_FORWARD=8"
"""
from __future__ import annotations

import sys

import numpy as np


def main(settings: list[str]) -> int:
    from mamba_ext._validate import BLOCK_PARAM_NAMES, BlockDims
    from mamba_ext.bench.gpu import SIZES, _time_ops, init_params
    from mamba_ext.constants import DEFAULT_EPS
    from mamba_ext.gpu import conv1d, scan
    from mamba_ext.gpu.block import BlockPlan
    from mamba_ext.gpu.device import gpu
    g = gpu()
    Dm, D, N, K, R, B, L = SIZES["d"]
    dims = BlockDims(Dm=Dm, D=D, N=N, K=K, R=R)
    params = init_params(Dm, D, N, K, R)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, Dm)).astype(np.float32)
    dout = rng.standard_normal((B, L, Dm)).astype(np.float32)
    names = ("CHUNK", "WG", "TS_FORWARD", "TS_BACKWARD", "RB", "SUM_PARTS", "SUBGROUP_SUMS")
    home = {**{n: (scan, "SCAN_" + n) for n in names},
            **{n: (conv1d, "CONV_" + n)
               for n in ("RPI_FORWARD", "BACKWARD_TILES", "BACKWARD_BLOCKS", "TILES")}}
    default = {n: getattr(m, a) for n, (m, a) in home.items()}
    first = None
    for rnd in range(2):
        for setting in settings:
            vals = dict(default)
            if setting != "default":
                for kv in setting.split(","):
                    k, v = kv.split("=")
                    vals[k] = (int(v),) if k == "TILES" else int(v)
            for k, v in vals.items():
                setattr(*home[k], v)
            plan = BlockPlan(dims, B, L, DEFAULT_EPS, "zoh", scan.layout_key(), f16=True)
            plan.upload_params({k: params[k] for k in BLOCK_PARAM_NAMES})
            g.write(plan.x, x)
            g.write(plan.dout, dout)
            ops = plan.fwd + plan.bwd
            ms, _ = _time_ops(g, ops, [plan.gr], 7, warmup_s=0.5)
            sops = [op for op in ops if op.name.startswith("scan_")]
            sms, _ = _time_ops(g, sops, [], 7, warmup_s=0.2)
            cms, _ = _time_ops(g, [op for op in ops if op.name.startswith("conv1d_")], [], 7,
                               warmup_s=0.2)
            g.submit(ops, [plan.gr])
            g.sync()
            got = np.concatenate([g.read(plan.dx, x.size), g.read(plan.gr, plan.n)])
            if first is None:
                first = got
            err = np.abs(got - first).max() / np.abs(first).max()
            s = plan.layer.s
            print(f"round {rnd + 1} {setting:28s} pass {ms:7.3f} ms | scan {sms:6.3f} ms | "
                  f"conv {cms:6.3f} ms | "
                  f"chunk {s.chunk} wg {s.wg} ts {s.ts_f}/{s.ts_b} rb {s.rb} hs {s.hs} "
                  f"sub {s.sub} conv {vals['RPI_FORWARD']} "
                  f"{vals['TILES'][0]}x{vals['BACKWARD_TILES']}/{vals['BACKWARD_BLOCKS']} | "
                  f"vs first {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["default"]))
