"""Training quality of the two initialisations against mamba.py (docs/training_quality.md).

One *arm* is one training run, written as a JSON file:

* ``legacy`` / ``mamba``: ``mamba_ext.training.loop.train`` with ``init=`` that scheme;
* ``mambapy``: mamba.py's ``mambapy.mamba.Mamba`` (``pip install mambapy``; pure PyTorch,
  its own initialisation) inside the same byte-level language model as ours: embedding
  N(0, 0.02²), the Mamba layers, final RMSNorm, a head tied to the embedding plus a bias
  (zero at start), mean cross-entropy; trained with ``torch.optim.AdamW`` on the same
  batches (``ByteBatches``, a pure function of seed and step), the same learning-rate
  schedule (``lr_at``: warmup + cosine), betas, epsilon 1e-8, weight decay (on the same
  parameters as ``DEFAULT_NO_DECAY`` leaves decayed), and gradient clipping at 1.0.

Every arm reports ``final_loss`` (mean training loss of the last 50 steps, as ``train``)
and ``val_loss`` (mean over the same fixed held-out batches, ``ByteBatches.val_batches``).

    python -m mamba_ext.bench.init_compare corpus stdlib_corpus.bin
    python -m mamba_ext.bench.init_compare run --arm mamba --config default --data stdlib_corpus.bin \
        --out r/default-mamba.json
    python -m mamba_ext.bench.init_compare table r/*.json

``--config default`` is ``TrainConfig()`` (the default ``train`` run); ``--config 4x256`` is
the same with 4 layers, d_model 256, batch 8 x seq_len 512. ``--steps`` overrides the number
of steps (the schedule then targets that number, for every arm alike).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

CONFIGS = {
    "default": {},
    "4x256": {"n_layers": 4, "d_model": 256, "batch": 8, "seq_len": 512},
}
ARMS = ("legacy", "mamba", "mambapy")


def make_config(name: str, steps: int | None, data: str | None, threads: int | None,
                seed: int = 0):
    from ..training.loop import TrainConfig
    cfg = TrainConfig(**CONFIGS[name], data=data, threads=threads, checkpoint_every=0, seed=seed)
    if steps is not None:
        cfg.steps = int(steps)
    return cfg.validated()


def run_ours(cfg, init: str) -> dict:
    from ..training.loop import train
    cfg.init = init
    with tempfile.TemporaryDirectory() as out:
        s = train(cfg, out, progress=None, log=lambda m: None)
    return {"final_loss": s["final_loss"], "val_loss": s["val_loss"], "losses": s["losses"],
            "wall_s": s["wall_s"]}


def run_mambapy(cfg, device: str) -> dict:
    import torch
    import torch.nn.functional as F
    from mambapy.mamba import Mamba, MambaConfig, RMSNorm

    from ..training.data import VOCAB_SIZE, ByteBatches, load_corpus
    from ..training.loop import lr_at

    torch.manual_seed(cfg.seed)
    dev = torch.device(device)

    class ByteLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB_SIZE, cfg.d_model)
            torch.nn.init.normal_(self.embedding.weight, std=0.02)
            self.mamba = Mamba(MambaConfig(d_model=cfg.d_model, n_layers=cfg.n_layers,
                                           d_state=cfg.d_state, expand_factor=cfg.expand,
                                           d_conv=cfg.d_conv, rms_norm_eps=cfg.eps))
            self.final_norm = RMSNorm(cfg.d_model, cfg.eps)
            self.lm_head_bias = torch.nn.Parameter(torch.zeros(VOCAB_SIZE))

        def forward(self, tokens):
            h = self.final_norm(self.mamba(self.embedding(tokens)))
            return h @ self.embedding.weight.T + self.lm_head_bias

    model = ByteLM().to(dev)
    # weight decay on the same parameters as ours: the embedding and the projection and conv
    # weights; not on A_log, D, biases, norm gains (mamba_ext.constants.DEFAULT_NO_DECAY)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        short = name.rsplit(".", 1)[-1]
        keep = short in ("A_log", "D", "bias", "lm_head_bias") or "norm" in name
        (no_decay if keep else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8)
    batches = ByteBatches(load_corpus(cfg.data, cfg.max_bytes), cfg.seq_len, cfg.batch, cfg.seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        tok, tgt = (torch.from_numpy(a).to(dev) for a in batches.get(step))
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        loss = F.cross_entropy(model(tok).reshape(-1, VOCAB_SIZE), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    wall = time.perf_counter() - t0
    with torch.no_grad():
        vals = [float(F.cross_entropy(model(torch.from_numpy(t).to(dev)).reshape(-1, VOCAB_SIZE),
                                      torch.from_numpy(g).to(dev).reshape(-1)))
                for t, g in batches.val_batches()]
    return {"final_loss": float(np.mean(losses[-50:])), "val_loss": float(np.mean(vals)) if vals else None,
            "losses": losses, "wall_s": wall, "device": device}


def cmd_run(args) -> int:
    cfg = make_config(args.config, args.steps, args.data, args.threads, args.seed)
    if args.arm == "mambapy":
        res = run_mambapy(cfg, args.device)
    else:
        res = run_ours(cfg, args.arm)
    res.update(arm=args.arm, config=args.config, steps=cfg.steps, n_layers=cfg.n_layers,
               d_model=cfg.d_model, batch=cfg.batch, seq_len=cfg.seq_len, lr=cfg.lr,
               data=args.data or "stdlib", seed=cfg.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(f"{args.config} {args.arm} seed {cfg.seed}: final train loss {res['final_loss']:.4f}, held-out "
          f"{res['val_loss']:.4f} ({cfg.steps} steps, {res['wall_s']:.0f} s)")
    return 0


def _cell(r) -> str:
    """One arm's result as "train / held-out" (or "not run")."""
    return f"{r['final_loss']:.4f} / {r['val_loss']:.4f}" if r else "not run"


