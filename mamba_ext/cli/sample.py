"""``python -m mamba_ext sample``: generate bytes from a training checkpoint.

Each prompt goes through the chunked forward (the prefill), then every new byte through
the compiled recurrent step (scan state and conv tail per layer, all prompts as one
batch), so each byte costs the same whatever its position: generation is linear in the
length. Sampling has the Hugging Face ``generate`` meanings: --temperature 0 (or
--greedy) takes the argmax; otherwise the logits are divided by the temperature, then
--top-k keeps the k highest (0: off), then --top-p keeps the smallest most-probable set
whose probability exceeds p (1: off), and one byte is drawn from the softmax of what is
left. --stop STRING ends a sample right after it produced STRING (the stop string is
kept in the output, as Hugging Face keeps it); several --prompt and --stop may be given.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from ..recurrent import STOPPED, _check_sampling, generate
from ..training.loop import CHECKPOINT_NAME, load_training_checkpoint
from ._common import parser


MAX_TOKENS = 10 ** 7


def build_parser():
    p = parser("sample", __doc__)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint file (or a run folder holding checkpoint.safetensors)")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (UTF-8); repeat for several samples at once "
                        "(default: 'def ')")
    p.add_argument("--tokens", type=int, default=300, help="number of bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (= --temperature 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely bytes (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely bytes whose mass exceeds p (1: off)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end a sample once it produced STRING (kept in the output); repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG")
    p.add_argument("--weights-dtype", choices=["float32", "float16"], default="float32",
                   help="storage of the weights during generation (float16: half the memory "
                        "traffic, float32 accumulation)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the compiled step (None: all cores)")
    return p


def _bytes(text: str) -> bytes:
    # the model reads bytes: text that is not valid UTF-8 (undecodable bytes of the
    # command line, kept by Python as surrogate escapes) is fed as the bytes it was
    return text.encode("utf-8", errors="surrogateescape")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    path = args.checkpoint
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    if not 0 <= args.tokens <= MAX_TOKENS:
        print(f"error: --tokens must be in [0, {MAX_TOKENS}]", file=sys.stderr)
        return 2
    if not (0 <= args.temperature < float("inf")):
        print("error: --temperature must be a finite number >= 0", file=sys.stderr)
        return 2
    temperature = 0.0 if args.greedy else args.temperature
    try:
        _check_sampling(temperature, args.top_k, args.top_p)
    except (TypeError, ValueError) as e:
        print(f"error: --{str(e).replace('_', '-')}", file=sys.stderr)
        return 2
    if args.seed < 0:
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    stops = [_bytes(s) for s in (args.stop or [])]
    if any(not s for s in stops):
        print("error: --stop must not be empty", file=sys.stderr)
        return 2
    try:
        ck = load_training_checkpoint(path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    prompts = [_bytes(t) or b"\n" for t in (args.prompt or ["def "])]
    ids = [np.frombuffer(p, np.uint8).astype(np.int64) for p in prompts]
    try:
        out = generate(ck["params"], ids, args.tokens, eps=ck["config"].eps, discretization="zoh",
                       temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                       stop=[list(s) for s in stops] or None,
                       rng=np.random.default_rng(args.seed),
                       weights_dtype=None if args.weights_dtype == "float32" else "float16",
                       n_threads=args.threads)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b, prompt in enumerate(prompts):
        row = out[b]
        text = bytes(row[row != STOPPED].astype(np.uint8))
        sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
