"""The bench baseline: the same Mamba-1 block in PyTorch eager mode, autograd backward.

Written like the reference ``selective_scan_ref`` of the Mamba authors: every op
is a PyTorch op, the discretised a_bar, b_bar*u are formed for all time steps
at once as (B, L, D, N) tensors, and the recurrence is a Python loop over time.
Same semantics as mamba_ext (golden README): RMSNorm eps inside the root,
tap k of the conv on x[t-k], exact ZOH with expm1, A = -exp(clamp(A_log, -10, 5)).
Only imported by ``python -m mamba_ext bench`` when torch is installed.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank.
"""
import torch
import torch.nn.functional as F


def block_forward(x, p, eps=1e-6):
    """x (B, L, Dm) tensor, p dict name -> tensor (golden shapes); returns out (B, L, Dm)."""
    B, L, Dm = x.shape
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    R = p["wDtProj"].shape[1]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * p["normWeight"]
    xc, z = F.linear(xn, p["wInProj"], p["bInProj"]).split([D, D], dim=-1)    # (B, L, D) each
    # conv1d is a cross-correlation over K-1 left padding: flip our taps (k=0 is current step)
    c = F.conv1d(xc.transpose(1, 2), p["wConv"].flip(-1).unsqueeze(1), p["bConv"],
                 padding=K - 1, groups=D)[..., :L].transpose(1, 2)           # (B, L, D)
    u = F.silu(c)
    dt, Bs, Cs = F.linear(u, p["wXProj"], p["bXProj"]).split([R, N, N], dim=-1)
    Delta = F.softplus(F.linear(dt, p["wDtProj"], p["bDtProj"]))             # (B, L, D)
    # clamp whose gradient is 0 at the bounds too (torch.clamp passes it there)
    inside = (p["A_log"] > -10.0) & (p["A_log"] < 5.0)
    A = -torch.exp(torch.where(inside, p["A_log"], p["A_log"].detach().clamp(-10.0, 5.0)))  # (D, N)
    dA = Delta.unsqueeze(-1) * A                                             # (B, L, D, N)
    a_bar = torch.exp(dA)
    bu = torch.expm1(dA) / A * Bs.unsqueeze(2) * u.unsqueeze(-1)             # b_bar * u
    # unbind, not a_bar[:, t]: the backward of one unbind is one stack, while each
    # indexing op's backward would write a zero tensor of the full (B, L, D, N) size
    h = x.new_zeros(B, D, N)
    ys = []
    for a_t, bu_t, c_t in zip(a_bar.unbind(1), bu.unbind(1), Cs.unsqueeze(2).unbind(1)):
        h = a_t * h + bu_t
        ys.append((h * c_t).sum(-1))                                         # (B, D)
    y = torch.stack(ys, dim=1) + p["D_vec"] * u
    return F.linear(y * F.silu(z), p["wOutProj"], p["bOutProj"]) + x


def make_inputs(x, params, dtype=torch.float32):
    """Leaf tensors (requires_grad) from NumPy arrays."""
    tx = torch.tensor(x, dtype=dtype, requires_grad=True)
    tp = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in params.items()}
    return tx, tp


def forward_backward(tx, tp, tdout):
    """One forward + autograd backward; returns (out, dx, grads dict) as tensors."""
    tx.grad = None
    for v in tp.values():
        v.grad = None
    out = block_forward(tx, tp)
    out.backward(tdout)
    return out.detach(), tx.grad, {n: v.grad for n, v in tp.items()}
