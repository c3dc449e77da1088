"""The conv's backward (kernels/conv1d.wgsl, conv1d_backward) taken apart at block d (or SIZE), mixed
precision: the dispatch alone (median GPU us of 7 passes of REPS copies) for the kernel as it
is and for diagnostic variants, each with one part of its work removed (wrong results, timing
only): which part its 300 us go to; and candidates (same results: their dx and gradients
against the first variant's are printed). A variant is a text substitution of the current kernel,
written into kernels/ on the device's copy of the tree and removed after.

    MAMBA_EXT_GPU_BACKEND=dawn MAMBA_EXT_GPU_CHECKS=none python3 dev/gpu/conv_apart.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPS = 5
# name -> [(text of conv1d.wgsl, its replacement)]; a binding whose use is cut keeps a use
# that never runs (the pipeline's automatic layout would drop it)
VARIANTS = {
    "base": [],
    # the weight-gradient sums (dwConv per tap) not accumulated
    "nodw": [("if (k <= t) { acc[k] += dc[j] * xs_b[xb + (q0 + j + K - 1u - k) * 32u + lx]; }",
              "")],
    # du not read (dconv = SiLU'(conv))
    "nodu": [("v.x = b_du[r * p.D + d];", "v.x = 1.0; if (p.M == 0xffffffffu) { v.x = b_du[0]; }"),
             ("if (two) { v.y = b_du[r * p.D + d + 1u]; }", "if (two) { v.y = 1.0; }")],
    # no SiLU derivative (dconv = du * conv)
    "nodsilu": [("v.x = dc[i].x * dsilu(s.x);", "v.x = dc[i].x * s.x;"),
                ("if (two) { v.y = dc[i].y * dsilu(s.y); }", "if (two) { v.y = dc[i].y * s.y; }")],
    # the tile's xc rows not loaded (their index staged instead)
    "nostage": [("nxs[j] = xc_words(i32(r0 + i / 32u) - i32(K - 1u), c0 + 2u * (i % 32u));",
                 "nxs[j] = bitcast<vec2<u32>>(vec2<f32>(f32(i))); "
                 "if (p.M == 0xffffffffu) { nxs[j] = xc_words(0, 0u); }")],
    # dxc not stored (its column sums still taken)
    "nostore": [("b_dY[(r * p.y_rs + d) / 2u] = f16_pair(s.x, s.y);",
                 "if (p.M == 0xffffffffu) { b_dY[0] = 0u; }")],
}


def main(names: list[str], size: str = "d", f16: bool = True) -> int:
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    src = (kernels / "conv1d.wgsl").read_text()
    written = []
    for name in names:
        text = src
        for old, new in VARIANTS[name]:
            if old not in text:
                raise SystemExit(f"conv_apart: variant {name}: {old!r} is not in conv1d.wgsl")
            text = text.replace(old, new)
        written.append(kernels / f"conv1d_{name}.wgsl")
        written[-1].write_text(text)
    try:
        return _run(names, size, f16)
    finally:
        for f in written:
            f.unlink()


def _run(names: list[str], size: str, f16: bool) -> int:
    from mamba_ext._validate import BLOCK_PARAM_NAMES, BlockDims
    from mamba_ext.bench.gpu import SIZES, _time_ops, init_params
    from mamba_ext.constants import DEFAULT_EPS
    from mamba_ext.gpu import scan
    from mamba_ext.gpu.block import BlockPlan
    from mamba_ext.gpu.device import gpu
    g = gpu()
    Dm, D, N, K, R, B, L = SIZES[size]
    params = init_params(Dm, D, N, K, R)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, Dm)).astype(np.float32)
    dout = rng.standard_normal((B, L, Dm)).astype(np.float32)
    current = {"file": "conv1d"}
    recorded = g.op

    def op(file, entry, *args, **kw):     # conv1d_backward from the variant under test
        use = current["file"] if (file, entry) == ("conv1d", "conv1d_backward") else file
        return recorded(use, entry, *args, **kw)
    g.op = op
    first = None
    for rnd in range(2):
        for name in names:
            current["file"] = f"conv1d_{name}"
            plan = BlockPlan(BlockDims(Dm=Dm, D=D, N=N, K=K, R=R), B, L, DEFAULT_EPS, "zoh",
                             scan.layout_key(), f16=f16)
            plan.upload_params({k: params[k] for k in BLOCK_PARAM_NAMES})
            g.write(plan.x, x)
            g.write(plan.dout, dout)
            ops = plan.fwd + plan.bwd
            g.submit(ops, [plan.gr])
            g.sync()
            got = np.concatenate([g.read(plan.dx, x.size), g.read(plan.gr, plan.n)])
            first = got if first is None else first
            err = np.abs(got - first).max() / np.abs(first).max()
            conv = [o for o in ops if o.name == "conv1d_backward"]
            ms, _ = _time_ops(g, conv * REPS, [], 7, warmup_s=0.3)
            print(f"round {rnd + 1} {name:8s} conv1d_backward {ms / REPS * 1e3:7.1f} us "
                  f"(grid {conv[0].grid}); dx and gradients against {names[0]}'s: {err:.1e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(list(VARIANTS) if not a or a[0] == "all" else a[0].split(","), *a[1:2],
                  f16="f32" not in a[2:]))
