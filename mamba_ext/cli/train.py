"""``python -m mamba_ext train``: train a byte-level Mamba-1 language model.

With no arguments: the default model on the Python standard library's own
.py sources, in a few minutes on a laptop CPU; prints a progress line (step,
loss, tokens/s, ETA), tokens/s at the end, writes checkpoints and a loss-curve
PNG into ``--out`` (default ``runs/<date-time>``).
"""
import argparse
import os
import sys
import time

from mamba_ext.training import distributed
from mamba_ext.training.loop import CHECKPOINT_NAME, TrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m mamba_ext train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on this file's bytes (default: the Python stdlib's .py sources)")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-layers", type=int, default=d.n_layers)
    p.add_argument("--d-state", type=int, default=d.d_state)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--steps", type=int, default=d.steps, help="total steps (also when resuming)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup + cosine)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--amp", action="store_true",
                   help="fp16 mixed precision (fp16 weights/grads, fp32 master, dynamic loss scale)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing: recompute block caches in backward (less memory)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default runs/<date-time>)")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a checkpoint file or run folder (its config is used; "
                        "only --steps, the new total, and --threads apply)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the kernels (default: OpenMP's default)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    distributed.add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None and args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    for name in ("d_model", "n_layers", "d_state", "seq_len", "batch", "steps"):
        if getattr(args, name) < (0 if name in ("n_layers", "steps") else 1):
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    resume = args.resume
    if resume is not None and os.path.isdir(resume):
        resume = os.path.join(resume, CHECKPOINT_NAME)
    if resume is not None and not os.path.isfile(resume):
        print(f"error: --resume: no checkpoint at {resume}", file=sys.stderr)
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
    cfg = TrainConfig(data=args.data, d_model=args.d_model, n_layers=args.n_layers,
                      d_state=args.d_state, seq_len=args.seq_len, batch=args.batch,
                      steps=args.steps, lr=args.lr, seed=args.seed, amp=args.amp,
                      checkpointing=args.checkpointing, checkpoint_every=args.checkpoint_every,
                      device=args.device, threads=args.threads)
    try:
        train(cfg, out, resume=resume, progress=None if args.quiet else sys.stderr, log=log,
              dist=dist)
    except (ValueError, RuntimeError, OSError) as e:
        if dist is not None:       # end every rank now, not when the others time out
            dist.abort(f"error: {e}", 1)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
