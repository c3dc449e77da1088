"""kernels/conv1d.wgsl (mamba_ext.gpu.conv1d) against the float64 reference step
reference.conv1d_forward (+ SiLU) and the float64 adjoint of the convolution."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import f32, nerr, read, require_gpu, run, upload
from mamba_ext.testing import reference

g = require_gpu()
from mamba_ext.gpu.conv1d import conv1d_backward, conv1d_forward  # noqa: E402


def conv1d_backward_ref(dconv, xc, w):
    """float64 adjoint of conv = bias + sum_k w[:, k] * xc[t-k]: (dxc, dw, db)."""
    B, L, D = xc.shape
    K = w.shape[1]
    dxc, dw = np.zeros_like(xc), np.zeros_like(w)
    for k in range(K):
        dxc[:, :L - k] += w[:, k] * dconv[:, k:]
        dw[:, k] = np.sum(dconv[:, k:] * xc[:, :L - k], axis=(0, 1))
    return dxc, dw, dconv.sum(axis=(0, 1))


@pytest.mark.parametrize("B,L,D,K", [(1, 1, 1, 1), (2, 3, 5, 4), (3, 37, 40, 4), (1, 70, 33, 2),
                                     (3, 200, 40, 4),    # M 600: 3 row blocks
                                     (2, 30, 70, 24),    # the largest dConv: tiles of 2 rows
                                     (5, 13, 65, 3)])    # 65 channels: a second group of 64
# Tolerance 2e-5 of the largest reference value: the golden rule (docs/semantics.md);
# a single-element case may cancel O(1) terms to a small result.
def test_conv1d_forward_backward(B, L, D, K):
    rng = np.random.default_rng(B * 100 + L + D + K)
    M = B * L
    Y = f32(rng, M, 2 * D)
    wConv, bConv = f32(rng, D, K, sd=0.5), f32(rng, D, sd=0.3)
    o = {"wConv": 2, "bConv": 2 + D * K}                  # offsets in the arena
    arena = np.concatenate([f32(rng, 2), wConv.ravel(), bConv])
    bY, bw = upload(g, "Y", Y), upload(g, "w", arena)
    u = g.buffer(M * D, "u")
    du = f32(rng, M, D)
    bdu = upload(g, "du", du)
    dY0 = f32(rng, M, 2 * D)
    dY = upload(g, "dY", dY0)
    gr0 = f32(rng, arena.size)
    gr = upload(g, "gr", gr0)
    run(g, [conv1d_forward(g, M, L, D, K, bY, bw, o, u),
            *conv1d_backward(g, M, L, D, K, bdu, bw, o, dY, bY, gr)])
    xc = Y[:, :D].reshape(B, L, D).astype(np.float64)
    ref_conv = reference.conv1d_forward(xc, wConv.astype(np.float64), bConv.astype(np.float64))
    assert nerr(read(g, u, (B, L, D)), reference.silu(ref_conv)) <= 2e-5
    s = reference.sigmoid(ref_conv)
    ref_dconv = du.reshape(B, L, D) * s * (1 + ref_conv * (1 - s))
    dxc, dw, db = conv1d_backward_ref(ref_dconv, xc, wConv.astype(np.float64))
    got_dY = read(g, dY, (M, 2 * D))
    assert nerr(got_dY[:, :D].reshape(B, L, D), dxc) <= 2e-5
    assert np.array_equal(got_dY[:, D:], dY0[:, D:])       # the z half is the gate's
    got = read(g, gr, (arena.size,)) - gr0.astype(np.float64)
    assert nerr(got[o["wConv"]:o["bConv"]].reshape(D, K), dw) <= 2e-5
    assert nerr(got[o["bConv"]:], db) <= 2e-5
    assert np.all(got[:2] == 0)


def test_conv1d_causal_per_sequence():
    """Step t of sequence b never sees sequence b-1: changing the last steps of
    sequence 0 leaves sequence 1 unchanged."""
    rng = np.random.default_rng(4)
    B, L, D, K = 2, 6, 3, 4
    M = B * L
    arena = np.concatenate([f32(rng, D * K), f32(rng, D)])
    o = {"wConv": 0, "bConv": D * K}
    outs = []
    for bump in (0.0, 5.0):
        Y = f32(np.random.default_rng(1), M, 2 * D)
        Y[L - 2:L, :D] += bump
        u = g.buffer(M * D, "u")
        run(g, conv1d_forward(g, M, L, D, K, upload(g, "Y", Y), upload(g, "w", arena), o, u))
        outs.append(read(g, u, (B, L, D)))
    assert np.array_equal(outs[0][1], outs[1][1])
    assert not np.array_equal(outs[0][0], outs[1][0])


def test_conv1d_refuses_wide_kernel():
    """dConv past the kernels' register window: a clear error, not a wrong convolution,
    from the op and from the public block API (the CPU takes it)."""
    import mamba_ext
    import mamba_ext.gpu as G
    from mamba_ext.block import init_mamba1_params
    from mamba_ext.gpu.conv1d import MAX_DCONV
    b = g.buffer(4, "b")
    with pytest.raises(ValueError, match="dConv"):
        conv1d_forward(g, 4, 4, 2, MAX_DCONV + 1, b, b, {"wConv": 0, "bConv": 0}, b)
    p = init_mamba1_params(32, d_state=4, d_conv=MAX_DCONV + 1, expand=2, dt_rank=2, seed=0,
                           dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((1, 40, 32)).astype(np.float32)
    assert np.all(np.isfinite(mamba_ext.mamba1_forward(x, p)[0]))
    with pytest.raises(ValueError, match=f"dConv must be in \\[1, {MAX_DCONV}\\]"):
        G.mamba1_forward(x, p)


def test_conv1d_reads_f16_pairs_as_f32():
    """half=True (Y as the f16 mode's cache: f16 pairs) gives the f32 path's results on the
    same values bit for bit: u, dY's xc half and the weight gradients."""
    rng = np.random.default_rng(7)
    B, L, D, K = 2, 37, 40, 4
    M = B * L
    Y = f32(rng, M, 2 * D).astype(np.float16)
    arena = np.concatenate([f32(rng, D * K, sd=0.5), f32(rng, D, sd=0.3)])
    o = {"wConv": 0, "bConv": D * K}
    du = upload(g, "du", f32(rng, M, D))
    outs = []
    for half in (False, True):
        Yb = (g.buffer(M * D, "Y16", Y.view(np.uint32)) if half
              else upload(g, "Y", Y.astype(np.float32)))
        bw, u, dY, gr = upload(g, "w", arena), g.buffer(M * D, "u"), g.buffer(M * 2 * D, "dY"), \
            g.buffer(arena.size, "gr")
        run(g, [conv1d_forward(g, M, L, D, K, Yb, bw, o, u, half=half),
                *conv1d_backward(g, M, L, D, K, du, bw, o, dY, Yb, gr, half=half)])
        outs.append([read(g, u, (M, D)), read(g, dY, (M, 2 * D))[:, :D], read(g, gr, (arena.size,))])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


def test_conv1d_writes_the_f16_copy_of_u():
    """u16 (the f16 mode's operand of x_proj): NumPy's float16 of the f32 u the same op
    writes, bit for bit, two per word; the f32 u as without it; an odd D is refused."""
    rng = np.random.default_rng(8)
    B, L, D, K = 2, 45, 70, 4          # 70 channels: a second, partial group of 64
    M = B * L
    Y = f32(rng, M, 2 * D, sd=3.0)
    arena = np.concatenate([f32(rng, D * K, sd=0.5), f32(rng, D, sd=0.3)])
    o = {"wConv": 0, "bConv": D * K}
    bY, bw = upload(g, "Y", Y), upload(g, "w", arena)
    u, u_plain, u16 = g.buffer(M * D, "u"), g.buffer(M * D, "u0"), g.buffer(M * D // 2, "u16")
    run(g, [conv1d_forward(g, M, L, D, K, bY, bw, o, u, u16=u16),
            conv1d_forward(g, M, L, D, K, bY, bw, o, u_plain)])
    got32 = read(g, u, (M, D))
    assert np.array_equal(got32, read(g, u_plain, (M, D)))
    got16 = read(g, u16, (M * D // 2,), np.uint32).view(np.float16).reshape(M, D)
    assert np.array_equal(got16.view(np.uint16), got32.astype(np.float16).view(np.uint16))
    with pytest.raises(ValueError, match="even D"):
        conv1d_forward(g, 4, 4, 3, K, bY, bw, o, u, u16=u16)


def test_conv1d_backward_writes_f16_dY_and_its_column_sums():
    """out16 (the f16 mode's backward): dY's xc half as NumPy's float16 of the f32 path's
    dxc (the z half untouched), the conv's weight gradients bit for bit the f32 path's, and
    in_proj's bias gradient of the xc half += the column sums of the f32 dxc (to float32
    rounding of float64's; the rest of the arena as the f32 path leaves it); an odd D is
    refused by name."""
    rng = np.random.default_rng(9)
    B, L, D, K = 3, 200, 70, 4               # 3 row blocks; a second, partial channel group
    M = B * L
    Y = f32(rng, M, 2 * D)
    o = {"wConv": 0, "bConv": D * K, "bInProj": D * K + D + 3}
    arena = np.concatenate([f32(rng, D * K, sd=0.5), f32(rng, D, sd=0.3), f32(rng, 2 * D + 6)])
    bY, bw, du = upload(g, "Y", Y), upload(g, "w", arena), upload(g, "du", f32(rng, M, D))
    gr0 = f32(rng, arena.size)
    dY, gr = g.buffer(M * 2 * D, "dY"), upload(g, "gr", gr0)
    run(g, conv1d_backward(g, M, L, D, K, du, bw, o, dY, bY, gr))
    want_dxc, want_gr = read(g, dY, (M, 2 * D))[:, :D], read(g, gr, (arena.size,))
    fill = np.full(M * D, 0x7e007e00, np.uint32)
    dY16, gr16 = g.buffer(M * D, "dY16", fill), upload(g, "gr16", gr0)
    run(g, conv1d_backward(g, M, L, D, K, du, bw, o, dY16, bY, gr16, out16=True))
    got16 = read(g, dY16, (M * D,), np.uint32).view(np.float16).reshape(M, 2 * D)
    assert np.array_equal(got16[:, :D].view(np.uint16), want_dxc.astype(np.float16).view(np.uint16))
    assert np.all(got16[:, D:].view(np.uint16) == 0x7e00)
    got = read(g, gr16, (arena.size,))
    b = slice(o["bInProj"], o["bInProj"] + D)
    assert nerr(got[b].astype(np.float64) - gr0[b], want_dxc.astype(np.float64).sum(axis=0)) <= 1e-5
    rest = np.ones(arena.size, bool)
    rest[b] = False
    assert np.array_equal(got[rest], want_gr[rest])
    with pytest.raises(ValueError, match="even D"):
        conv1d_backward(g, 4, 4, 3, K, du, bw, o, dY16, bY, gr16, out16=True)


def test_conv1d_writes_the_f16_transpose_of_u():
    """u16_t (the f16 mode's restore: x_proj's weight-gradient operand): the transpose of
    NumPy's float16 of the f32 u the same op writes, (D, M) in f16 pairs, bit for bit; M
    not a multiple of 8 refused by name."""
    rng = np.random.default_rng(10)
    B, L, D, K = 2, 44, 70, 4              # M 88: 11 runs of 8 rows; a partial channel group
    M = B * L
    Y = f32(rng, M, 2 * D, sd=3.0).astype(np.float16)
    arena = np.concatenate([f32(rng, D * K, sd=0.5), f32(rng, D, sd=0.3)])
    o = {"wConv": 0, "bConv": D * K}
    bY, bw = g.buffer(M * D, "Y16", Y.view(np.uint32)), upload(g, "w", arena)
    u, u16_t = g.buffer(M * D, "u"), g.buffer(M * D // 2, "u16_t")
    run(g, conv1d_forward(g, M, L, D, K, bY, bw, o, u, half=True, u16_t=u16_t))
    got = read(g, u16_t, (M * D // 2,), np.uint32).view(np.float16).reshape(D, M)
    want = read(g, u, (M, D)).astype(np.float16).T
    assert np.array_equal(got.view(np.uint16), np.ascontiguousarray(want).view(np.uint16))
    with pytest.raises(ValueError, match="multiple of 8"):
        conv1d_forward(g, 12, 12, D, K, bY, bw, o, u, half=True, u16_t=u16_t)
