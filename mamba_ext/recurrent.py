"""Stateful (recurrent) inference: one token at a time, constant cost per token.

    state = init_state(params, batch, eps=DEFAULT_EPS, discretization="zoh")
    logits, state = step(token_ids, params, state)     # token_ids (B,) -> logits (B, V)

After feeding tokens ``t_0 .. t_j`` one by one, ``logits`` equals row ``j`` of
``model_forward`` on the whole sequence (same eps, same discretization). Per layer the
state is the scan state ``h`` (B, D, N) and the conv tail (B, D, K-1): the in_proj x-half
of the last K-1 steps, oldest first (zeros = the zero history of the full forward). Each
step costs O(layers * B * (Dm*D + D*N + V*Dm)), independent of the position.

Maths per step (docs/semantics.md, one time step; row = one batch element):
RMSNorm -> in_proj -> causal conv over [tail, x] -> SiLU -> x_proj -> dt_proj + softplus ->
a_bar = exp(delta*A), b_bar = (a_bar-1)/A * B (zoh, via expm1) or delta*B (euler) ->
h = a_bar*h + b_bar*u -> y = C.h + D*u -> y*SiLU(z) -> out_proj + residual; final RMSNorm,
tied head. Everything runs in the params' dtype (float32 state for float32 params).

Size letters: B batch, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

from ._validate import (
    MAX_ELEMENTS,
    check_count,
    check_discretization,
    check_eps,
    check_size,
    check_tokens,
)
from .constants import DEFAULT_EPS
from .model import check_model_params
from .testing import reference as ref

__all__ = ["RecurrentState", "init_state", "step", "generate"]


class RecurrentState:
    """Per-layer scan state and conv tail of a batch of sequences, plus the model settings.

    ``h[i]`` (B, D, N), ``conv[i]`` (B, D, K-1) for layer ``i``; ``position`` counts the
    tokens consumed. ``eps`` and ``discretization`` are fixed at :func:`init_state`.
    """

    def __init__(self, batch: int, eps: float, discretization: str) -> None:
        self.batch = batch
        self.eps = eps
        self.discretization = discretization
        self.h: list[np.ndarray] = []
        self.conv: list[np.ndarray] = []
        self.position = 0
        self._seen = None     # (the caller's arrays, per-layer validated dicts, other arrays)

    def copy(self) -> "RecurrentState":
        s = RecurrentState(self.batch, self.eps, self.discretization)
        s.h = [a.copy() for a in self.h]
        s.conv = [a.copy() for a in self.conv]
        s.position = self.position
        s._seen = self._seen
        return s


def _validated(params: Mapping[str, ArrayLike], state: RecurrentState) -> tuple[list, dict]:
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


def init_state(params: Mapping[str, ArrayLike], batch: int, *, eps: float = DEFAULT_EPS,
               discretization: str = "zoh") -> RecurrentState:
    """Zero state for ``batch`` sequences of the model ``params`` (validated here)."""
    batch = check_size("batch", batch, hi=MAX_ELEMENTS)
    check_discretization(discretization)
    eps = check_eps(eps)
    state = RecurrentState(batch, eps, discretization)
    layers, arrays = _validated(params, state)
    for p in layers:
        D, K = p["wConv"].shape
        N = p["A_log"].shape[1]
        check_count("state h (batch, dInner, dState)", (batch, D, N))
        state.h.append(np.zeros((batch, D, N), p["wConv"].dtype))          # h (B, D, N)
        state.conv.append(np.zeros((batch, D, K - 1), p["wConv"].dtype))   # tail (B, D, K-1), oldest first
    return state


def _block_step(x: np.ndarray, p: dict, h: np.ndarray, tail: np.ndarray, eps: float,
                discretization: str) -> np.ndarray:
    """One block, one time step. x (B, Dm) -> out (B, Dm); updates h and tail in place.

    The steps are those of the float64 reference (``mamba_ext.testing.reference``, which
    keeps the dtype it is given), applied to one time step: this is the one-token
    recurrence, not the chunked scan of the compiled forward. (A compiled step is
    issue 12's.)
    """
    D = p["D_vec"].shape[0]
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]
    xn = ref.rmsnorm(x, p["normWeight"], eps)                     # 1. xn (B, Dm)
    xz = ref.linear_forward(xn, p["wInProj"], p["bInProj"])       # 2. (B, 2D)
    xc, z = xz[:, :D], xz[:, D:]                                  #    xc, z (B, D)
    # 3. the conv over [tail, xc]: tail (B, D, K-1) oldest first is the reference's
    #    conv_state (B, K-1, D) transposed
    conv = ref.conv1d_forward(xc[:, None, :], p["wConv"], p["bConv"],
                              tail.transpose(0, 2, 1))[:, 0]      #    conv (B, D)
    window = np.concatenate([tail, xc[:, :, None]], axis=2)       #    (B, D, K)
    tail[...] = window[:, :, 1:]
    u = ref.silu(conv)                                            # 4. u (B, D)
    xproj = ref.linear_forward(u, p["wXProj"], p["bXProj"])       # 5. xproj (B, P)
    dt_low, Bs, Cs = xproj[:, :R], xproj[:, R:R + N], xproj[:, R + N:]
    delta = ref.softplus(ref.linear_forward(dt_low, p["wDtProj"], p["bDtProj"]))  # 6. (B, D)
    A = ref.a_of(p["A_log"])                                      # 7. A (D, N)
    y, h[...] = ref.scan_step(h, u, delta, A, Bs, Cs, discretization)  # 8-10. y (B, D)
    gated = ref.gate_forward(y + p["D_vec"] * u, z)               # 11. (B, D)
    return ref.linear_forward(gated, p["wOutProj"], p["bOutProj"]) + x  # 12. + residual


def step(token_ids: ArrayLike, params: Mapping[str, ArrayLike],
         state: RecurrentState) -> tuple[np.ndarray, RecurrentState]:
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
    for p, h, tail in zip(layers, state.h, state.conv):
        x = _block_step(x, p, h, tail, state.eps, state.discretization)
    xn = ref.rmsnorm(x, arrays["final_norm"], state.eps)
    logits = xn @ emb.T + arrays["lm_head_bias"]                  # logits (B, V)
    state.position += 1
    return logits, state


def generate(params: Mapping[str, ArrayLike], prompt: ArrayLike, n_tokens: int, *,
             eps: float = DEFAULT_EPS, discretization: str = "zoh", temperature: float = 0.0,
             rng: np.random.Generator | None = None) -> np.ndarray:
    """Continue ``prompt`` (B, L>=1) ints by ``n_tokens`` tokens -> (B, n_tokens) int64.

    ``temperature`` 0 is greedy (argmax); otherwise sample from softmax(logits / T) with
    ``rng`` (a ``numpy.random.Generator``). The prompt is fed through :func:`step` too,
    so the whole call is linear in L + n_tokens.
    """
    prompt = check_tokens("prompt", prompt)
    if prompt.shape[1] < 1:
        raise ValueError(f"prompt: expected at least one token per sequence, got shape {prompt.shape}")
    n_tokens = check_size("n_tokens", n_tokens, lo=0, hi=MAX_ELEMENTS)
    check_count("the output (batch, n_tokens)", (prompt.shape[0], n_tokens))
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a finite number >= 0, got {type(temperature).__name__} "
                        f"{temperature!r}")
    temperature = float(temperature)
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if temperature > 0 and rng is None:
        rng = np.random.default_rng()
    B = prompt.shape[0]
    state = init_state(params, B, eps=eps, discretization=discretization)
    with np.errstate(over="ignore", invalid="ignore"):   # overflow is reported below, once
        for t in range(prompt.shape[1]):
            logits, state = step(prompt[:, t], params, state)
        return _continue(logits, state, params, prompt.shape[1], n_tokens, temperature, rng)


def _continue(logits, state, params, L, n_tokens, temperature, rng):
    """The sampling loop of :func:`generate` after the prompt (L tokens)."""
    B = logits.shape[0]
    out = np.empty((B, n_tokens), np.int64)
    for j in range(n_tokens):
        if not np.isfinite(logits).all():
            raise ValueError(f"params: the logits of position {L + j - 1} are not finite; "
                             f"the weights cannot be sampled from (a diverged model?)")
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
