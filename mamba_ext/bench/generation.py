"""Generation benchmark: the compiled recurrent step, its memory-bandwidth cap, the prefill.

``python -m mamba_ext bench --generation`` calls :func:`bench_generation`. Per model
(random weights: generation speed does not depend on their values) and per weight
storage (float32, float16):
  - tokens/s of greedy generation at batch 1 and larger batches (tokens of all
    sequences per second; the C loop of ``Stepper.greedy``: step + argmax per token);
  - prefill tokens/s of a 512-token prompt (the chunked forward of ``generate``);
  - the memory-bandwidth cap of batch 1: every weight is read once per token, so
    tokens/s <= bandwidth / (bytes of weights per token); bandwidth = bytes read +
    written per second by a large NumPy copy, measured in the same process.
All numbers are medians of ``repeats`` runs. On a shared machine they are only
indicative: rerun on an idle machine for final numbers.
Then, on the tiny model, step() against re-running ``model_forward`` for every token.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..model import init_model_params, model_forward
from ..recurrent import init_state, prefill_state, step, stepper, validated_layers

# name -> (vocab, d_model, n_layers, d_state); dInner = 2 dModel, dtRank = ceil(dModel/16)
MODELS = {"tiny": (512, 64, 2, 16), "130m": (50280, 768, 24, 16)}


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes read + written per second by ``np.copyto`` of an ``nbytes`` float32 array."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(ts))


def weight_bytes_per_token(params: dict, half: bool) -> int:
    """Bytes of weights one step reads: every array once (the embedding once, as the head:
    the lookup reads one row), the four projections and the embedding at 2 bytes when
    ``half``."""
    big = ("wInProj", "wXProj", "wDtProj", "wOutProj")
    total = 0
    for k, v in params.items():
        wide = k == "embedding" or k.split(".")[-1] in big
        total += v.size * (2 if half and wide else v.itemsize)
    return total


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_model(name: str, *, n_tokens: int, batches=(1, 4, 16), prefill: int = 512,
                repeats: int = 3, n_threads: int | None = None,
                print_fn: Callable[[str], object] = print, bandwidth: float | None = None) -> dict:
    """Generation and prefill speed of the model ``name`` (:data:`MODELS`), float32 and
    float16 weights; returns the numbers as a dict."""
    V, Dm, n_layers, N = MODELS[name]
    params = init_model_params(V, Dm, n_layers, d_state=N, seed=0)
    bw = bandwidth or copy_bandwidth()
    res = {"model": name, "bandwidth_GBs": bw / 1e9}
    print_fn(f"{name}: {n_layers} x {Dm}, vocab {V}, d_state {N}; copy bandwidth "
             f"{bw / 1e9:.1f} GB/s (read + write)")
    for wd in ("float32", "float16"):
        half = wd == "float16"
        wb = weight_bytes_per_token(params, half)
        cap = bw / wb
        row = {"weight_MB": wb / 1e6, "cap_tok_s": cap}
        for B in batches:
            state = init_state(params, B)
            st, arrays = stepper(params, state, "float16" if half else None, n_threads)
            logits = np.empty((B, V), np.float32)
            st.step(np.zeros(B, np.int64), logits)            # warm: page in every weight
            out = np.empty((B, n_tokens), np.int64)
            t = _median_time(lambda st=st, lg=logits, o=out: st.greedy(lg, o), repeats)
            # greedy() feeds n_tokens - 1 tokens (the last one is not fed)
            row[f"tok_s_b{B}"] = B * max(1, n_tokens - 1) / t
        state = init_state(params, 1)
        layers, arrays = validated_layers(params, state)
        prompt = np.random.default_rng(0).integers(0, V, (1, prefill))

        def run_prefill(prompt=prompt, layers=layers, arrays=arrays):
            s = init_state(params, 1)
            prefill_state(prompt, s.h, s.conv, layers, arrays, s.eps, "zoh", n_threads or 0)
        row["prefill_tok_s"] = prefill / _median_time(run_prefill, repeats)
        res[wd] = row
        gen = ", ".join(f"batch {B}: {row[f'tok_s_b{B}']:,.0f}" for B in batches)
        print_fn(f"  {wd} weights ({row['weight_MB']:.1f} MB/token, cap {cap:,.0f} tok/s at batch 1): "
                 f"generation tokens/s {gen}; batch 1 = {row['tok_s_b1'] / cap:.0%} of the cap; "
                 f"prefill {prefill} (float32 forward): {row['prefill_tok_s']:,.0f} tok/s")
    return res


def _rerun_comparison(n_tokens: int, repeats: int, n_threads: int | None, print_fn) -> dict:
    """Tiny model: recurrent step() (the public per-token call, Python overhead included)
    against re-running ``model_forward`` on the whole context for every token (the sum
    over contexts 1..n, interpolated between measured lengths: quadratic in n)."""
    V, Dm, n_layers, N = MODELS["tiny"]
    params = init_model_params(V, Dm, n_layers, d_state=N, seed=0)

    def run():
        state = init_state(params, 1)
        tok = np.zeros(1, np.int64)
        for _ in range(n_tokens):
            logits, state = step(tok, params, state, n_threads=n_threads)
            tok = np.argmax(logits, axis=-1)
    t_rec = _median_time(run, repeats)
    lengths = sorted({1} | {max(1, n_tokens * k // 8) for k in (1, 2, 4, 8)})
    fwd = [_median_time(lambda L=L: model_forward(np.zeros((1, L), np.int64), params,
                                                  n_threads=n_threads), repeats) for L in lengths]
    total = float(np.sum(np.interp(np.arange(1, n_tokens + 1), lengths, fwd)))
    print_fn(f"tiny: recurrent step() from Python: {n_tokens / t_rec:,.0f} tok/s; re-running "
             f"model_forward for each of {n_tokens} tokens: ~{n_tokens / total:,.1f} tok/s -> "
             f"step() is {total / t_rec:.0f}x faster")
    return {"recurrent_tok_s": n_tokens / t_rec, "rerun_tok_s": n_tokens / total,
            "speedup": total / t_rec}


def bench_generation(n_tokens: int = 256, *, models=("tiny", "130m"), batches=(1, 4, 16),
                     prefill: int = 512, repeats: int = 3, n_threads: int | None = None,
                     print_fn: Callable[[str], object] = print) -> dict:
    """The generation benchmark (module docstring) over ``models``; ``n_tokens`` tokens
    per timed generation (the 130M-like model uses at most 64). Returns the numbers."""
    print_fn(f"generation benchmark (greedy, random weights, median of {repeats}; numbers "
             f"measured on a busy machine are not final)")
    bw = copy_bandwidth()
    res = {}
    for name in models:
        n = n_tokens if name == "tiny" else min(n_tokens, 64)
        res[name] = bench_model(name, n_tokens=max(2, n), batches=batches, prefill=prefill,
                                repeats=repeats, n_threads=n_threads, print_fn=print_fn,
                                bandwidth=bw)
    res["rerun"] = _rerun_comparison(max(2, min(n_tokens, 1000)), repeats, n_threads, print_fn)
    return res
