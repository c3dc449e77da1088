"""GEMM A/B on the device (dev/README.md): kernels/linear_f16.wgsl against variants of it
(dev/gpu/variants.py, written into kernels/ first: run this on the device's copy of the
tree only) on block d's in_proj and out_proj products, forward, dX and dW, two alternated
rounds; GPU ms per product (timestamps, median of 7 passes of 5), TFLOP/s, and the max error
against float64 over a slice of the result.

    MAMBA_EXT_GPU_BACKEND=dawn MAMBA_EXT_GPU_CHECKS=none \\
        python3 dev/gpu/gemm_ab.py linear_f16,linear_f16_direct,linear_f16@256x128x16x512

A variant ``file@BMxBNxBKxWGS`` runs with that workgroup tile first in linear_f16.TILES
(products whose sizes it does not divide take the unit tile), ``file%S`` with
linear_f16.SPLIT_TARGET = S (the weight gradients' split over K), ``file^`` with the
subgroups' grid of linear_f16.plan transposed (WN x WM: the other shape of a subgroup's
block); they combine (``file@...%S^``). The variant files are removed from kernels/ at the end.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

SHAPES = [("in_proj", 16384, 768, 3072), ("out_proj", 16384, 1536, 768)]   # (M, I, O)
REPS = 5            # products per timed pass


def _spec(v: str):
    """(file, tile or None, split target or None, grid transposed) of a variant name."""
    swap = v.endswith("^")
    v, _, split = v.removesuffix("^").partition("%")
    file, _, tile = v.partition("@")
    return (file, tuple(int(n) for n in tile.split("x")) if tile else None,
            int(split) if split else None, swap)


def main(variants: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from variants import VARIANTS
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    src = (kernels / "linear_f16.wgsl").read_text()
    written = []
    for name in {_spec(v)[0] for v in variants}:
        if name in VARIANTS:
            written.append(kernels / f"{name}.wgsl")
            written[-1].write_text(VARIANTS[name](src))
    try:
        return _run(variants)
    finally:
        for f in written:
            f.unlink()


def _run(variants: list[str]) -> int:
    from mamba_ext.bench.gpu import _time_ops
    from mamba_ext.gpu import linear_f16 as lf
    from mamba_ext.gpu.device import gpu
    g = gpu()
    print("adapter", g.info.get("device"), g.backend.NAME, g.checks, g.subgroup_size,
          lf.plan(g), flush=True)
    current = {"file": "linear_f16"}
    unit, split0, plan0 = lf.TILES, lf.SPLIT_TARGET, lf.plan
    recorded = g.op

    def swapped(g, tile=lf.UNIT_TILE):    # the grid WN x WM, where it fits
        p = plan0(g, tile)
        if p is None:
            return None
        cfg, wm, wn = p
        ok = (tile[0] // wn) % cfg["m"] == 0 and (tile[1] // wm) % cfg["n"] == 0
        return (cfg, wn, wm) if ok else p

    def op(file, entry, *args, **kw):     # every linear_f16 op from the variant under test
        return recorded(current["file"] if file == "linear_f16" else file, entry, *args, **kw)
    g.op = op
    rng = np.random.default_rng(0)
    for name, M, I, O in SHAPES:
        X = rng.standard_normal((M, I)).astype(np.float16)
        W = rng.standard_normal((O, I)).astype(np.float16)
        dY = rng.standard_normal((M, O)).astype(np.float16)
        x, w, dy = (lf.f16_buffer(g, a, n) for a, n in ((X, "x"), (W, "w"), (dY, "dy")))
        xt, wt = lf.f16_buffer(g, X.T.copy(), "xt"), lf.f16_buffer(g, W.T.copy(), "wt")
        y, dx, dw = g.buffer(M * O, "y"), g.buffer(M * I, "dx"), g.buffer(O * I, "dw")
        X64, W64, dY64 = (a.astype(np.float64) for a in (X, W, dY))
        cases = [("fwd", partial(lf.forward, g, y, x, wt, M, I, O), y, (M, O), X64[:2048] @ W64.T),
                 ("dX", partial(lf.dinput, g, dx, dy, w, M, I, O, accumulate=False), dx, (M, I),
                  dY64[:2048] @ W64),
                 ("dW", partial(lf.dweight, g, dw, xt, dy, M, I, O, accumulate=False), dw, (O, I),
                  dY64.T @ X64)]
        flop = 2.0 * M * I * O
        for _ in range(2):
            for v in variants:
                current["file"], tile, split, swap = _spec(v)
                lf.plan = swapped if swap else plan0
                lf.TILES = ((tile,) if tile else ()) + unit
                lf.SPLIT_TARGET = split or split0
                line = []
                for kind, make, out, shape, want in cases:
                    try:
                        ops = make()
                        gpu_ms, _ = _time_ops(g, ops * REPS, (), 7, warmup_s=0.5)
                        g.submit(ops, ())
                        g.sync()
                        got = g.read(out, shape[0] * shape[1]).reshape(shape)[:want.shape[0]]
                        err = np.abs(got - want).max() / np.abs(want).max()
                        ms = gpu_ms / REPS
                        line.append(f"{kind} {ms * 1e3:7.1f} us {flop / ms / 1e9:6.1f} TF "
                                    f"err {err:.1e}")
                    except Exception as e:     # a variant that does not compile: say why
                        line.append(f"{kind} FAILED {type(e).__name__}: {str(e)[:300]}")
                print(f"{name:8s} {v:22s} " + " | ".join(line), flush=True)
        for b in (x, w, dy, xt, wt, y, dx, dw):
            b.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(",")))
