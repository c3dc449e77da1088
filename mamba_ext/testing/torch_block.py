"""The benchmark baselines: the same Mamba-1 block in PyTorch eager mode, autograd backward.

Written like the reference ``selective_scan_ref`` of the Mamba authors: every op is a
PyTorch op and the discretised a_bar, b_bar*u are formed for all time steps at once as
(B, L, D, N) tensors. Two variants share everything but the scan:

* :func:`block_forward`: the recurrence as a Python loop over time;
* :func:`block_forward_chunked`: no Python time loop; inside chunks of ``chunk`` steps
  h_t = exp(S_t) * (h_in + cumsum_s(exp(-S_s) b_s u_s)) with S the cumulative sum of
  delta*A (log-space decay), across chunks a Hillis-Steele scan of (decay, state) pairs.
  Sound while |S| stays below ~80 within a chunk, which holds for the benchmark's
  weights (the GPU bench checks it against WGSL in the same run).

Same semantics as mamba_ext (docs/semantics.md): RMSNorm eps inside the root, tap k of
the conv on x[t-k], exact ZOH with expm1, A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX)).
Imported only by the benchmarks (``python -m mamba_ext bench``) when torch is installed.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
C = number of scan chunks.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..constants import A_LOG_MAX, A_LOG_MIN, DEFAULT_EPS

__all__ = ["block_forward", "block_forward_chunked", "make_inputs", "forward_backward"]


def _discretize(x, p, eps):
    """Steps 1-8 for all time steps: (dA, bu, Cs, u, z) with dA = delta*A and
    bu = b_bar*u, both (B, L, D, N); Cs (B, L, N); u, z (B, L, D)."""
    B, L, Dm = x.shape
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * p["normWeight"]
    xc, z = F.linear(xn, p["wInProj"], p["bInProj"]).split([D, D], dim=-1)    # (B, L, D) each
    # conv1d is a cross-correlation over K-1 left padding: flip our taps (k=0 is current step)
    conv = F.conv1d(xc.transpose(1, 2), p["wConv"].flip(-1).unsqueeze(1), p["bConv"],
                    padding=K - 1, groups=D)[..., :L].transpose(1, 2)        # (B, L, D)
    u = F.silu(conv)
    dt_low, Bs, Cs = F.linear(u, p["wXProj"], p["bXProj"]).split([R, N, N], dim=-1)
    delta = F.softplus(F.linear(dt_low, p["wDtProj"], p["bDtProj"]))         # (B, L, D)
    # clamp whose gradient is 0 at the bounds too (torch.clamp passes it there)
    inside = (p["A_log"] > A_LOG_MIN) & (p["A_log"] < A_LOG_MAX)
    A = -torch.exp(torch.where(inside, p["A_log"],
                               p["A_log"].detach().clamp(A_LOG_MIN, A_LOG_MAX)))  # (D, N)
    dA = delta.unsqueeze(-1) * A                                             # (B, L, D, N)
    bu = torch.expm1(dA) / A * Bs.unsqueeze(2) * u.unsqueeze(-1)             # b_bar * u
    return dA, bu, Cs, u, z


def _output(x, p, y, u, z):
    """Steps 10-12 after the scan: skip, gate, out_proj, residual; y (B, L, D)."""
    y = y + p["D_vec"] * u
    return F.linear(y * F.silu(z), p["wOutProj"], p["bOutProj"]) + x


def _scan_loop(dA, bu, Cs):
    """y (B, L, D) of h_t = exp(dA_t) h_{t-1} + bu_t, y_t = Cs_t . h_t, as a Python loop."""
    B, L, D, N = dA.shape
    # unbind, not a_bar[:, t]: the backward of one unbind is one stack, while each
    # indexing op's backward would write a zero tensor of the full (B, L, D, N) size
    h = dA.new_zeros(B, D, N)
    ys = []
    for a_t, bu_t, c_t in zip(torch.exp(dA).unbind(1), bu.unbind(1), Cs.unsqueeze(2).unbind(1)):
        h = a_t * h + bu_t
        ys.append((h * c_t).sum(-1))                                         # (B, D)
    return torch.stack(ys, dim=1)


def _scan_chunked(dA, bu, Cs, chunk):
    """The same y as :func:`_scan_loop` without a Python loop over time (see module doc)."""
    B, L, D, N = dA.shape
    C = -(-L // chunk)
    pad = C * chunk - L
    if pad:
        dA = F.pad(dA, (0, 0, 0, 0, 0, pad))
        bu = F.pad(bu, (0, 0, 0, 0, 0, pad))
    dA = dA.view(B, C, chunk, D, N)
    bu = bu.view(B, C, chunk, D, N)
    S = torch.cumsum(dA, dim=2)                                    # log decay inside chunk
    hloc = torch.exp(S) * torch.cumsum(torch.exp(-S) * bu, dim=2)  # from a zero state
    a_c, b_c = torch.exp(S[:, :, -1]), hloc[:, :, -1]              # (B, C, D, N)
    step = 1
    while step < C:                                                # inclusive scan over chunks
        a_prev = F.pad(a_c[:, :-step], (0, 0, 0, 0, step, 0), value=1.0)
        b_prev = F.pad(b_c[:, :-step], (0, 0, 0, 0, step, 0))
        a_c, b_c = a_c * a_prev, a_c * b_prev + b_c
        step *= 2
    hstate = F.pad(b_c[:, :-1], (0, 0, 0, 0, 1, 0))               # state entering chunk c
    h = hloc + torch.exp(S) * hstate.unsqueeze(2)
    h = h.view(B, C * chunk, D, N)[:, :L]
    return (h * Cs.unsqueeze(2)).sum(-1)


def block_forward(x, p, eps=DEFAULT_EPS):
    """x (B, L, Dm) tensor, p dict name -> tensor (golden shapes); returns out (B, L, Dm).
    The scan is a Python loop over time."""
    dA, bu, Cs, u, z = _discretize(x, p, eps)
    return _output(x, p, _scan_loop(dA, bu, Cs), u, z)


def block_forward_chunked(x, p, eps=DEFAULT_EPS, chunk=16):
    """As :func:`block_forward`, with the chunked scan (no Python loop over time)."""
    dA, bu, Cs, u, z = _discretize(x, p, eps)
    return _output(x, p, _scan_chunked(dA, bu, Cs, chunk), u, z)


def make_inputs(x, params, dtype=torch.float32):
    """Leaf tensors (requires_grad) from NumPy arrays."""
    tx = torch.tensor(np.asarray(x), dtype=dtype, requires_grad=True)
    tp = {n: torch.tensor(np.asarray(v), dtype=dtype, requires_grad=True) for n, v in params.items()}
    return tx, tp


def forward_backward(tx, tp, tdout, forward=block_forward):
    """One forward + autograd backward; returns (out, dx, grads dict) as tensors."""
    tx.grad = None
    for v in tp.values():
        v.grad = None
    out = forward(tx, tp)
    out.backward(tdout)
    return out.detach(), tx.grad, {n: v.grad for n, v in tp.items()}
