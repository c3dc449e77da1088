"""mamba_ext.torch's mamba_ssm / causal-conv1d functions: float64 gradcheck, an independent
float64 reference of mamba_ssm's maths (selective_scan_ref's recurrence), no clamp of A,
the recurrent step against the scan, the convolution against torch's conv1d, errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import optional

torch = optional("torch", "the PyTorch interface needs torch (pip install torch)")
F = torch.nn.functional
from torch.autograd import gradcheck  # noqa: E402

from mamba_ext.torch import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_inner_fn,
    selective_scan_fn,
    selective_state_update,
)

f64 = torch.float64


def scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, cu_seqlens=()):
    """mamba_ssm's selective_scan_ref recurrence, in the inputs' dtype (float64 here): B, C
    (D, N), (B, N, L) or (B, G, N, L); the state restarts from zero at each cu_seqlens offset."""
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    b, d, L = u.shape

    def per_channel(T):                              # (b, d, N, L)
        if T.dim() == 2:
            return T[None, :, :, None].expand(b, d, T.shape[1], L)
        if T.dim() == 3:
            return T[:, None].expand(b, d, *T.shape[1:])
        return T.repeat_interleave(d // T.shape[1], dim=1)
    B, C = per_channel(B), per_channel(C)
    resets = set(list(cu_seqlens)[1:-1])
    x = torch.zeros(b, d, A.shape[1], dtype=u.dtype)
    ys = []
    for t in range(L):
        if t in resets:
            x = torch.zeros_like(x)
        x = torch.exp(delta[:, :, t, None] * A) * x + delta[:, :, t, None] * B[..., t] * u[:, :, t, None]
        ys.append((x * C[..., t]).sum(-1))
    y = torch.stack(ys, dim=2)
    out = y if D is None else y + u * D[:, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, x) if return_last_state else out


def _inputs(b=2, d=6, L=70, n=3, groups=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64)   # noqa: E731
    bc = (b, n, L) if groups is None else (b, groups, n, L)
    return dict(u=r(b, d, L), delta=torch.rand(b, d, L, generator=g, dtype=f64),
                A=-(torch.rand(d, n, generator=g, dtype=f64) * 2 + 0.1), B=r(*bc), C=r(*bc),
                D=r(d), z=r(b, d, L), delta_bias=r(d) * 0.1)


@pytest.mark.parametrize("groups", [None, 3])
def test_scan_matches_the_float64_reference(groups):
    a = _inputs(groups=groups)     # L 70 > one chunk of the CPU scan
    out, last = selective_scan_fn(**a, delta_softplus=True, return_last_state=True)
    ref, ref_last = scan_ref(**a, delta_softplus=True, return_last_state=True)
    assert out.shape == (2, 6, 70) and last.shape == (2, 6, 3)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12 * ref.abs().max())
    assert torch.allclose(last, ref_last, rtol=0, atol=1e-12 * ref_last.abs().max())


def test_A_is_not_clamped():
    """A far outside the block's A_log clamp (A_log in (-10, 5)): -1e-7 and -400."""
    a = _inputs(d=4, n=2, L=9)
    a["A"] = torch.tensor([[-1e-7, -400.0], [-1e-5, -200.0], [-0.5, -1.0], [-3.0, -150.0]], dtype=f64)
    assert torch.allclose(selective_scan_fn(**a), scan_ref(**a), rtol=1e-12, atol=1e-12)
    A = a.pop("A").clone()
    A[0, 0] = -1e-4               # gradcheck steps A by 1e-6: keep it negative
    assert gradcheck(lambda A: selective_scan_fn(A=A, **a), (A.requires_grad_(),))


@pytest.mark.parametrize("case", ["full", "grouped", "bare"])
def test_scan_gradcheck(case):
    a = _inputs(b=2, d=4, L=67, n=2, groups=2 if case == "grouped" else None)
    if case == "bare":                     # no D, no z, no delta_bias, no softplus
        a = {k: a[k] for k in ("u", "delta", "A", "B", "C")}
    names = list(a)
    ts = [a[k].clone().requires_grad_() for k in names]

    def f(*ts):
        out = selective_scan_fn(**dict(zip(names, ts)), delta_softplus=case != "bare",
                                return_last_state=True)
        return out
    assert gradcheck(f, ts)


@pytest.mark.parametrize("forms", [("const", "whole"), ("const", "const"), ((3,), (2,)),
                                   ("whole", (6,))])
