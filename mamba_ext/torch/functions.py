"""mamba_ssm's and causal-conv1d's functions on our CPU kernels, as torch autograd Functions.

Size letters: B batch, D channels (dInner), L seqLen, N dState, G groups of B/C, K conv width.

Signatures, layouts and meanings are those of ``mamba_ssm.ops.selective_scan_interface``
(``selective_scan_fn``, ``mamba_inner_fn``), ``mamba_ssm.ops.triton.selective_state_update``
and ``causal_conv1d`` (``causal_conv1d_fn``, ``causal_conv1d_update``): the Euler
discretization of mamba_ssm (a_bar = exp(delta A), b_bar = delta B), A used as given (no
clamp: any negative real A), B/C constant, whole or grouped, ``return_last_state``, packed
sequences (``cu_seqlens``, ``seq_idx``); float16/bfloat16 computed in float32 as mamba_ssm's
reference does.

Design: two compiled kernels do the work, the selective scan (``_Scan``: steps.scan_forward
/ scan_backward with ``a_given``, h0 and h_last) and the depthwise causal convolution
(``_Conv``: steps.conv1d_forward / backward); each is one ``torch.autograd.Function`` over
NumPy views of the tensors' memory (no copy), run with the GIL released and with
``torch.get_num_threads()`` threads. Everything around them (delta_bias + softplus, the z
gate, the D skip is in the kernel, the projections of ``mamba_inner_fn``) is plain torch, so
autograd differentiates it and torch's own GEMMs run the projections; so are the two things
the kernels lack: the convolution's per-step masks of ``seq_idx`` (``_conv_packed``) and the
split at ``cu_seqlens`` (one scan per packed sequence). The kernels read
(B, L, D) rows with channels contiguous; a (B, D, L) tensor that is a transposed view of such
rows (as ``in_proj(x).transpose(1, 2)`` is) passes without a copy (the convolution also
reads the x half of xz in place, its rows 2D apart), a contiguous (B, D, L) tensor is
transposed once. ``selective_state_update`` is the scan of one step from a given
state, ``causal_conv1d_update`` the convolution over the kept window plus the new steps.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from mamba_ext.cpu import steps as _steps
from mamba_ext.cpu.block import SCAN_CHUNK

__all__ = ["selective_scan_fn", "mamba_inner_fn", "selective_state_update",
           "causal_conv1d_fn", "causal_conv1d_update"]

# float32 and float64 run as they are; float16 and bfloat16 are computed in float32 (as
# mamba_ssm's selective_scan_ref does) and the results returned in the input's dtype
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_tensor(name: str, t, ndim: tuple[int, ...] | None = None, optional: bool = False):
    """A CPU real floating tensor of one of the given ranks, or a clear error."""
    if t is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: mamba_ext.torch runs on the CPU; got a tensor on {t.device} "
                         f"(move it with .cpu(), or use mamba_ssm's CUDA kernels there)")
    if t.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (mamba_ext is real-valued: "
                        f"A must be a real (D, N) tensor)")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a floating tensor (float32, float64, float16 or "
                        f"bfloat16), got {t.dtype}")
    if ndim is not None and t.dim() not in ndim:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndim))} dimensions, "
                         f"got shape {tuple(t.shape)}")
    return t


def _shape(name: str, t, want: tuple[int, ...]) -> None:
    if t is not None and tuple(t.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)}, got {tuple(t.shape)}")


def _np(t: torch.Tensor):
    """The NumPy view of a C-contiguous CPU tensor's memory (no copy)."""
    return t.detach().numpy()


def _threads() -> int:
    return max(1, torch.get_num_threads())


# ----------------------------------------------------------------- the two kernels

