"""``python -m mamba_ext train``: train a byte-level Mamba-1 language model.

With no arguments: the default model on the Python standard library's own
.py sources, in a few minutes on a laptop CPU; prints a progress line (step,
loss, tokens/s, ETA), tokens/s at the end, writes checkpoints and a loss-curve
PNG into ``--out`` (default ``runs/<date-time>``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from . import distributed
from ..training.loop import CHECKPOINT_NAME, TrainConfig, train
from ._common import parser


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = parser("train", __doc__)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on this file's bytes (None: the Python stdlib's .py sources)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width dModel")
    p.add_argument("--n-layers", type=int, default=d.n_layers, help="number of Mamba-1 blocks")
    p.add_argument("--d-state", type=int, default=d.d_state, help="SSM state size dState")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="training window length")
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step")
    p.add_argument("--steps", type=int, default=d.steps, help="total steps (also when resuming)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup + cosine)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and of the batches")
    p.add_argument("--init", choices=("mamba", "legacy"), default=d.init,
                   help="weight initialisation: 'mamba' (the reference implementations' rules: "
                        "delta log-uniform in [1e-3, 1e-1], out_proj scaled by 1/sqrt(n_layers)) or "
                        "'legacy' (mamba_ext <= 0.2); docs/api.md")
    p.add_argument("--init-from", default=None, metavar="PATH",
                   help="fine-tune a Hugging Face Mamba folder (config.json, safetensors, "
                        "tokenizer.json): its sizes, weights and tokenizer; --data is then UTF-8 text; "
                        "the run also writes DIR/hf/, which transformers loads")
    p.add_argument("--amp", action="store_true",
                   help="fp16 mixed precision (fp16 weights/grads, fp32 master, dynamic loss scale)")
    p.add_argument("--carry-state", action="store_true",
                   help="train on contiguous windows, each step starting from the scan and conv "
                        "state the previous one ended in (truncated BPTT; docs/cli.md)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing: recompute block caches in backward (less memory)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                   help="write the checkpoint every N steps (0: only at the end)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (None: runs/<date-time>, or the folder of --resume)")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a checkpoint file or run folder (its config is used; "
                        "only --steps, the new total, and --threads apply)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the model trains")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the kernels (None: OpenMP's default)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    distributed.add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    resume = args.resume
    if resume is not None and os.path.isdir(resume):
        resume = os.path.join(resume, CHECKPOINT_NAME)
    if resume is not None and not os.path.isfile(resume):
        print(f"error: --resume: no checkpoint at {resume}", file=sys.stderr)
        return 2
    if args.init_from is not None and resume is not None:
        print("error: --init-from and --resume cannot be combined (a resumed run keeps its config)",
              file=sys.stderr)
        return 2
    if args.init_from is not None and not os.path.isdir(args.init_from):
        print(f"error: --init-from: {args.init_from} is not a folder (expected a Hugging Face "
              f"save_pretrained folder)", file=sys.stderr)
        return 2
    out = args.out or (os.path.dirname(os.path.abspath(resume)) if resume
                       else os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    log = lambda s: print(s, file=sys.stderr)
    try:
        dist = distributed.from_args(args, log)
    except (ValueError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist is not None and not dist.is_root:      # one voice: rank 0 logs and shows progress
        log, args.quiet = (lambda s: None), True
    # paths stored in the checkpoint's config are absolute: --resume from another folder
    # finds them again
    absolute = lambda p: None if p is None else os.path.abspath(p)
    cfg = TrainConfig(data=absolute(args.data), d_model=args.d_model, n_layers=args.n_layers,
                      d_state=args.d_state, seq_len=args.seq_len, batch=args.batch,
                      steps=args.steps, lr=args.lr, seed=args.seed, amp=args.amp,
                      checkpointing=args.checkpointing, checkpoint_every=args.checkpoint_every,
                      device=args.device, threads=args.threads, init=args.init,
                      init_from=absolute(args.init_from), carry_state=args.carry_state)
    try:
        cfg.validated()
    except (TypeError, ValueError) as e:     # name the option, not the config field
        message = re.sub(r"config\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))
        print(f"error: {message}", file=sys.stderr)
        return 2
    try:
        train(cfg, out, resume=resume, progress=None if args.quiet else sys.stderr, log=log,
              dist=dist)
    except (ValueError, TypeError, RuntimeError, OSError, MemoryError) as e:
        message = f"error: {' '.join(str(e).split())}"
        if dist is not None:       # end every rank now, not when the others time out
            dist.abort(message, 1)
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