@pytest.mark.parametrize("cu", [None, [0, 10, 10, 45, 70], [0, 1, 70]])
def test_constant_and_differently_grouped_B_C_and_packed_sequences(forms, cu):
    """B, C as (D, N), (B, N, L) or (B, G, N, L), each its own form; cu_seqlens restarts the
    state (an empty sequence, one of one step); against the float64 recurrence."""
    a = _inputs()
    g = torch.Generator().manual_seed(5)
    shape = {"const": (6, 3), "whole": (2, 3, 70), (3,): (2, 3, 3, 70), (2,): (2, 2, 3, 70),
             (6,): (2, 6, 3, 70)}
    a["B"], a["C"] = (torch.randn(*shape[f], generator=g, dtype=f64) for f in forms)
    cs = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    out, last = selective_scan_fn(**a, delta_softplus=True, return_last_state=True, cu_seqlens=cs)
    ref, ref_last = scan_ref(**a, delta_softplus=True, return_last_state=True, cu_seqlens=cu or ())
    assert torch.allclose(out, ref, rtol=0, atol=1e-12 * ref.abs().max())
    assert torch.allclose(last, ref_last, rtol=0, atol=1e-12 * ref_last.abs().max())


def test_constant_B_and_packed_sequences_gradcheck():
    a = _inputs(b=2, d=4, L=20, n=2, groups=2)
    a["B"] = torch.randn(4, 2, dtype=f64)
    names = list(a)
    ts = [a[k].clone().requires_grad_() for k in names]
    assert gradcheck(lambda *ts: selective_scan_fn(**dict(zip(names, ts)), delta_softplus=True,
                                                   return_last_state=True, cu_seqlens=[0, 7, 20]), ts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_in_float32_like_the_reference(dtype):
    """selective_scan_ref upcasts u, delta, B, C to float32 and returns u's dtype: the same
    here, against the float64 recurrence of the rounded inputs, within the output's rounding."""
    a = {k: v.to(dtype) for k, v in _inputs(d=4, L=40).items()}
    a["A"], a["D"] = a["A"].float(), a["D"].float()
    u = a["u"].clone().requires_grad_()
    out = selective_scan_fn(**{**a, "u": u}, delta_softplus=True)
    ref = scan_ref(**{k: v.double() for k, v in a.items()}, delta_softplus=True)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert torch.allclose(out.double(), ref, rtol=0, atol=2 * eps * ref.abs().max())
    out.float().sum().backward()
    assert u.grad.dtype == dtype and torch.isfinite(u.grad.float()).all()


def test_causal_conv1d_fn_over_packed_sequences():
    """seq_idx as causal-conv1d reads it: only earlier steps of the same index count (also
    an index seen again after another one), a negative index gives 0; gradcheck."""
    g = torch.Generator().manual_seed(6)
    x, w, b = (torch.randn(*s, generator=g, dtype=f64) for s in ((2, 5, 12), (5, 4), (5,)))
    si = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 1, 0, 0, -1, -1, 3, 3, 3, 3, 3]])
    out = causal_conv1d_fn(x, w, b, seq_idx=si, activation="silu")
    want = torch.zeros_like(x)
    for i in range(2):
        for t in range(12):
            if si[i, t] >= 0:
                terms = [w[:, j] * x[i, :, t - 3 + j] for j in range(4)
                         if t - 3 + j >= 0 and si[i, t - 3 + j] == si[i, t]]
                want[i, :, t] = F.silu(b + sum(terms))
    assert torch.allclose(out, want, rtol=0, atol=1e-14)
    # one index throughout is the plain convolution
    assert torch.allclose(causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(2, 12, dtype=torch.int32)),
                          causal_conv1d_fn(x, w, b), rtol=0, atol=1e-14)
    ts = [t.clone().requires_grad_() for t in (x, w, b)]
    assert gradcheck(lambda x, w, b: causal_conv1d_fn(x, w, b, seq_idx=si, activation="silu"), ts)