def table(results: list[dict]) -> str:
    """Markdown: one row per config, final train / held-out loss of each arm (results of
    several seeds: one row per config and seed, then their means)."""
    seeds = sorted({r.get("seed", 0) for r in results})
    if len(seeds) > 1:
        return seed_table(results, seeds)
    by = {(r["config"], r["arm"]): r for r in results}
    names = {"legacy": "mamba_ext, legacy init", "mamba": "mamba_ext, mamba init (default)",
             "mambapy": "mamba.py"}
    lines = ["| run | steps | " + " | ".join(f"{names[a]}: train / held-out" for a in ARMS) + " |",
             "|---|---|" + "---|" * len(ARMS)]
    for c in CONFIGS:
        row = [by.get((c, a)) for a in ARMS]
        if not any(row):
            continue
        steps = next(r["steps"] for r in row if r)
        cells = [_cell(r) for r in row]
        lines.append(f"| {c} | {steps} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_table(results: list[dict], seeds: list[int]) -> str:
    """Markdown: per config, one row per seed and a row of means, train / held-out of each
    arm; the last column: mamba init minus mamba.py on held-out data (negative = ours lower)."""
    by = {(r["config"], r["arm"], r.get("seed", 0)): r for r in results}
    arms = [a for a in ARMS if any(k[1] == a for k in by)]
    lines = ["| run | seed | steps | " + " | ".join(f"{a}: train / held-out" for a in arms)
             + " | held-out, mamba - mambapy |", "|---|---|---|" + "---|" * (len(arms) + 1)]
    for c in CONFIGS:
        rows = []
        for sd in seeds:
            row = [by.get((c, a, sd)) for a in arms]
            if not any(row):
                continue
            rows.append(row)
            steps = next(r["steps"] for r in row if r)
            cells = [_cell(r) for r in row]
            m, p = by.get((c, "mamba", sd)), by.get((c, "mambapy", sd))
            diff = f"{m['val_loss'] - p['val_loss']:+.4f}" if m and p else "-"
            lines.append(f"| {c} | {sd} | {steps} | " + " | ".join(cells) + f" | {diff} |")
        if len(rows) > 1:
            cells = []
            for j in range(len(arms)):
                got = [row[j] for row in rows if row[j]]
                cells.append(f"{np.mean([r['final_loss'] for r in got]):.4f} / "
                             f"{np.mean([r['val_loss'] for r in got]):.4f}"
                             + (f" (of {len(got)})" if len(got) < len(rows) else "")
                             if got else "-")
            pairs = [(by.get((c, "mamba", sd)), by.get((c, "mambapy", sd))) for sd in seeds]
            d = [m["val_loss"] - p["val_loss"] for m, p in pairs if m and p]
            lines.append(f"| {c} | mean of {len(rows)} | | " + " | ".join(cells)
                         + (f" | {np.mean(d):+.4f} |" if d else " | - |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mamba_ext.bench.init_compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one training run -> JSON")
    r.add_argument("--arm", choices=ARMS, required=True)
    r.add_argument("--config", choices=sorted(CONFIGS), default="default")
    r.add_argument("--steps", type=int, default=None, help="default: TrainConfig().steps (1500)")
    r.add_argument("--data", default=None, help="corpus file (default: the stdlib sources)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads of mamba_ext")
    r.add_argument("--device", default="cpu", help="torch device of the mambapy arm")
    r.add_argument("--seed", type=int, default=0, help="initialisation and batch order "
                   "(the same batches for every arm of one seed)")
    r.add_argument("--out", required=True, help="JSON file to write")
    t = sub.add_parser("table", help="Markdown table of JSON results")
    t.add_argument("files", nargs="+")
    c = sub.add_parser("corpus", help="write the default corpus (this Python's stdlib sources, "
                                      "as train reads them) to a file, to run every arm on the same bytes")
    c.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "corpus":
        from ..training.data import DEFAULT_MAX_BYTES, stdlib_corpus
        with open(args.out, "wb") as f:
            f.write(stdlib_corpus(DEFAULT_MAX_BYTES))
        return 0
    if args.cmd == "run":
        return cmd_run(args)
    results = []
    for p in args.files:
        with open(p) as f:
            results.append(json.load(f))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
