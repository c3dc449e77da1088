"""Independent float64 NumPy reference of the Mamba-1 block and the small model.

Written from the semantics in docs/semantics.md ("Exact semantics"), step
by step, with a plain sequential scan; it shares no code with the compiled core.
Slow and simple on purpose: it is what the tests compare the compiled core against
(besides the golden files, which this module is itself checked against).

The step functions keep the dtype of their inputs (``block_forward`` and
``model_forward`` convert everything to float64 first), so the one-token recurrent
inference of :mod:`mamba_ext.recurrent` runs these very steps in the params' dtype.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N, V vocab.
"""
from __future__ import annotations

import numpy as np

from ..constants import A_LOG_MAX, A_LOG_MIN, DEFAULT_EPS

__all__ = ["A_LOG_MIN", "A_LOG_MAX", "rmsnorm_forward", "rmsnorm", "sigmoid", "silu", "softplus",
           "linear_forward", "conv1d_forward", "a_of", "scan_step", "scan_forward", "gate_forward",
           "block_forward", "cross_entropy_forward", "block_params_of_layer", "model_forward"]


def rmsnorm_forward(x, weight, eps=DEFAULT_EPS):
    """x (..., Dm) -> (x * rstd * weight, rstd (..., 1)); eps inside the root (step 1)."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * weight, rstd


def rmsnorm(x, weight, eps=DEFAULT_EPS):
    """The normalised rows of :func:`rmsnorm_forward` alone."""
    return rmsnorm_forward(x, weight, eps)[0]


def sigmoid(v):
    return 0.5 * (1.0 + np.tanh(0.5 * v))   # no overflow for large |v|


def silu(v):
    return v * sigmoid(v)


def softplus(v):
    return np.maximum(v, 0.0) + np.log1p(np.exp(-np.abs(v)))


def linear_forward(x, weight, bias):
    """x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out) (steps 2, 5, 6, 12)."""
    return x @ weight.T + bias


def conv1d_forward(xc, weight, bias, conv_state=None):
    """Causal depthwise conv (step 3): xc (B, L, D), weight (D, K), bias (D,) -> conv (B, L, D).

    Tap k multiplies step t-k. ``conv_state`` (B, K-1, D), oldest first, is the input
    history before t = 0 (zeros when None).
    """
    B, L, D = xc.shape
    K = weight.shape[1]
    hist = np.zeros((B, K - 1, D), xc.dtype) if conv_state is None else np.asarray(conv_state, xc.dtype)
    full = np.concatenate([hist, xc], axis=1)            # (B, K-1+L, D)
    conv = np.broadcast_to(bias, xc.shape).copy()
    for k in range(K):
        conv += weight[:, k] * full[:, K - 1 - k:K - 1 - k + L, :]
    return conv


def a_of(A_log):
    """A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX)) (step 7), (D, N)."""
    return -np.exp(np.clip(A_log, A_LOG_MIN, A_LOG_MAX))


def scan_step(h, u, delta, A, Bs, Cs, discretization="zoh"):
    """One time step of the recurrence (steps 8-10, without the D_vec skip).

    h (B, D, N) the state before the step; u, delta (B, D); A (D, N); Bs, Cs (B, N).
    Returns (y (B, D), h_new (B, D, N)); ``h`` is not modified.
    """
    dA = delta[:, :, None] * A                            # (B, D, N)
    a_bar = np.exp(dA)
    if discretization == "zoh":                           # 8. exact ZOH; expm1 keeps
        b_bar = np.expm1(dA) / A * Bs[:, None, :]         #    (a_bar - 1)/A accurate
    elif discretization == "euler":
        b_bar = delta[:, :, None] * Bs[:, None, :]
    else:
        raise ValueError(f"discretization: {discretization!r}")
    h = a_bar * h + b_bar * u[:, :, None]                 # 9. recurrence
    return np.sum(Cs[:, None, :] * h, axis=-1), h         # 10. readout


def scan_forward(u, delta, A, Bs, Cs, D_vec, discretization="zoh", h0=None):
    """Selective scan (steps 8-10), sequential in time: :func:`scan_step` for t = 0..L-1.

    u, delta (B, L, D); A (D, N); Bs, Cs (B, L, N); D_vec (D,); h0 (B, D, N) or None.
    Returns (y (B, L, D), h_last (B, D, N)).
    """
    B, L, D = u.shape
    N = A.shape[1]
    h = np.zeros((B, D, N), u.dtype) if h0 is None else np.array(h0, dtype=u.dtype)
    y = np.empty((B, L, D), u.dtype)
    for t in range(L):
        y[:, t, :], h = scan_step(h, u[:, t], delta[:, t], A, Bs[:, t], Cs[:, t], discretization)
    return y + D_vec * u, h                               #     + skip


def gate_forward(y, z):
    """gated = y * SiLU(z) (step 11)."""
    return y * silu(z)


def block_forward(x, params, eps=DEFAULT_EPS, discretization="zoh", h0=None, conv_state=None,
                  return_state=False):
    """One Mamba-1 block; returns out (B, L, Dm) float64.

    ``params``: mapping of the 13 names to arrays of the golden shapes.
    ``discretization``: "zoh" (exact, b_bar = (exp(delta*A) - 1)/A * B) or
    "euler" (b_bar = delta * B); a_bar = exp(delta*A) in both.
    ``h0`` (B, D, N) and ``conv_state`` (B, K-1, D): state carried in from an earlier
    window; with ``return_state`` returns ``(out, h_last, conv_tail)``.
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    x = np.asarray(x, dtype=np.float64)                  # (B, L, Dm)
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]

    xn = rmsnorm(x, p["normWeight"], eps)                 # 1. (B, L, Dm)
    xz = linear_forward(xn, p["wInProj"], p["bInProj"])   # 2. (B, L, 2D)
    xc, z = xz[..., :D], xz[..., D:]
    conv = conv1d_forward(xc, p["wConv"], p["bConv"], conv_state)  # 3. (B, L, D)
    u = silu(conv)                                        # 4. (B, L, D)
    xproj = linear_forward(u, p["wXProj"], p["bXProj"])   # 5. (B, L, P)
    dt_low, Bs, Cs = xproj[..., :R], xproj[..., R:R + N], xproj[..., R + N:R + 2 * N]
    delta = softplus(linear_forward(dt_low, p["wDtProj"], p["bDtProj"]))  # 6. (B, L, D)
    A = a_of(p["A_log"])                                  # 7. (D, N)
    y, h_last = scan_forward(u, delta, A, Bs, Cs, p["D_vec"], discretization, h0)  # 8-10.
    gated = gate_forward(y, z)                            # 11.
    out = linear_forward(gated, p["wOutProj"], p["bOutProj"]) + x  # 12. out_proj + residual
    if not return_state:
        return out
    hist = (np.zeros((x.shape[0], K - 1, D)) if conv_state is None
            else np.asarray(conv_state, np.float64))
    conv_tail = np.concatenate([hist, xc], axis=1)[:, xc.shape[1]:, :]   # (B, K-1, D)
    return out, h_last, conv_tail


def cross_entropy_forward(logits, targets):
    """Mean over rows of logsumexp(logits) - logits[target]: logits (..., V), targets (...)."""
    m = np.max(logits, axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.sum(np.exp(logits - m), axis=-1))
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], axis=-1)[..., 0]
    return float(np.mean(lse - picked))


def block_params_of_layer(weights, i):
    """The 13 block parameters of layer ``i`` from golden-style model keys."""
    prefix = f"layer{i}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def model_forward(tokens, targets, weights, eps=DEFAULT_EPS, discretization="zoh"):
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
        h = block_forward(h, block_params_of_layer(weights, i), eps, discretization)
    xn = rmsnorm(h, np.asarray(weights["final_norm"], dtype=np.float64), eps)
    logits = linear_forward(xn, emb, np.asarray(weights["lm_head_bias"], dtype=np.float64))
    return logits, cross_entropy_forward(logits, targets)   # logits (B, L, V)
