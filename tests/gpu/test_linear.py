"""kernels/linear.wgsl (mamba_ext.gpu.linear) against the float64 reference step
reference.linear_forward and the float64 products of the backward."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import f32, nerr, read, require_gpu, run, upload
from mamba_ext.testing import reference

g = require_gpu()
from mamba_ext.gpu import linear as lin  # noqa: E402
from mamba_ext.gpu.linear import linear_backward, linear_forward  # noqa: E402

# (M, I, O): sizes that are multiples of no tile (64), of BK (16) or of 4
SHAPES = [(1, 1, 1), (3, 5, 7), (65, 17, 129), (130, 48, 70), (37, 200, 3)]


@pytest.fixture(params=[(True, False, None), (False, False, None), (True, True, None),
                        (True, False, False), (False, False, False)],
                ids=["prefetch", "plain", "split", "rows32-prefetch", "rows32-plain"])
def stages(request, monkeypatch):
    """Every tile loop: with register prefetch, the plain loop (no prefetch); and
    split-K forced on every product with a contraction of 32 or more (slices, then
    linear_split_sum); the layout of workgroup memory for devices with less than 20 KiB
    of it (ROT off: rows of 32, the k-contiguous loads assigned otherwise) where the
    device has more."""
    monkeypatch.setattr(lin, "PREFETCH", request.param[0])
    monkeypatch.setattr(lin, "ROT", request.param[2])
    if request.param[1]:
        monkeypatch.setattr(lin, "SPLIT_ALL", True)
        monkeypatch.setattr(lin, "MIN_SPLIT_K", 16)
        monkeypatch.setattr(lin, "MIN_SPLIT_K_SHORT", 16)
        monkeypatch.setattr(lin, "SPLIT_TARGET_GROUPS", 10 ** 6)
    return request.param


@pytest.mark.parametrize("M,I,O", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_linear_forward(M, I, O, residual, stages):
    rng = np.random.default_rng(M + 7 * I + 13 * O)
    x, W, b = f32(rng, M, I), f32(rng, O, I, sd=I ** -0.5), f32(rng, O)
    res = f32(rng, M, O)
    arena = np.concatenate([f32(rng, 5), W.ravel(), b])         # W at 5, b after it
    w_off, b_off = 5, 5 + W.size
    bx, bw, bres = upload(g, "x", x), upload(g, "w", arena), upload(g, "res", res)
    y = g.buffer(M * O, "y")
    run(g, linear_forward(g, M, I, O, bx, 0, I, bw, w_off, b_off, y, 0, O,
                          res=bres if residual else None))
    ref = reference.linear_forward(x.astype(np.float64), W.astype(np.float64), b.astype(np.float64))
    if residual:
        ref = ref + res
    assert nerr(read(g, y, (M, O)), ref) <= 1e-5


@pytest.mark.parametrize("M,I,O", SHAPES)
def test_linear_backward(M, I, O, stages):
    rng = np.random.default_rng(3 * M + I + O)
    x, W, dy = f32(rng, M, I), f32(rng, O, I, sd=I ** -0.5), f32(rng, M, O)
    dx0 = f32(rng, M, I)
    arena = np.concatenate([W.ravel(), f32(rng, O)])
    bx, bw, bdy = upload(g, "x", x), upload(g, "w", arena), upload(g, "dy", dy)
    gr0 = f32(rng, arena.size)
    gr = upload(g, "gr", gr0)
    for beta in (0, 1):
        dx = upload(g, "dx", dx0)
        gr = upload(g, "gr", gr0)
        run(g, linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, W.size, gr,
                               dx=dx, dx_rs=I, dx_beta=beta))
        x64, W64, dy64 = (a.astype(np.float64) for a in (x, W, dy))
        assert nerr(read(g, dx, (M, I)), dy64 @ W64 + (dx0 if beta else 0)) <= 1e-5
        got = read(g, gr, (arena.size,)) - gr0.astype(np.float64)
        assert nerr(got[:W.size].reshape(O, I), dy64.T @ x64) <= 1e-4
        assert nerr(got[W.size:], dy64.sum(0)) <= 1e-4


@pytest.mark.parametrize("M,I,O", [(130, 48, 70), (37, 200, 3), (600, 9, 130)])
def test_linear_split_k(M, I, O, monkeypatch):
    """Products of few tiles run as split-K slices plus one fixed-order sum that applies
    the epilogue: forward with bias and residual, dX with beta 0 and 1, dW with db."""
    monkeypatch.setattr(lin, "SPLIT_ALL", True)
    monkeypatch.setattr(lin, "MIN_SPLIT_K", 16)
    monkeypatch.setattr(lin, "MIN_SPLIT_K_SHORT", 16)
    rng = np.random.default_rng(M + I + O)
    x, W, dy, res = f32(rng, M, I), f32(rng, O, I, sd=I ** -0.5), f32(rng, M, O), f32(rng, M, O)
    b = f32(rng, O)
    arena = np.concatenate([W.ravel(), b])
    bx, bw, bdy = upload(g, "x", x), upload(g, "w", arena), upload(g, "dy", dy)
    x64, W64, dy64 = (a.astype(np.float64) for a in (x, W, dy))
    y = g.buffer(M * O, "y")
    ops = linear_forward(g, M, I, O, bx, 0, I, bw, 0, W.size, y, 0, O, res=upload(g, "res", res))
    assert lin.split_count(g, M, O, I) == 1 or ops[-1].name == "linear_split_sum"
    run(g, ops)
    assert nerr(read(g, y, (M, O)), x64 @ W64.T + b + res) <= 1e-5
    dx0 = f32(rng, M, I)
    gr0 = f32(rng, arena.size)
    for beta in (0, 1):
        dx, gr = upload(g, "dx", dx0), upload(g, "gr", gr0)
        ops = linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, W.size, gr, dx=dx, dx_rs=I,
                              dx_beta=beta)
        dw_ops = [op for op in ops if op.name == "linear_backward"][-1]
        assert dw_ops.grid[2] > 1                     # the dW product was split
        run(g, ops)
        assert nerr(read(g, dx, (M, I)), dy64 @ W64 + (dx0 if beta else 0)) <= 1e-5
        got = read(g, gr, (arena.size,)) - gr0.astype(np.float64)
        assert nerr(got[:W.size].reshape(O, I), dy64.T @ x64) <= 1e-4
        assert nerr(got[W.size:], dy64.sum(0)) <= 1e-4


def test_split_count_thinner_slices_where_they_fill_the_last_wave():
    """S = min(SPLIT_TARGET_GROUPS / tiles, K / MIN_SPLIT_K) slices, or thinner ones (down to
    MIN_SPLIT_K_SHORT of the contraction, for K <= SPLIT_SHORT_K) when waves of SPLIT_WAVE
    workgroups x contraction per slice is smaller; products of SPLIT_BELOW_TILES tiles or
    more stay whole."""
    assert (lin.MIN_SPLIT_K_SHORT, lin.MIN_SPLIT_K, lin.SPLIT_WAVE) == (192, 256, 264)
    # block c's in_proj forward, 8 x 24 = 192 tiles, K 768: 3 slices = 3 waves x 256 k,
    # 4 slices = 3 waves x 192 k -> 4
    assert lin.split_count(g, 1024, 3072, 768) == 4
    # block c's out_proj forward, 48 tiles, K 1536: 6 slices = 2 waves x 256, 8 = 2 x 192 -> 8
    assert lin.split_count(g, 1024, 768, 1536) == 8
    # the 4 x 256 model's in_proj dX, 64 x 2 = 128 tiles, K 1024: 4 slices = 2 waves x 256,
    # 5 = 3 waves x 205 -> 4
    assert lin.split_count(g, 8192, 256, 1024) == 4
    # its in_proj dW, 16 tiles, K = B*L 8192: 32 slices = 2 waves x 256, 42 = 3 x 196 -> 32
    assert lin.split_count(g, 1024, 256, 8192) == 32
    # its x_proj dW, (P, D) = (48, 512), 4 tiles: 42 slices would fill the one wave better,
    # but K 8192 > SPLIT_SHORT_K keeps MIN_SPLIT_K -> 32
    assert lin.SPLIT_SHORT_K < 8192 and lin.split_count(g, 48, 512, 8192) == 32
    # block d's in_proj forward, 128 x 24 tiles: whole
    assert lin.split_count(g, 16384, 3072, 768) == 1


@pytest.mark.parametrize("slices", [1, 3, 10, 12])
def test_linear_split_k_partials_in_a_given_buffer(slices, monkeypatch):
    """dW's split-K partials in a caller's free buffer (a dead backward temporary) when
    it holds every slice (10 here), else in the device's scratch: the same slices and
    result either way."""
    monkeypatch.setattr(lin, "MIN_SPLIT_K", 16)
    monkeypatch.setattr(lin, "MIN_SPLIT_K_SHORT", 16)
    M, I, O = 300, 40, 24
    rng = np.random.default_rng(slices)
    x, W, dy = f32(rng, M, I), f32(rng, O, I, sd=I ** -0.5), f32(rng, M, O)
    arena = np.concatenate([W.ravel(), f32(rng, O)])
    bx, bw, bdy = upload(g, "x", x), upload(g, "w", arena), upload(g, "dy", dy)
    gr0 = f32(rng, arena.size)
    gr = upload(g, "gr", gr0)
    part = g.buffer(lin.split_scratch_len(O, I, slices), "given_part")
    asked = []
    real = g.scratch
    monkeypatch.setattr(g, "scratch", lambda name, n: asked.append(name) or real(name, n))
    ops = linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, W.size, gr, part=part)
    assert ops[0].grid[2] == 10 and lin.split_count(g, O, I, M) == 18   # 18 of 300 -> 10 of 32
    assert ("linear_split_k" in asked) == (slices < 10)
    run(g, ops)
    got = read(g, gr, (arena.size,)) - gr0.astype(np.float64)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    assert nerr(got[:W.size].reshape(O, I), dy64.T @ x64) <= 1e-4
    assert nerr(got[W.size:], dy64.sum(0)) <= 1e-4


def test_linear_column_slices():
    """Operands addressed by offset and row stride (x_proj's dt_low columns feeding
    dt_proj; the z half of in_proj's output): no copies, other columns untouched."""
    rng = np.random.default_rng(11)
    M, P, R, D = 29, 11, 3, 21
    xproj = f32(rng, M, P)
    W, b = f32(rng, D, R), f32(rng, D)
    arena = np.concatenate([W.ravel(), b])
    Y0 = f32(rng, M, 2 * D)
    bq, bw, bY = upload(g, "xproj", xproj), upload(g, "w", arena), upload(g, "Y", Y0)
    # dt_low = xproj[:, 0:R] (row stride P) -> Y[:, D:2D] (offset D, row stride 2D)
    run(g, linear_forward(g, M, R, D, bq, 0, P, bw, 0, W.size, bY, D, 2 * D))
    got = read(g, bY, (M, 2 * D))
    ref = reference.linear_forward(xproj[:, :R].astype(np.float64), W.astype(np.float64),
                                   b.astype(np.float64))
    assert nerr(got[:, D:], ref) <= 1e-5
    assert np.array_equal(got[:, :D], Y0[:, :D])


def test_linear_deterministic():
    rng = np.random.default_rng(2)
    M, I, O = 300, 70, 90
    x, dy = f32(rng, M, I), f32(rng, M, O)
    arena = np.concatenate([f32(rng, O * I), f32(rng, O)])
    bx, bw, bdy = upload(g, "x", x), upload(g, "w", arena), upload(g, "dy", dy)
    outs = []
    for _ in range(2):
        gr, dx = g.buffer(arena.size, "gr"), g.buffer(M * I, "dx")
        run(g, linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, O * I, gr, dx=dx, dx_rs=I))
        outs.append((read(g, gr, (arena.size,)), read(g, dx, (M, I))))
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
