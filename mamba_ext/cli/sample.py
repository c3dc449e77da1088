"""``python -m mamba_ext sample``: generate bytes from a training checkpoint.

The prompt and every new byte go through the recurrent ``mamba_ext.recurrent.step``
(scan state and conv tail per layer), so each byte costs the same whatever its
position: generation is linear in the length. Samples from
softmax(logits / temperature) (temperature 0: greedy).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from ..constants import DEFAULT_EPS
from ..io.checkpoint import load_checkpoint
from ..recurrent import generate
from ..training.loop import CHECKPOINT_NAME
from ._common import parser


def build_parser():
    p = parser("sample", __doc__)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint file (or a run folder holding checkpoint.safetensors)")
    p.add_argument("--prompt", default="def ", help="text to continue (UTF-8)")
    p.add_argument("--tokens", type=int, default=300, help="number of bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    path = args.checkpoint
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    if args.tokens < 0 or not (args.temperature >= 0):
        print("error: --tokens and --temperature must be >= 0", file=sys.stderr)
        return 2
    try:
        ck = load_checkpoint(path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    config = ck["config"]
    prompt = args.prompt.encode("utf-8") or b"\n"
    ids = np.frombuffer(prompt, np.uint8).astype(np.int64)[None]
    out = generate(ck["params"], ids, args.tokens, eps=float(config.get("eps", DEFAULT_EPS)),
                   discretization=config.get("discretization", "zoh"),
                   temperature=args.temperature, rng=np.random.default_rng(args.seed))
    text = bytes(out[0].astype(np.uint8))
    sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
