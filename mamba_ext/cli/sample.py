"""``python -m mamba_ext sample``: generate bytes from a training checkpoint.

Each new byte re-runs the forward pass over the (cropped) growing context and
samples from softmax(logits / temperature) of the last position
(temperature 0: greedy).
"""
import argparse
import os
import sys

import numpy as np

from mamba_ext.checkpoint import load_checkpoint
from mamba_ext.model import model_forward
from mamba_ext.train import CHECKPOINT_NAME


def generate(params, prompt: bytes, n_tokens: int, temperature: float = 0.8, seed: int = 0,
             context: int = 256, eps: float = 1e-6) -> bytes:
    """``n_tokens`` bytes continuing ``prompt`` (at most ``context`` bytes of history)."""
    rng = np.random.default_rng(seed)
    seq = list(prompt) or [ord("\n")]
    out = []
    for _ in range(n_tokens):
        ctx = np.asarray(seq[-context:], dtype=np.int64)[None, :]
        logits = model_forward(ctx, params, eps=eps)[0, -1].astype(np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            p = np.exp(z - z.max())
            nxt = int(rng.choice(p.size, p=p / p.sum()))
        seq.append(nxt)
        out.append(nxt)
    return bytes(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mamba_ext sample", description=__doc__)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint file (or a run folder holding checkpoint.safetensors)")
    p.add_argument("--prompt", default="def ", help="text to continue (UTF-8)")
    p.add_argument("--tokens", type=int, default=300, help="number of bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=256, help="bytes of history fed to the model")
    args = p.parse_args(argv)
    path = args.checkpoint
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    if args.tokens < 0 or args.context < 1:
        print("error: --tokens must be >= 0 and --context >= 1", file=sys.stderr)
        return 2
    try:
        ck = load_checkpoint(path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    eps = float(ck["config"].get("eps", 1e-6))
    prompt = args.prompt.encode("utf-8")
    text = generate(ck["params"], prompt, args.tokens, args.temperature, args.seed,
                    args.context, eps)
    sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