def _scan_forward(u, delta, A, Bs, Cs, Dv, h0, h_last=None):
    """The scan kernel: y (B, L, D), h_last (B, D, N) (written; may be h0 itself) and hstate
    (B, ceil(L/T), D, N) of u, delta (B, L, D), A (D, N), Bs, Cs (B, L, N), Dv (D,), h0
    (B, D, N) or None (zeros). All C-contiguous, one dtype."""
    Bn, L, D = u.shape
    N = A.shape[1]
    y = torch.empty_like(u)
    if h_last is None:
        h_last = torch.empty((Bn, D, N), dtype=u.dtype)
    hstate = torch.empty((Bn, (L + SCAN_CHUNK - 1) // SCAN_CHUNK, D, N), dtype=u.dtype)
    if L == 0 or Bn * D * N == 0:
        y.zero_()
        h_last.copy_(h0) if h0 is not None else h_last.zero_()
    else:
        if h_last is h0 and not bool((_np(A) < 0).all()):   # in place: check before writing
            _bad_A(A)
        try:
            _steps.scan_forward(_np(y), _np(hstate), _np(u), _np(delta), _np(Bs), _np(Cs),
                                _np(A), _np(Dv), "euler",
                                h0=_np(h0) if h0 is not None else None, h_last=_np(h_last),
                                n_threads=_threads(), a_given=True)
        except ValueError as e:
            if "a_given" in str(e):     # the kernel found an A that is not negative
                _bad_A(A)
            raise
    return y, h_last, hstate


def _bad_A(A):
    raise ValueError("A: expected negative values (A = -exp(A_log)); got "
                     f"min {A.min().item()!r}, max {A.max().item()!r}") from None


class _Scan(torch.autograd.Function):
    """y (B, L, D), h_last (B, D, N) = the Euler selective scan of u, delta (B, L, D) with
    A (D, N), Bs, Cs (B, L, N), Dv (D,) and the state h0 (B, D, N) before step 0 (or None:
    zeros). All C-contiguous, one dtype. The forward stores only the states entering each
    chunk of SCAN_CHUNK steps, hstate (B, ceil(L/T), D, N)."""

    @staticmethod
    def forward(ctx, u, delta, A, Bs, Cs, Dv, h0):
        y, h_last, hstate = _scan_forward(u, delta, A, Bs, Cs, Dv, h0)
        ctx.save_for_backward(u, delta, A, Bs, Cs, Dv, hstate)
        ctx.has_h0 = h0 is not None
        return y, h_last

    @staticmethod
    def backward(ctx, dy, dh_last):
        u, delta, A, Bs, Cs, Dv, hstate = ctx.saved_tensors
        Bn, L, D = u.shape
        du, ddelta = torch.zeros_like(u), torch.zeros_like(u)
        dBs, dCs = torch.zeros_like(Bs), torch.zeros_like(Cs)
        dA, dDv = torch.zeros_like(A), torch.zeros_like(Dv)
        dh0 = torch.zeros((Bn, D, A.shape[1]), dtype=u.dtype) if ctx.has_h0 else None
        if L == 0 or Bn * D * A.shape[1] == 0:
            if dh0 is not None and dh_last is not None:
                dh0 += dh_last
        else:
            dy = torch.zeros_like(u) if dy is None else dy.contiguous()
            dhl = None if dh_last is None else dh_last.contiguous()
            _steps.scan_backward(_np(du), _np(ddelta), _np(dBs), _np(dCs), _np(dA), _np(dDv),
                                 _np(dy), _np(hstate), _np(u), _np(delta), _np(Bs), _np(Cs),
                                 _np(A), _np(Dv), "euler",
                                 dh_last=_np(dhl) if dhl is not None else None,
                                 dh0=_np(dh0) if dh0 is not None else None,
                                 n_threads=_threads(), a_given=True)
        return du, ddelta, dA, dBs, dCs, dDv, dh0


def _grad(*tensors) -> bool:
    """Whether autograd must record: grad mode on and some input needs a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _conv_forward(x, w, bias):
    out = torch.empty_like(x)
    _steps.conv1d_forward(_np(out), _np(x), _np(w), _np(bias))
    return out


class _Conv(torch.autograd.Function):
    """out (B, L, D) = bias + sum_k w[:, k] * x[t - k]: the causal depthwise convolution of
    x (B, L, D) with taps w (D, K) in lag order (w[:, 0] multiplies the current step) and
    bias (D,); zero history before t = 0. One dtype; w, bias C-contiguous, x with evenly
    spaced rows of contiguous channels (a view of xz's x half is read in place)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(x, w)
        return _conv_forward(x, w, bias)

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        dbias = torch.zeros(w.shape[0], dtype=w.dtype)
        _steps.conv1d_backward(_np(dx), _np(dw), _np(dbias), _np(dout.contiguous()), _np(x), _np(w))
        return dx, dw, dbias


def _rows(t: torch.Tensor, dtype) -> torch.Tensor:
    """(B, D, L) -> its (B, L, D) rows, C-contiguous, of `dtype` (a view where it can be)."""
    return t.transpose(1, 2).to(dtype).contiguous()


def _compute_dtype(*tensors) -> torch.dtype:
    """The dtype the kernels run in: float64 if the tensors promote to it, else float32
    (the kernels have no half-precision form)."""
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return torch.float64 if dt == torch.float64 else torch.float32


def _groups_of(t, Dn: int) -> int:
    """The groups of channels of B or C in mamba_ssm's three forms: (D, N), constant over
    batch and time, D groups of one channel; (B, N, L) one group; (B, G, N, L) G groups of
    D/G consecutive channels."""
    return Dn if t.dim() == 2 else 1 if t.dim() == 3 else t.shape[1]


def _check_bc(name: str, t, Bn: int, Dn: int, N: int, L: int) -> None:
    G = _groups_of(t, Dn)
    if t.dim() == 4 and (G < 1 or Dn % G):
        raise ValueError(f"{name}: its {G} groups must divide D = {Dn} channels")
    _shape(name, t, {2: (Dn, N), 3: (Bn, N, L), 4: (Bn, G, N, L)}[t.dim()])


def _is_int_tensor(t) -> bool:
    """Whether t is a torch tensor of an integer dtype (not bool)."""
    return (isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
            and t.dtype != torch.bool)


def _segments(cu_seqlens, L: int) -> list[tuple[int, int]]:
    """The (start, end) time ranges of packed sequences: cu_seqlens (S + 1,) integers
    0 = c_0 <= c_1 <= ... <= c_S = L (mamba_ssm's varlen form: the state restarts from zero
    at every c_i); None: one sequence of L steps."""
    if cu_seqlens is None:
        return [(0, L)]
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or not _is_int_tensor(cu_seqlens):
            raise ValueError(f"cu_seqlens: expected a 1-D integer tensor, got {cu_seqlens.dtype} "
                             f"of shape {tuple(cu_seqlens.shape)}")
        c = [int(v) for v in cu_seqlens.tolist()]
    else:
        try:
            c = [operator.index(v) for v in cu_seqlens if type(v) is not bool]
            if len(c) != len(cu_seqlens):
                raise TypeError
        except TypeError:
            raise ValueError(f"cu_seqlens: expected a 1-D integer tensor or a sequence of ints, "
                             f"got {type(cu_seqlens).__name__}") from None
    if len(c) < 2 or c[0] != 0 or c[-1] != L or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to L = {L}, got {c}")
    return [(a, b) for a, b in zip(c, c[1:]) if b > a] or [(0, L)]


# ----------------------------------------------------------------- mamba_ssm's API

def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, cu_seqlens=None):
    """mamba_ssm's ``selective_scan_fn`` on the CPU, with gradients for every tensor input.

    u, delta, z: (B, D, L); A: (D, N), real (any values: not clamped; the exact Euler step
    of mamba_ssm, a_bar = exp(delta A), b_bar = delta B); B, C: (B, N, L), (B, G, N, L)
    (G groups of D/G consecutive channels) or (D, N) (constant over batch and time; one
    kernel call per channel); D, delta_bias: (D,). delta becomes softplus(delta +
    delta_bias) when ``delta_softplus``. cu_seqlens (S + 1,): packed sequences, the state
    restarting from zero at each offset (0 first, L last). Returns out (B, D, L) = (scan +
    D u) * silu(z), in the dtype of u, and with ``return_last_state`` also the state after
    the last step, (B, D, N). CPU tensors: float64 runs in float64, everything else in
    float32 (float16 and bfloat16 as mamba_ssm's reference does: upcast, the result cast
    back to u's dtype).
    """
    u = _check_tensor("u", u, (3,))
    delta = _check_tensor("delta", delta, (3,))
    A = _check_tensor("A", A, (2,))
    B = _check_tensor("B", B, (2, 3, 4))
    C = _check_tensor("C", C, (2, 3, 4))
    Bn, Dn, L = u.shape
    N = A.shape[1]
    _shape("delta", delta, (Bn, Dn, L))
    _shape("A", A, (Dn, N))
    _check_bc("B", B, Bn, Dn, N, L)
    _check_bc("C", C, Bn, Dn, N, L)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        _shape(name, _check_tensor(name, t, (1,), optional=True), (Dn,))
    _shape("z", _check_tensor("z", z, (3,), optional=True), (Bn, Dn, L))
    ct = _compute_dtype(u, delta)
    outs, last = [], None
    for t0, t1 in _segments(cu_seqlens, L):
        tt = slice(t0, t1)
        out, last = _scan(u[..., tt], delta[..., tt], A, B if B.dim() == 2 else B[..., tt],
                          C if C.dim() == 2 else C[..., tt], D, delta_bias, delta_softplus,
                          None, ct)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if z is not None:
        out = out * F.silu(z.to(ct))
    out = out.to(u.dtype)
    return (out, last) if return_last_state else out


def _scan(u, delta, A, B, C, D, delta_bias, softplus, h0, ct):
    """The scan of (B, D, L) inputs with B and C of _groups_of's forms: one kernel call per
    group of channels (the groups of B and of C refined into one partition). Returns out
    (B, D, L) (before the z gate) and the last state (B, D, N)."""
    Bn, Dn, L = u.shape
    delta = delta.to(ct)
    if delta_bias is not None:
        delta = delta + delta_bias.to(ct)[:, None]
    if softplus:
        delta = F.softplus(delta)
    Dv = torch.zeros(Dn, dtype=ct) if D is None else D.to(ct)
    ut, dt, A = _rows(u, ct), _rows(delta, ct), A.to(ct)
    N = A.shape[1]
    gb, gc = _groups_of(B, Dn), _groups_of(C, Dn)
    G = gb * gc // math.gcd(gb, gc) if Dn else 1     # both divide Dn, so their lcm does
    Dg = Dn // G
    # (B, L, N) rows of B and C: of the whole batch (B, N, L), once; else per group below
    Bw, Cw = (_rows(t, ct) if t.dim() == 3 else None for t in (B, C))

    def rows_of(t, k, g):        # rows of B or C (k groups) for channel group g of G
        if t.dim() == 2:                                   # (D, N): channel g (G == D)
            return t[g].to(ct)[None, None].expand(Bn, L, N).contiguous()
        return _rows(t[:, g * k // G], ct)

    ys, lasts = [], []
    for g in range(G):
        s = slice(g * Dg, (g + 1) * Dg)
        Bg = Bw if Bw is not None else rows_of(B, gb, g)
        Cg = Cw if Cw is not None else rows_of(C, gc, g)
        if G == 1:
            ug, dg = ut, dt
        else:
            ug, dg = ut[:, :, s].contiguous(), dt[:, :, s].contiguous()
        hg = None if h0 is None else h0[:, s].to(ct).contiguous()
        args = (ug, dg, A[s].contiguous(), Bg, Cg, Dv[s].contiguous(), hg)
        y, last = _Scan.apply(*args) if _grad(*args) else _scan_forward(*args)[:2]
        ys.append(y)
        lasts.append(last)
    y = ys[0] if G == 1 else torch.cat(ys, dim=2)
    last = lasts[0] if G == 1 else torch.cat(lasts, dim=1)
    return y.transpose(1, 2), last


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                   out_proj_weight, out_proj_bias, A, B=None, C=None, D=None, delta_bias=None,
                   B_proj_bias=None, C_proj_bias=None, delta_softplus=True, cu_seqlens=None,
                   seq_idx=None, checkpoint_lvl=1):
    """mamba_ssm's ``mamba_inner_fn``: the Mamba mixer after ``in_proj``, on the CPU.

    xz (B, 2D, L) = in_proj's output (x then z); conv1d_weight (D, 1, K) or (D, K);
    conv1d_bias (D,) or None; x_proj_weight (R + 2N, D) (without B/C when they are given);
    delta_proj_weight (D, R); out_proj_weight (Dm, D); out_proj_bias (Dm,) or None; A (D, N);
    B, C: None (from x_proj, plus B_proj_bias / C_proj_bias) or as in selective_scan_fn;
    D, delta_bias (D,). Packed sequences as mamba_ssm takes them: ``seq_idx`` (B, L) for the
    convolution (causal_conv1d_fn) and ``cu_seqlens`` for the scan (selective_scan_fn).
    ``checkpoint_lvl`` (0 or 1; earlier mamba_ssm releases take it here) changes nothing:
    the scan's backward always recomputes from its chunk states. Returns (B, L, Dm).
    """
    if checkpoint_lvl not in (0, 1) or isinstance(checkpoint_lvl, bool):
        raise ValueError(f"checkpoint_lvl: expected 0 or 1, got {checkpoint_lvl!r}")
    return mamba_inner_with_state(xz, conv1d_weight, conv1d_bias, x_proj_weight,
                                  delta_proj_weight, out_proj_weight, out_proj_bias, A, B, C, D,
                                  delta_bias, B_proj_bias, C_proj_bias, delta_softplus, False,
                                  cu_seqlens, seq_idx)


def mamba_inner_with_state(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                           out_proj_weight, out_proj_bias, A, B, C, D, delta_bias, B_proj_bias,
                           C_proj_bias, delta_softplus, return_last_state, cu_seqlens=None,
                           seq_idx=None):
    """mamba_inner_fn, and with return_last_state also the scan's last state (B, D, N)."""
    xz = _check_tensor("xz", xz, (3,))
    A = _check_tensor("A", A, (2,))
    Bn, D2, L = xz.shape
    if D2 % 2:
        raise ValueError(f"xz: expected (B, 2D, L) with an even channel count, got {tuple(xz.shape)}")
    Dn, N = D2 // 2, A.shape[1]
    _shape("A", A, (Dn, N))
    w = _check_tensor("conv1d_weight", conv1d_weight, (2, 3))
    if w.dim() == 3:
        if w.shape[1] != 1:
            raise ValueError(f"conv1d_weight: expected (D, 1, K) or (D, K), got {tuple(w.shape)}")
        w = w[:, 0]
    xpw = _check_tensor("x_proj_weight", x_proj_weight, (2,))
    dpw = _check_tensor("delta_proj_weight", delta_proj_weight, (2,))
    opw = _check_tensor("out_proj_weight", out_proj_weight, (2,))
    R = dpw.shape[1]
    _shape("delta_proj_weight", dpw, (Dn, R))
    nbc = (N if B is None else 0) + (N if C is None else 0)
    _shape("x_proj_weight", xpw, (R + nbc, Dn))
    if opw.shape[1] != Dn:
        raise ValueError(f"out_proj_weight: expected (Dm, {Dn}), got {tuple(opw.shape)}")
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_fn(x, w, conv1d_bias, seq_idx=seq_idx, activation="silu")   # (B, D, L)
    x_dbl = F.linear(x.transpose(1, 2), xpw.to(x.dtype))                  # (B, L, R + nbc)
    delta = F.linear(x_dbl[..., :R], dpw.to(x.dtype)).transpose(1, 2)     # (B, D, L)
    k = R
    if B is None:
        B = x_dbl[..., k:k + N]
        if B_proj_bias is not None:
            B = B + B_proj_bias.to(B.dtype)
        B = B.transpose(1, 2)                                             # (B, N, L)
        k += N
    if C is None:
        C = x_dbl[..., k:k + N]
        if C_proj_bias is not None:
            C = C + C_proj_bias.to(C.dtype)
        C = C.transpose(1, 2)
    y = selective_scan_fn(x, delta, A, B, C, D, z=z, delta_bias=delta_bias,
                          delta_softplus=delta_softplus, return_last_state=return_last_state,
                          cu_seqlens=cu_seqlens)
    y, last = y if return_last_state else (y, None)
    bias = None if out_proj_bias is None else out_proj_bias.to(y.dtype)
    out = F.linear(y.transpose(1, 2), opw.to(y.dtype), bias)
    return (out, last) if return_last_state else out


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """mamba_ssm's ``selective_state_update``: one recurrent step, the state updated in place.

    state (B, D, N); x, dt, z (B, D); A (D, N); B, C (B, N) or (B, G, N); D, dt_bias (D,).
    Returns out (B, D) = (C . state_new + D x) * silu(z). Gradients flow to every input,
    the state's old value included (the in-place write itself is not recorded).
    """
    state = _check_tensor("state", state, (3,))
    x = _check_tensor("x", x, (2,))
    Bn, Dn, N = state.shape
    _shape("x", x, (Bn, Dn))
    _shape("dt", _check_tensor("dt", dt, (2,)), (Bn, Dn))
    _shape("A", _check_tensor("A", A, (2,)), (Dn, N))
    B = _check_tensor("B", B, (2, 3))
    C = _check_tensor("C", C, (2, 3))
    want = (Bn, N) if B.dim() == 2 else (Bn, B.shape[1], N)
    _shape("B", B, want)
    _shape("C", C, want)
    if B.dim() == 3 and (B.shape[1] < 1 or Dn % B.shape[1]):
        raise ValueError(f"B: its {B.shape[1]} groups must divide D = {Dn} channels")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        _shape(name, _check_tensor(name, t, (1,), optional=True), (Dn,))
    _shape("z", _check_tensor("z", z, (2,), optional=True), (Bn, Dn))
    ct = _compute_dtype(x, dt)
    if (B.dim() == 2 and state.dtype == ct and state.is_contiguous()
            and not _grad(state, x, dt, A, B, C, D, z, dt_bias)):
        # no autograd: the kernel updates the state in place (h0 and h_last are one buffer)
        d = dt.to(ct)
        if dt_bias is not None:
            d = d + dt_bias.to(ct)
        if dt_softplus:
            d = F.softplus(d)
        Dv = torch.zeros(Dn, dtype=ct) if D is None else D.to(ct).contiguous()
        y, _, _ = _scan_forward(x.to(ct).contiguous()[:, None], d.contiguous()[:, None],
                                A.to(ct).contiguous(), B.to(ct).contiguous()[:, None],
                                C.to(ct).contiguous()[:, None], Dv, state, h_last=state)
        out = y[:, 0]
        if z is not None:
            out = out * F.silu(z.to(ct))
        return out.to(x.dtype)
    out, new = _scan(x[..., None], dt[..., None], A, B[..., None], C[..., None], D, dt_bias,
                     dt_softplus, state, ct)
    out = out[..., 0]
    with torch.no_grad():
        state.copy_(new)
    if z is not None:
        out = out * F.silu(z.to(ct))
    return out.to(x.dtype)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    """causal-conv1d's ``causal_conv1d_fn`` on the CPU: x (B, D, L), weight (D, K), bias (D,)
    or None; out[:, :, t] = bias + sum_j weight[:, j] x[:, :, t - K + 1 + j] (zeros, or
    initial_states (B, D, K-1), before t = 0), then silu when activation is "silu"/"swish".
    With ``return_final_states``: also the last K-1 inputs (B, D, K-1) (written into
    final_states_out when given). seq_idx (B, L) integers: packed sequences as causal-conv1d
    takes them: a step sees only the earlier steps of its own index, and a step of negative
    index (padding) is 0 (not with initial_states or return_final_states)."""
    x = _check_tensor("x", x, (3,))
    weight = _check_tensor("weight", weight, (2,))
    Bn, Dn, L = x.shape
    K = weight.shape[1]
    _shape("weight", weight, (Dn, K))
    _shape("bias", _check_tensor("bias", bias, (1,), optional=True), (Dn,))
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    ct = _compute_dtype(x, weight)
    if seq_idx is not None:
        if initial_states is not None or return_final_states:
            raise ValueError("seq_idx: not with initial_states or return_final_states "
                             "(as in causal-conv1d)")
        out = _conv_packed(x.to(ct), weight.to(ct), bias, _seq_idx(seq_idx, Bn, L), ct)
        return (F.silu(out) if activation is not None else out).to(x.dtype)
    xs = x.to(ct)
    if initial_states is not None:
        _shape("initial_states", _check_tensor("initial_states", initial_states, (3,)),
               (Bn, Dn, K - 1))
        xs = torch.cat([initial_states.to(ct), xs], dim=2)
    out = _conv(xs, weight, bias, ct)
    if initial_states is not None:
        out = out[:, :, K - 1:]
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    padded = F.pad(xs, (K - 1, 0))                                 # zeros before t = 0
    tail = padded[:, :, padded.shape[2] - (K - 1):].to(x.dtype)    # (B, D, K-1)
    if final_states_out is not None:
        _shape("final_states_out", final_states_out, (Bn, Dn, K - 1))
        with torch.no_grad():
            final_states_out.copy_(tail)
        return out, final_states_out
    return out, tail


def _conv(xs, weight, bias, ct):
    """(B, D, L) -> (B, D, L): our kernel on the (B, L, D) rows (taps flipped to lag order)."""
    Dn = xs.shape[1]
    b = torch.zeros(Dn, dtype=ct) if bias is None else bias.to(ct)
    rows = xs.transpose(1, 2).to(ct)                 # (B, L, D): a view of xz's x columns
    if not (rows.stride(2) == 1 and rows.stride(1) >= rows.shape[2]
            and rows.stride(0) == rows.shape[1] * rows.stride(1)):
        rows = rows.contiguous()                     # the kernel reads evenly spaced rows
    args = (rows, weight.to(ct).flip(-1).contiguous(), b.contiguous())
    out = _Conv.apply(*args) if _grad(*args) else _conv_forward(*args)
    return out.transpose(1, 2)


def _seq_idx(seq_idx, Bn: int, L: int) -> torch.Tensor:
    if not _is_int_tensor(seq_idx):
        raise TypeError(f"seq_idx: expected an integer torch.Tensor (B, L), got "
                        f"{getattr(seq_idx, 'dtype', type(seq_idx).__name__)}")
    _shape("seq_idx", seq_idx, (Bn, L))
    return seq_idx.to("cpu", torch.int64)


def _conv_packed(x, weight, bias, seq_idx, ct):
    """The convolution of x (B, D, L) over packed sequences: out[:, :, t] = bias + sum_j
    weight[:, j] x[:, :, t - k] (k = K - 1 - j) over the steps t - k >= 0 with seq_idx[t - k]
    == seq_idx[t]; 0 where seq_idx[t] < 0. Torch's elementwise ops, one masked term per tap:
    the masks are what the kernel lacks."""
    K, L = weight.shape[1], x.shape[2]
    out = torch.zeros_like(x) if bias is None else bias.to(ct)[:, None].expand_as(x).clone()
    for k in range(min(K, L)):                        # lag k: weight column K - 1 - k
        same = (seq_idx[:, k:] == seq_idx[:, :L - k])[:, None]           # (B, 1, L - k)
        term = weight[:, K - 1 - k, None] * x[:, :, :L - k]
        out = out + F.pad(torch.where(same, term, torch.zeros((), dtype=ct)), (k, 0))
    return torch.where((seq_idx < 0)[:, None], torch.zeros((), dtype=ct), out)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """causal-conv1d's ``causal_conv1d_update``: x (B, D) or (B, D, L) new steps, conv_state
    (B, D, S) the last S >= K-1 inputs, updated in place (now ending with x); weight (D, K);
    returns the convolution at the new steps, shaped like x. cache_seqlens and
    conv_state_indices are not supported."""
    if cache_seqlens is not None or conv_state_indices is not None:
        raise ValueError("cache_seqlens / conv_state_indices: not supported by mamba_ext.torch")
    x = _check_tensor("x", x, (2, 3))
    conv_state = _check_tensor("conv_state", conv_state, (3,))
    weight = _check_tensor("weight", weight, (2,))
    one = x.dim() == 2
    xs = x[..., None] if one else x
    Bn, Dn, L = xs.shape
    K = weight.shape[1]
    S = conv_state.shape[2]
    _shape("weight", weight, (Dn, K))
    _shape("bias", _check_tensor("bias", bias, (1,), optional=True), (Dn,))
    if conv_state.shape[:2] != (Bn, Dn) or S < K - 1:
        raise ValueError(f"conv_state: expected ({Bn}, {Dn}, S) with S >= {K - 1}, "
                         f"got {tuple(conv_state.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    ct = _compute_dtype(xs, weight)
    seq = torch.cat([conv_state.to(ct), xs.to(ct)], dim=2)       # (B, D, S + L)
    out = _conv(seq, weight, bias, ct)[:, :, S:]
    with torch.no_grad():
        conv_state.copy_(seq[:, :, L:])
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    return out[..., 0] if one else out
