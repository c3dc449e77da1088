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

from ..recurrent import generate
from ..training.loop import CHECKPOINT_NAME, load_training_checkpoint
from ._common import parser


MAX_TOKENS = 10 ** 7


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
    if not 0 <= args.tokens <= MAX_TOKENS:
        print(f"error: --tokens must be in [0, {MAX_TOKENS}]", file=sys.stderr)
        return 2
    if not (0 <= args.temperature < float("inf")):
        print("error: --temperature must be a finite number >= 0", file=sys.stderr)
        return 2
    if args.seed < 0:
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2
    try:
        ck = load_training_checkpoint(path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # the model reads bytes: a prompt that is not valid UTF-8 (undecodable bytes of the
    # command line, kept by Python as surrogate escapes) is fed as the bytes it was
    prompt = args.prompt.encode("utf-8", errors="surrogateescape") or b"\n"
    ids = np.frombuffer(prompt, np.uint8).astype(np.int64)[None]
    out = generate(ck["params"], ids, args.tokens, eps=ck["config"].eps, discretization="zoh",
                   temperature=args.temperature, rng=np.random.default_rng(args.seed))
    text = bytes(out[0].astype(np.uint8))
    sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