def test_mamba_inner_fn_over_packed_sequences_is_each_sequence_alone():
    """Two sequences packed into one row (seq_idx for the conv, cu_seqlens for the scan) give
    what each gives alone."""
    g = torch.Generator().manual_seed(7)
    Dm, d, n, R, K = 3, 4, 2, 2, 3
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64) * 0.5   # noqa: E731
    w = (r(d, 1, K), r(d), r(R + 2 * n, d), r(d, R), r(Dm, d), r(Dm),
         -torch.rand(d, n, generator=g, dtype=f64) - 0.2, None, None, r(d), r(d))
    xz1, xz2 = r(1, 2 * d, 7), r(1, 2 * d, 5)
    packed = mamba_inner_fn(torch.cat([xz1, xz2], 2), *w, cu_seqlens=[0, 7, 12],
                            seq_idx=torch.tensor([[0] * 7 + [1] * 5], dtype=torch.int32))
    alone = torch.cat([mamba_inner_fn(xz1, *w), mamba_inner_fn(xz2, *w, checkpoint_lvl=0)], 1)
    assert torch.allclose(packed, alone, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        mamba_inner_fn(xz1, *w, checkpoint_lvl=2)


def test_state_update_is_one_scan_step_and_chains():
    a = _inputs(b=2, d=4, L=5, n=3)
    ref, last = scan_ref(**a, delta_softplus=True, return_last_state=True)
    state = torch.zeros(2, 4, 3, dtype=f64)
    outs = [selective_state_update(state, a["u"][..., t], a["delta"][..., t], a["A"], a["B"][..., t],
                                   a["C"][..., t], a["D"], z=a["z"][..., t], dt_bias=a["delta_bias"],
                                   dt_softplus=True) for t in range(5)]
    assert torch.allclose(torch.stack(outs, 2), ref, atol=1e-12)
    assert torch.allclose(state, last, atol=1e-12)


def test_state_update_gradcheck_including_the_old_state():
    a = _inputs(b=2, d=4, L=1, n=3)
    args = [torch.randn(2, 4, 3, dtype=f64), a["u"][..., 0], a["delta"][..., 0], a["A"],
            a["B"][..., 0], a["C"][..., 0], a["D"], a["z"][..., 0], a["delta_bias"]]
    args = [t.clone().requires_grad_() for t in args]

    def f(state, x, dt, A, B, C, D, z, b):
        return selective_state_update(state.clone(), x, dt, A, B, C, D, z=z, dt_bias=b, dt_softplus=True)
    assert gradcheck(f, args)


def _conv_ref(x, w, b, init=None):
    K = w.shape[1]
    xs = x if init is None else torch.cat([init, x], 2)
    out = F.conv1d(F.pad(xs, (K - 1, 0)), w[:, None], b, groups=x.shape[1])
    return out[:, :, -x.shape[2]:]


def test_causal_conv1d_fn_and_update_match_torch_conv1d():
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(2, 5, 11, generator=g, dtype=f64), torch.randn(5, 4, generator=g, dtype=f64),
               torch.randn(5, generator=g, dtype=f64))
    init = torch.randn(2, 5, 3, generator=g, dtype=f64)
    assert torch.allclose(causal_conv1d_fn(x, w, b), _conv_ref(x, w, b), atol=1e-13)
    out, final = causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True,
                                  activation="silu")
    assert torch.allclose(out, F.silu(_conv_ref(x, w, b, init)), atol=1e-13)
    assert torch.equal(final, x[:, :, -3:])
    state = torch.zeros(2, 5, 4, dtype=f64)          # transformers keeps K inputs
    steps = [causal_conv1d_update(x[:, :, t], state, w, b) for t in range(11)]
    assert torch.allclose(torch.stack(steps, 2), _conv_ref(x, w, b), atol=1e-13)
    assert torch.equal(state, x[:, :, -4:])
    ts = [t.clone().requires_grad_() for t in (x, w, b, init)]
    assert gradcheck(lambda x, w, b, i: causal_conv1d_fn(x, w, b, initial_states=i, activation="silu"), ts)
    st = torch.randn(2, 5, 4, generator=g, dtype=f64)
    ts = [t.clone().requires_grad_() for t in (x[:, :, :2], st, w, b)]
    assert gradcheck(lambda x, st, w, b: causal_conv1d_update(x, st.clone(), w, b, activation="silu"), ts)


def test_mamba_inner_fn_equals_its_composition_and_gradchecks():
    g = torch.Generator().manual_seed(4)
    b, Dm, d, n, R, K, L = 2, 3, 4, 2, 2, 3, 9
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64) * 0.5   # noqa: E731
    xz, cw, cb, xw, dw, ow, ob = r(b, 2 * d, L), r(d, 1, K), r(d), r(R + 2 * n, d), r(d, R), r(Dm, d), r(Dm)
    A, D, db = -torch.rand(d, n, generator=g, dtype=f64) - 0.2, r(d), r(d)
    out = mamba_inner_fn(xz, cw, cb, xw, dw, ow, ob, A, None, None, D, db)
    x, z = xz.chunk(2, 1)
    xc = F.silu(_conv_ref(x, cw[:, 0], cb))
    x_dbl = xc.transpose(1, 2) @ xw.t()
    delta = (x_dbl[..., :R] @ dw.t()).transpose(1, 2)
    y = scan_ref(xc, delta, A, x_dbl[..., R:R + n].transpose(1, 2), x_dbl[..., R + n:].transpose(1, 2), D, z,
                 db, True)
    assert torch.allclose(out, y.transpose(1, 2) @ ow.t() + ob, atol=1e-12)
    ts = [t.clone().requires_grad_() for t in (xz, cw, cb, xw, dw, ow, ob, A, D, db)]
    assert gradcheck(lambda xz, cw, cb, xw, dw, ow, ob, A, D, db:
                     mamba_inner_fn(xz, cw, cb, xw, dw, ow, ob, A, None, None, D, db), ts)


