"""Stateful (recurrent) inference: one token at a time, constant cost per token.

    state = init_state(params, batch, eps=1e-6, discretization="zoh")
    logits, state = step(token_ids, params, state)     # token_ids (B,) -> logits (B, V)

After feeding tokens ``t_0 .. t_j`` one by one, ``logits`` equals row ``j`` of
``model_forward`` on the whole sequence (same eps, same discretization). Per layer the
state is the scan state ``h`` (B, D, N) and the conv tail (B, D, K-1): the in_proj x-half
of the last K-1 steps, oldest first (zeros = the zero history of the full forward). Each
step costs O(layers * B * (Dm*D + D*N + V*Dm)), independent of the position.

Maths per step (docs/semantics.md, one time step; row = one batch element):
RMSNorm -> in_proj -> causal conv over [tail, x] -> SiLU -> x_proj -> dt_proj + softplus ->
a_bar = exp(Delta*A), b_bar = (a_bar-1)/A * B (zoh, via expm1) or Delta*B (euler) ->
h = a_bar*h + b_bar*u -> y = C.h + D*u -> y*SiLU(z) -> out_proj + residual; final RMSNorm,
tied head. Everything runs in the params' dtype (float32 state for float32 params).

Size letters: B batch, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import time

import numpy as np

from ._validate import check_discretization, check_tokens
from .model import check_model_params



class RecurrentState:
    """Per-layer scan state and conv tail of a batch of sequences, plus the model settings.

    ``h[i]`` (B, D, N), ``conv[i]`` (B, D, K-1) for layer ``i``; ``position`` counts the
    tokens consumed. ``eps`` and ``discretization`` are fixed at :func:`init_state`.
    """

    def __init__(self, batch, eps, discretization):
        self.batch = batch
        self.eps = eps
        self.discretization = discretization
        self.h = []
        self.conv = []
        self.position = 0
        self._seen = None     # (the caller's arrays, per-layer validated dicts, other arrays)

    def copy(self) -> "RecurrentState":
        s = RecurrentState(self.batch, self.eps, self.discretization)
        s.h = [a.copy() for a in self.h]
        s.conv = [a.copy() for a in self.conv]
        s.position = self.position
        s._seen = self._seen
        return s


def _validated(params, state):
    """``(layers, arrays)`` for ``params``: a validated dict per layer and the whole dict.

    Validation runs once; later calls only check that the caller still passes the same
    array objects (in-place updates keep shapes and dtypes, so they stay valid).
    """
    seen = state._seen
    if seen is not None and len(params) == len(seen[0]) and all(
            params.get(k) is v for k, v in seen[0].items()):
        return seen[1], seen[2]
    arrays, mdims = check_model_params(params)
    n_layers, dims = mdims.n_layers, mdims.block
    dt = arrays["embedding"].dtype
    want = [((state.batch, dims.D, dims.N), (state.batch, dims.D, dims.K - 1))] * n_layers
    if state.h and [(h.shape, c.shape) for h, c in zip(state.h, state.conv)] != want \
            or any(h.dtype != dt for h in state.h):
        raise ValueError(f"state: built for {len(state.h)} layer(s) with h {state.h[0].shape} "
                         f"{state.h[0].dtype}, but params have {n_layers} layer(s) with {dims}, {dt}; "
                         f"call init_state with these params")
    layers = [{k[len(f"layer{i}."):]: v for k, v in arrays.items() if k.startswith(f"layer{i}.")}
              for i in range(n_layers)]
    # hold the caller's objects, so the identity test above cannot be fooled by id reuse
    state._seen = (dict(params), layers, arrays)
    return layers, arrays


def init_state(params, batch: int, *, eps: float = 1e-6, discretization: str = "zoh") -> RecurrentState:
    """Zero state for ``batch`` sequences of the model ``params`` (validated here)."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch: expected an integer >= 1, got {batch!r}")
    check_discretization(discretization)
    eps = float(eps)
    if not (eps > 0.0 and np.isfinite(eps)):
        raise ValueError(f"eps: expected a finite number > 0, got {eps}")
    state = RecurrentState(int(batch), eps, discretization)
    layers, arrays = _validated(params, state)
    for p in layers:
        D, K = p["wConv"].shape
        N = p["A_log"].shape[1]
        state.h.append(np.zeros((batch, D, N), p["wConv"].dtype))          # h (B, D, N)
        state.conv.append(np.zeros((batch, D, K - 1), p["wConv"].dtype))   # tail (B, D, K-1), oldest first
    return state


def _rmsnorm(x, w, eps):
    # x (B, Dm), w (Dm,)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps)) * w


def _silu(x):
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))     # = x * sigmoid(x), no overflow warning


