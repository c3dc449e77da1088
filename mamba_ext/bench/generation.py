"""Generation benchmark: the recurrent ``step()`` against re-running ``model_forward``.

``python -m mamba_ext bench --generation`` calls :func:`bench_generation`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..model import init_model_params, model_forward
from ..recurrent import init_state, step


def bench_generation(n_tokens: int = 1000, *, d_model: int = 64, n_layers: int = 2,
                     vocab_size: int = 256, d_state: int = 16, repeats: int = 3, n_threads: int = 1,
                     seed: int = 0, print_fn: Callable[[str], object] = print) -> dict:
    """Generation speed at ``n_tokens`` tokens (batch 1, greedy): ``mamba_ext.recurrent.generate`` (recurrent
    ``step()``) against re-running ``model_forward`` on the whole context for every token.

    Prints medians over ``repeats``: recurrent tokens/s and the per-token cost of the first
    and the last 10% of the steps (flat: cost independent of the position); the forward's
    time on contexts of n/8 .. n tokens, and the total cost of re-running it for every
    token (the sum over contexts 1..n, interpolated linearly between the measured lengths:
    quadratic in n), hence its tokens/s and the ratio. Returns the numbers as a dict.
    """
    params = init_model_params(vocab_size, d_model, n_layers, d_state=d_state, seed=seed)
    print_fn(f"generation benchmark: d_model {d_model}, {n_layers} layers, vocab {vocab_size}, "
             f"d_state {d_state}, batch 1, {n_tokens} tokens, median of {repeats}")

    runs, first, last = [], [], []
    tenth = max(1, n_tokens // 10)
    for _ in range(repeats):
        state = init_state(params, 1)
        tok = np.zeros(1, np.int64)
        times = np.empty(n_tokens)
        t_start = time.perf_counter()
        for j in range(n_tokens):
            t0 = time.perf_counter()
            logits, state = step(tok, params, state)
            tok = np.argmax(logits, axis=-1)
            times[j] = time.perf_counter() - t0
        runs.append(time.perf_counter() - t_start)
        first.append(times[:tenth].mean())
        last.append(times[-tenth:].mean())
    t_rec = float(np.median(runs))
    res = {"n_tokens": n_tokens, "recurrent_s": t_rec, "recurrent_tok_s": n_tokens / t_rec,
           "step_us_first": 1e6 * float(np.median(first)), "step_us_last": 1e6 * float(np.median(last))}
    print_fn(f"  recurrent step(): {t_rec:.3f} s = {res['recurrent_tok_s']:.0f} tok/s; per step "
             f"{res['step_us_first']:.0f} us over the first {tenth} tokens, "
             f"{res['step_us_last']:.0f} us over the last {tenth}")

    lengths = sorted({1} | {max(1, n_tokens * k // 8) for k in (1, 2, 4, 8)})
    fwd = []
    for L in lengths:
        ctx = np.zeros((1, L), np.int64)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model_forward(ctx, params, n_threads=n_threads)
            ts.append(time.perf_counter() - t0)
        fwd.append(float(np.median(ts)))
        print_fn(f"  model_forward on {L:6d} tokens: {1e3 * fwd[-1]:9.2f} ms")
    total = float(np.sum(np.interp(np.arange(1, n_tokens + 1), lengths, fwd)))
    res.update(forward_lengths=lengths, forward_s=fwd, rerun_total_s=total,
               rerun_tok_s=n_tokens / total, speedup=total / t_rec)
    print_fn(f"  re-running model_forward for each of {n_tokens} tokens: ~{total:.1f} s = "
             f"{res['rerun_tok_s']:.1f} tok/s -> step() is {res['speedup']:.0f}x faster")
    return res