def test_float32_matches_float64_and_a_transposed_view_is_not_copied():
    a = _inputs()
    want = selective_scan_fn(**a, delta_softplus=True)
    a32 = {k: v.float() for k, v in a.items()}
    got = selective_scan_fn(**a32, delta_softplus=True)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-4 * want.abs().max())
    rows = a["u"].transpose(1, 2).contiguous()          # (B, L, D) rows
    u_view = rows.transpose(1, 2)                        # what in_proj(x).transpose(1, 2) gives
    assert torch.equal(selective_scan_fn(u_view, a["delta"], a["A"], a["B"], a["C"]),
                       selective_scan_fn(a["u"], a["delta"], a["A"], a["B"], a["C"]))
    from mamba_ext.torch.functions import _rows
    assert _rows(u_view, f64).data_ptr() == rows.data_ptr()


def test_bad_inputs_give_clear_errors():
    a = _inputs(d=4, n=2, L=5)
    with pytest.raises(ValueError, match="A: expected negative"):
        selective_scan_fn(**{**a, "A": a["A"].abs()})
    with pytest.raises(ValueError, match="A: expected negative"):
        selective_scan_fn(**{**a, "A": torch.where(a["A"] < -1, torch.nan, a["A"])})
    with pytest.raises(TypeError, match="A: complex"):
        selective_scan_fn(**{**a, "A": a["A"].to(torch.complex128)})
    with pytest.raises(TypeError, match="u: expected a floating tensor"):
        selective_scan_fn(**{**a, "u": a["u"].to(torch.int32)})
    with pytest.raises(ValueError, match=r"B: expected shape \(4, 2\)"):
        selective_scan_fn(**{**a, "B": a["B"][0]})
    for bad in ([0, 5, 3, 5], [1, 5], [0, 4], torch.tensor([0.0, 5.0]), [0, True, 5]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            selective_scan_fn(**a, cu_seqlens=bad)
    with pytest.raises(TypeError, match="seq_idx: expected an integer"):
        causal_conv1d_fn(a["u"], torch.zeros(4, 3, dtype=f64), seq_idx=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="seq_idx: expected shape"):
        causal_conv1d_fn(a["u"], torch.zeros(4, 3, dtype=f64), seq_idx=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="seq_idx: not with"):
        causal_conv1d_fn(a["u"], torch.zeros(4, 3, dtype=f64), seq_idx=torch.zeros(2, 5, dtype=torch.int64),
                         return_final_states=True)
    with pytest.raises(ValueError, match="on the CPU"):
        selective_scan_fn(**{**a, "u": a["u"].to("meta")})
    with pytest.raises(ValueError, match=r"B: expected shape"):
        selective_scan_fn(**{**a, "B": a["B"][:, :, :3]})
    with pytest.raises(ValueError, match="groups must divide"):
        bc3 = torch.zeros(2, 3, 2, 5, dtype=f64)
        selective_scan_fn(**{**a, "B": bc3, "C": bc3})
    with pytest.raises(TypeError, match="u: expected a torch.Tensor"):
        selective_scan_fn(**{**a, "u": a["u"].numpy()})
    state = torch.ones(2, 4, 2, dtype=f64)
    with pytest.raises(ValueError, match="A: expected negative"):
        selective_state_update(state, a["u"][..., 0], a["delta"][..., 0], -a["A"], a["B"][..., 0],
                               a["C"][..., 0])
    assert torch.equal(state, torch.ones(2, 4, 2, dtype=f64))     # not written
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(a["u"], torch.zeros(4, 3, dtype=f64), activation="relu")
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(a["u"][..., 0], torch.zeros(2, 4, 1, dtype=f64), torch.zeros(4, 3, dtype=f64))


def test_import_mamba_ext_does_not_import_torch():
    code = "import sys, mamba_ext, mamba_ext.block, mamba_ext.model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
