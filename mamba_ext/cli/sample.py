"""``python -m mamba_ext sample``: generate text from a training checkpoint or a Hugging Face folder.

``--checkpoint``: a run of ``train`` (bytes; or the tokenizer of the checkpoint it was
fine-tuned from with ``--init-from``). ``--hf PATH``: a Hugging Face Mamba folder
(config.json, safetensors, tokenizer.json): the prompt is encoded and the output decoded
with the folder's own tokenizer (``tokenizers`` package).

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
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH",
                     help="a checkpoint file (or a run folder holding checkpoint.safetensors)")
    src.add_argument("--hf", metavar="PATH",
                     help="a Hugging Face Mamba folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", default="def ", help="text to continue (UTF-8)")
    p.add_argument("--tokens", type=int, default=300, help="number of tokens (bytes) to generate")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.tokens <= MAX_TOKENS:
        print(f"error: --tokens must be in [0, {MAX_TOKENS}]", file=sys.stderr)
        return 2
    if not (0 <= args.temperature < float("inf")):
        print("error: --temperature must be a finite number >= 0", file=sys.stderr)
        return 2
    if args.seed < 0:
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2
    tokenizer = None
    try:
        if args.hf is not None:
            from ..io.hf import load_hf, load_tokenizer
            params, cfg = load_hf(args.hf)
            eps, disc = cfg["eps"], cfg["discretization"]
            tokenizer = load_tokenizer(args.hf)
        else:
            path = args.checkpoint
            if os.path.isdir(path):
                path = os.path.join(path, CHECKPOINT_NAME)
            ck = load_training_checkpoint(path)
            params, eps, disc = ck["params"], ck["config"].eps, ck["config"].discretization
            if ck["config"].init_from is not None:       # fine-tuned: that checkpoint's tokenizer
                from ..io.hf import load_tokenizer
                tokenizer = load_tokenizer(ck["config"].init_from)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    if tokenizer is not None:
        ids = np.asarray(tokenizer.encode(args.prompt).ids, np.int64)[None]
        if ids.size == 0:
            print("error: --prompt: the tokenizer makes no token of it", file=sys.stderr)
            return 2
        out = generate(params, ids, args.tokens, eps=eps, discretization=disc,
                       temperature=args.temperature, rng=rng)
        text = tokenizer.decode([int(t) for t in np.concatenate([ids[0], out[0]])])
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return 0
    # the model reads bytes: a prompt that is not valid UTF-8 (undecodable bytes of the
    # command line, kept by Python as surrogate escapes) is fed as the bytes it was
    prompt = args.prompt.encode("utf-8", errors="surrogateescape") or b"\n"
    ids = np.frombuffer(prompt, np.uint8).astype(np.int64)[None]
    out = generate(params, ids, args.tokens, eps=eps, discretization=disc,
                   temperature=args.temperature, rng=rng)
    text = bytes(out[0].astype(np.uint8))
    sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    return 0

if __name__ == "__main__":
    sys.exit(main())
