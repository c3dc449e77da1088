"""Independent float64 NumPy reference of the Mamba-1 block and the small model.

Written from the semantics in docs/semantics.md ("Exact semantics"), step
by step, with a plain sequential scan; it shares no code with mamba_ext. Slow
and simple on purpose: it is what the tests compare the compiled core against
(besides the golden files, which this module is itself checked against).

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, V vocab.
"""
from __future__ import annotations

import numpy as np

A_LOG_MIN, A_LOG_MAX = -10.0, 5.0


def rmsnorm(x, weight, eps=1e-6):
    """x (..., Dm) -> x / sqrt(mean(x^2) + eps) * weight; eps inside the root."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * weight


def sigmoid(v):
    return 0.5 * (1.0 + np.tanh(0.5 * v))   # no overflow for large |v|


def silu(v):
    return v * sigmoid(v)


def softplus(v):
    return np.maximum(v, 0.0) + np.log1p(np.exp(-np.abs(v)))


def block_forward(x, params, eps=1e-6, discretization="zoh"):
    """One Mamba-1 block; returns out (B, L, Dm) float64.

    ``params``: mapping of the 13 names to arrays of the golden shapes.
    ``discretization``: "zoh" (exact, b_bar = (exp(Delta*A) - 1)/A * B) or
    "euler" (b_bar = Delta * B); a_bar = exp(Delta*A) in both.
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    x = np.asarray(x, dtype=np.float64)                  # (B, L, Dm)
    B, L, _ = x.shape
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]

    xn = rmsnorm(x, p["normWeight"], eps)                 # 1. (B, L, Dm)
    Y = xn @ p["wInProj"].T + p["bInProj"]                # 2. (B, L, 2D)
    xc, z = Y[..., :D], Y[..., D:]
    c = np.broadcast_to(p["bConv"], xc.shape).copy()      # 3. causal conv, tap k on t-k
    for k in range(K):
        if k < L:
            c[:, k:, :] += p["wConv"][:, k] * xc[:, :L - k, :]
    u = silu(c)                                           # 4. (B, L, D)
    Q = u @ p["wXProj"].T + p["bXProj"]                   # 5. (B, L, P)
    dt, Bs, Cs = Q[..., :R], Q[..., R:R + N], Q[..., R + N:R + 2 * N]
    Delta = softplus(dt @ p["wDtProj"].T + p["bDtProj"])  # 6. (B, L, D)
    A = -np.exp(np.clip(p["A_log"], A_LOG_MIN, A_LOG_MAX))  # 7. (D, N)

    h = np.zeros((B, D, N))                               # 9. state, zero at t = 0
    y = np.empty((B, L, D))
    for t in range(L):
        dA = Delta[:, t, :, None] * A                     # (B, D, N)
        a_bar = np.exp(dA)
        if discretization == "zoh":                       # 8. exact ZOH
            b_bar = np.expm1(dA) / A * Bs[:, t, None, :]
        elif discretization == "euler":
            b_bar = Delta[:, t, :, None] * Bs[:, t, None, :]
        else:
            raise ValueError(f"discretization: {discretization!r}")
        h = a_bar * h + b_bar * u[:, t, :, None]
        y[:, t, :] = np.sum(Cs[:, t, None, :] * h, axis=-1)  # 10. readout
    y = y + p["D_vec"] * u                                #     + skip
    gated = y * silu(z)                                   # 11. gate
    return gated @ p["wOutProj"].T + p["bOutProj"] + x    # 12. out_proj + residual


def block_params_of_layer(weights, i):
    """The 13 block parameters of layer ``i`` from golden-style model keys."""
    prefix = f"layer{i}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def model_forward(tokens, targets, weights, eps=1e-6):
    """Small Mamba-1 LM; returns (logits (B, L, V), mean cross-entropy) in float64.

    ``weights`` keyed like the golden model files without the ``w_`` prefix:
    ``embedding`` (V, Dm), ``final_norm`` (Dm,), ``lm_head_bias`` (V,),
    ``layer{i}.{name}`` for the 13 block parameters of each layer.
    """
    emb = np.asarray(weights["embedding"], dtype=np.float64)
    n_layers = 0
    while f"layer{n_layers}.wInProj" in weights:
        n_layers += 1
    h = emb[np.asarray(tokens)]                            # (B, L, Dm)
    for i in range(n_layers):
        h = block_forward(h, block_params_of_layer(weights, i), eps)
    xn = rmsnorm(h, np.asarray(weights["final_norm"], dtype=np.float64), eps)
    logits = xn @ emb.T + np.asarray(weights["lm_head_bias"], dtype=np.float64)  # (B, L, V)
    m = np.max(logits, axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.sum(np.exp(logits - m), axis=-1))
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], axis=-1)[..., 0]
    return logits, float(np.mean(lse - picked))