def _block_step(x, p, h, tail, eps, euler):
    """One block, one time step. x (B, Dm) -> out (B, Dm); updates h and tail in place."""
    D = p["D_vec"].shape[0]
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]
    xn = _rmsnorm(x, p["normWeight"], eps)                        # xn (B, Dm)
    Y = xn @ p["wInProj"].T + p["bInProj"]                        # Y (B, 2D)
    xc, z = Y[:, :D], Y[:, D:]                                    # xc, z (B, D)
    # window (B, D, K) oldest first; our tap k multiplies step t-k, so read wConv reversed
    window = np.concatenate([tail, xc[:, :, None]], axis=2)
    c = np.einsum("bdk,dk->bd", window, p["wConv"][:, ::-1]) + p["bConv"]
    tail[...] = window[:, :, 1:]
    u = _silu(c)                                                  # u (B, D)
    Q = u @ p["wXProj"].T + p["bXProj"]                           # Q (B, R+2N)
    dt, Bs, Cs = Q[:, :R], Q[:, R:R + N], Q[:, R + N:]
    delta = dt @ p["wDtProj"].T + p["bDtProj"]                    # delta (B, D)
    Delta = np.maximum(delta, 0) + np.log1p(np.exp(-np.abs(delta)))
    A = -np.exp(np.clip(p["A_log"], -10, 5))                      # A (D, N)
    dA = Delta[:, :, None] * A                                    # dA (B, D, N)
    if euler:
        b_bar = Delta[:, :, None] * Bs[:, None, :]
    else:  # exact ZOH; expm1 keeps (a_bar - 1)/A accurate when |Delta*A| is tiny
        b_bar = np.expm1(dA) / A * Bs[:, None, :]
    h *= np.exp(dA)
    h += b_bar * u[:, :, None]                                    # h (B, D, N)
    y = (h @ Cs[:, :, None])[:, :, 0] + p["D_vec"] * u            # y (B, D)
    return (y * _silu(z)) @ p["wOutProj"].T + p["bOutProj"] + x


def step(token_ids, params, state: RecurrentState):
    """Feed one token per sequence: ``token_ids`` (B,) ints -> ``(logits (B, V), state)``.

    ``state`` is updated in place and returned (use ``state.copy()`` to branch).
    """
    layers, arrays = _validated(params, state)
    emb = arrays["embedding"]
    V = emb.shape[0]
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.shape[0] != state.batch:
        raise ValueError(f"token_ids: expected shape ({state.batch},) (one id per sequence of the "
                         f"state), got {ids.shape}")
    ids = check_tokens("token_ids", ids[:, None], vocab_size=V)[:, 0]
    x = emb[ids]                                                  # x (B, Dm)
    euler = state.discretization == "euler"
    for p, h, tail in zip(layers, state.h, state.conv):
        x = _block_step(x, p, h, tail, state.eps, euler)
    xn = _rmsnorm(x, arrays["final_norm"], state.eps)
    logits = xn @ emb.T + arrays["lm_head_bias"]                  # logits (B, V)
    state.position += 1
    return logits, state


def generate(params, prompt, n_tokens: int, *, eps: float = 1e-6, discretization: str = "zoh",
             temperature: float = 0.0, rng=None):
    """Continue ``prompt`` (B, L>=1) ints by ``n_tokens`` tokens -> (B, n_tokens) int64.

    ``temperature`` 0 is greedy (argmax); otherwise sample from softmax(logits / T) with
    ``rng`` (a ``numpy.random.Generator``). The prompt is fed through :func:`step` too,
    so the whole call is linear in L + n_tokens.
    """
    prompt = check_tokens("prompt", prompt)
    if prompt.shape[1] < 1:
        raise ValueError(f"prompt: expected at least one token per sequence, got shape {prompt.shape}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
        raise ValueError(f"n_tokens: expected an integer >= 0, got {n_tokens!r}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if temperature > 0 and rng is None:
        rng = np.random.default_rng()
    B = prompt.shape[0]
    state = init_state(params, B, eps=eps, discretization=discretization)
    for t in range(prompt.shape[1]):
        logits, state = step(prompt[:, t], params, state)
    out = np.empty((B, n_tokens), np.int64)
    for j in range(n_tokens):
        if temperature == 0:
            nxt = np.argmax(logits, axis=-1)
        else:
            z = logits.astype(np.float64) / temperature
            prob = np.exp(z - z.max(axis=-1, keepdims=True))
            prob /= prob.sum(axis=-1, keepdims=True)
            nxt = np.array([rng.choice(prob.shape[1], p=pr) for pr in prob])
        out[:, j] = nxt
        if j + 1 < n_tokens:
            logits, state = step(nxt, params, state)
    return out


def bench_generation(n_tokens: int = 1000, *, d_model: int = 64, n_layers: int = 2,
                     vocab_size: int = 256, d_state: int = 16, repeats: int = 3, n_threads: int = 1,
                     seed: int = 0, print_fn=print) -> dict:
    """Generation speed at ``n_tokens`` tokens (batch 1, greedy): :func:`generate` (recurrent
    ``step()``) against re-running ``model_forward`` on the whole context for every token.

    Prints medians over ``repeats``: recurrent tokens/s and the per-token cost of the first
    and the last 10% of the steps (flat: cost independent of the position); the forward's
    time on contexts of n/8 .. n tokens, and the total cost of re-running it for every
    token (the sum over contexts 1..n, interpolated linearly between the measured lengths:
    quadratic in n), hence its tokens/s and the ratio. Returns the numbers as a dict.
    """
    from .model import init_model_params, model_forward

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
