"""Where a training step's GPU time goes (dev/README.md): the AMP step of a model of
mamba_ext.bench.gpu.TRAIN_STEPS as ResidentTrainer submits it (the f16 weight copies, the
model's forward, cross-entropy and backward, AdamW, the loss scale), timed in one pass; then
each part (the blocks' forward, their backward, the rest, the rest split into AdamW with the
AMP packs and roundings and everything else) as one pass of its dispatches, after half a
second of such passes: what each part costs inside a step; then each dispatch alone in a
pass of its own (timestamps; median of 3 after a warm-up), summed by kernel name and by part.

    MAMBA_EXT_GPU_BACKEND=dawn MAMBA_EXT_GPU_CHECKS=none python3 dev/gpu/step_profile.py 24x768 [--parts]

``--parts``: the step and its parts only (no dispatch alone).
"""
from __future__ import annotations

import sys

import numpy as np


def main(name: str, parts_only: bool = False) -> int:
    from mamba_ext.amp import DynamicLossScaler
    from mamba_ext.bench.gpu import TRAIN_STEPS, _time_ops
    from mamba_ext.gpu.device import gpu
    from mamba_ext.gpu.trainer import ResidentTrainer
    from mamba_ext.model import init_model_params
    V, Dm, nl, B, L = TRAIN_STEPS[name]
    g = gpu()
    tr = ResidentTrainer(init_model_params(V, Dm, nl, seed=0), lr=1e-4, scaler=DynamicLossScaler())
    tok = np.random.default_rng(0).integers(0, V, (B, L + 1))
    x, y = tok[:, :-1], tok[:, 1:]
    for _ in range(3):
        tr.step(x, y)
    plan, ops = tr._prepare(x, y)
    ops = ops + tr._adamw.ops + ([tr._amp.update_op] if tr._amp is not None else [])
    whole, wall = _time_ops(g, ops, plan.clears, 5)
    print(f"{name} AMP step: {len(ops)} dispatches, one pass {whole:.3f} ms GPU ({wall:.3f} ms wall)",
          flush=True)
    # which part each dispatch belongs to: the blocks' forward ops; their backward ops,
    # from the end of the head's backward to the end of the first layer's (plan.segments,
    # counted in plan.train_ops(), which `ops` holds from index `at`)
    fwd = {id(op) for lay in plan.layers for op in lay.forward_ops()}
    at = ops.index(plan.train_ops()[0])
    bwd = range(at + plan.segments[0][0], at + plan.segments[-1][0])
    # each part's dispatches as one pass of their own (in the step's order), after half a
    # second of such passes: what the part costs inside a step, unlike each dispatch alone
    which = ["blocks forward" if id(op) in fwd else "blocks backward" if i in bwd else "the rest"
             for i, op in enumerate(ops)]
    parts = {"blocks forward": [], "blocks backward": [], "the rest": []}
    for op, k in zip(ops, which):
        parts[k].append(op)
    for k, v in parts.items():
        ms, _ = _time_ops(g, v, [], 5, warmup_s=0.5)
        print(f"  {k} as one pass: {len(v)} dispatches, {ms:.3f} ms GPU", flush=True)
    rest = [op for op in parts["the rest"] if not op.name.startswith(("adamw", "amp_"))]
    opt = [op for op in parts["the rest"] if op.name.startswith(("adamw", "amp_"))]
    for k, v in (("the rest without AdamW and AMP", rest), ("AdamW and AMP", opt)):
        ms, _ = _time_ops(g, v, [], 5, warmup_s=0.5)
        print(f"  {k} as one pass: {len(v)} dispatches ({', '.join(sorted({o.name for o in v}))[:200]}), "
              f"{ms:.3f} ms GPU", flush=True)
    if parts_only:
        return 0
    per, part = {}, dict.fromkeys(parts, 0.0)
    for i, op in enumerate(ops):
        t, w = _time_ops(g, [op], [], 3, warmup=1)
        t = t if t is not None else w
        per.setdefault(op.name, []).append(t)
        part[which[i]] += t
    total = sum(sum(v) for v in per.values())
    print(f"each dispatch alone, summed: {total:.3f} ms; by part: "
          + ", ".join(f"{k} {v:.3f}" for k, v in part.items()))
    for tot, cnt, k in sorted(((sum(v), len(v), k) for k, v in per.items()), reverse=True):
        print(f"  {k:34s} x{cnt:4d} {tot:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(next((a for a in sys.argv[1:] if not a.startswith("-")), "24x768"),
                  "--parts" in sys.argv[1:]))
