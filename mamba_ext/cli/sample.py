"""``python -m mamba_ext sample``: generate text from a training checkpoint or a Hugging Face folder.

``--checkpoint``: a run of ``train`` (bytes; or the tokenizer of the checkpoint it was
fine-tuned from with ``--init-from``). ``--hf PATH``: a Hugging Face Mamba folder
(config.json, safetensors, tokenizer.json): prompts and stop strings are encoded and the
output decoded with the folder's own tokenizer (``tokenizers`` package).

Each prompt goes through the chunked forward (the prefill), then every new token through
the recurrent step (all prompts as one batch; --device gpu: on the GPU), so each token
costs the same whatever its position. Sampling has the Hugging Face ``generate`` meanings: --temperature
0 (or --greedy) takes the argmax; otherwise the logits are divided by the temperature,
then --top-k keeps the k highest (0: off), then --top-p keeps the smallest most-probable
set whose probability exceeds p (1: off), and one token is drawn from the softmax of what
is left. --stop STRING ends a sample right after it produced STRING's tokens (kept, as in
Hugging Face); several --prompt and --stop may be given."""
from __future__ import annotations

import os
import sys

import numpy as np

from ..recurrent import STOPPED, check_sampling, generate
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
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (UTF-8); repeat for several samples at once "
                        "(default: 'def ')")
    p.add_argument("--tokens", type=int, default=300, help="number of tokens (bytes) to generate")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (= --temperature 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens whose mass exceeds p (1: off)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end a sample once it produced STRING (kept in the output); repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG")
    p.add_argument("--weights-dtype", choices=["float32", "float16"], default="float32",
                   help="storage of the weights during generation (float16: half the memory "
                        "traffic, float32 accumulation)")
    p.add_argument("--threads", type=int, default=None, help="threads of the compiled step (None: all cores)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where the tokens are generated (gpu: float32; prefill on the CPU)")
    return p


def _bytes(text: str) -> bytes:
    # the model reads bytes: text that is not valid UTF-8 (undecodable bytes of the
    # command line, kept by Python as surrogate escapes) is fed as the bytes it was
    return text.encode("utf-8", errors="surrogateescape")


def _error(msg: str, rc: int) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return rc


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.tokens <= MAX_TOKENS:
        return _error(f"--tokens must be in [0, {MAX_TOKENS}]", 2)
    if not (0 <= args.temperature < float("inf")):
        return _error("--temperature must be a finite number >= 0", 2)
    temperature = 0.0 if args.greedy else args.temperature
    try:
        check_sampling(temperature, args.top_k, args.top_p)
    except (TypeError, ValueError) as e:
        return _error("--" + str(e).replace("_", "-"), 2)
    if args.seed < 0:
        return _error("--seed must be >= 0", 2)
    if args.threads is not None and args.threads < 1:
        return _error("--threads must be >= 1", 2)
    if any(not s for s in args.stop or []):
        return _error("--stop must not be empty", 2)
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
        return _error(str(e), 1)
    from ..io.hf import text_ids
    try:
        ids = [text_ids(_bytes(t), tokenizer) for t in args.prompt or ["def "]]
        stops = [list(text_ids(_bytes(s), tokenizer)) for s in args.stop or []]
    except ValueError as e:
        return _error(f"--prompt/--stop: {e}", 2)
    if any(i.size == 0 for i in ids) or any(not s for s in stops):
        return _error("--prompt/--stop: the tokenizer makes no token of it", 2)
    try:
        out = generate(params, ids, args.tokens, eps=eps, discretization=disc,
                       temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                       stop=stops or None, rng=np.random.default_rng(args.seed),
                       weights_dtype=None if args.weights_dtype == "float32" else "float16",
                       n_threads=args.threads, device=args.device)
    except (ValueError, RuntimeError) as e:
        return _error(str(e), 1)
    for prompt, row in zip(ids, out):
        full = np.concatenate([prompt, row[row != STOPPED]])
        if tokenizer is not None:
            sys.stdout.write(tokenizer.decode([int(t) for t in full]) + "\n")
        else:
            sys.stdout.write(bytes(full.astype(np.uint8)).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
