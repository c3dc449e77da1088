"""kernels/rmsnorm.wgsl (mamba_ext.gpu.rmsnorm) against the float64 reference step
reference.rmsnorm_forward and the analytic float64 backward."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import f32, nerr, read, require_gpu, run, upload
from mamba_ext.testing import reference

g = require_gpu()
from mamba_ext.gpu.rmsnorm import rmsnorm_backward, rmsnorm_forward  # noqa: E402


def rmsnorm_backward_ref(x, w, dxn, eps):
    """float64 dx and dw of xn = x * rstd * w."""
    x, w, dxn = (np.asarray(a, np.float64) for a in (x, w, dxn))
    _, rstd = reference.rmsnorm_forward(x, w, eps)
    C = x.shape[-1]
    dot = np.sum(w * dxn * x, axis=-1, keepdims=True)
    dx = rstd * w * dxn - x * rstd ** 3 * dot / C
    dw = np.sum(dxn * x * rstd, axis=0)
    return dx, dw


@pytest.mark.parametrize("M,Dm,eps", [(1, 1, 1e-6), (7, 33, 1e-6), (130, 300, 1e-5), (5, 8, 0.5),
                                      (700, 40, 1e-6)])   # 700: 3 row blocks of column_sum
def test_rmsnorm_forward_backward(M, Dm, eps):
    rng = np.random.default_rng(M * 1000 + Dm)
    x, dxn, dres = f32(rng, M, Dm), f32(rng, M, Dm), f32(rng, M, Dm)
    w_arena = np.concatenate([f32(rng, 3), 1 + f32(rng, Dm, sd=0.2)])   # gain at offset 3
    w_off = 3
    bx, bw, bdxn, bdres = (upload(g, n, a) for n, a in (("x", x), ("w", w_arena), ("dxn", dxn),
                                                         ("dres", dres)))
    xn, rstd, dx, gw = (g.buffer(n, s) for n, s in ((M * Dm, "xn"), (M, "rstd"), (M * Dm, "dx"),
                                                   (M * Dm, "gw")))
    gr = upload(g, "gr", np.full(w_arena.size, 0.25, np.float32))       # += onto 0.25
    run(g, [rmsnorm_forward(g, M, Dm, bx, bw, w_off, xn, rstd, eps),
            *rmsnorm_backward(g, M, Dm, bx, bw, w_off, bdxn, rstd, dx, gw, gr, eps, dres=bdres)])
    w = w_arena[w_off:]
    ref_xn, ref_rstd = reference.rmsnorm_forward(x.astype(np.float64), w.astype(np.float64), eps)
    assert nerr(read(g, xn, (M, Dm)), ref_xn) <= 1e-6
    assert nerr(read(g, rstd, (M,)), ref_rstd[:, 0]) <= 1e-6
    ref_dx, ref_dw = rmsnorm_backward_ref(x, w, dxn, eps)
    assert nerr(read(g, dx, (M, Dm)), ref_dx + dres) <= 1e-5
    got_gr = read(g, gr, (w_arena.size,))
    assert nerr(got_gr[w_off:] - 0.25, ref_dw) <= 1e-5
    assert np.all(got_gr[:w_off] == 0.25)           # nothing outside the gain touched


def test_rmsnorm_backward_without_residual_writes_dx():
    """dres absent (the model's final norm): dx is written, not accumulated."""
    rng = np.random.default_rng(5)
    M, Dm, eps = 4, 12, 1e-6
    x, dxn, w = f32(rng, M, Dm), f32(rng, M, Dm), 1 + f32(rng, Dm, sd=0.1)
    bx, bw, bdxn = upload(g, "x", x), upload(g, "w", w), upload(g, "dxn", dxn)
    rstd, gw = g.buffer(M, "rstd"), g.buffer(M * Dm, "gw")
    xn, gr = g.buffer(M * Dm, "xn"), g.buffer(Dm, "gr")
    dx = upload(g, "dx", np.full((M, Dm), 1e3, np.float32))     # stale content must vanish
    run(g, [rmsnorm_forward(g, M, Dm, bx, bw, 0, xn, rstd, eps),
            *rmsnorm_backward(g, M, Dm, bx, bw, 0, bdxn, rstd, dx, gw, gr, eps)])
    assert nerr(read(g, dx, (M, Dm)), rmsnorm_backward_ref(x, w, dxn, eps)[0]) <= 1e-5


def test_rmsnorm_deterministic():
    rng = np.random.default_rng(9)
    M, Dm = 64, 257
    x, w = f32(rng, M, Dm), 1 + f32(rng, Dm, sd=0.1)
    bx, bw = upload(g, "x", x), upload(g, "w", w)
    outs = []
    for _ in range(2):
        xn, rstd = g.buffer(M * Dm, "xn"), g.buffer(M, "rstd")
        run(g, rmsnorm_forward(g, M, Dm, bx, bw, 0, xn, rstd, 1e-6))
        outs.append(read(g, xn, (M, Dm)))
    assert np.array_equal(outs[0], outs[1])


def test_column_sum_over_many_row_blocks(monkeypatch):
    """device.column_sum with 22 row blocks (not a multiple of column_sum_final's 8 lanes)
    and 70 columns (a partial group of 32), with and without the factor b: float64's sums
    to float32 rounding, added onto the output at its offset (the rest untouched), the same
    bits on a second run."""
    from gpu_support import upload as up
    from mamba_ext.gpu import device
    monkeypatch.setattr(device, "COLUMN_SUM_ROWS", 16)
    rng = np.random.default_rng(21)
    M, C = 350, 70
    a, b = f32(rng, M, C + 3), f32(rng, M, C)
    ba, bb = up(g, "a", a), up(g, "b", b)
    for use_b in (False, True):
        runs = []
        for _ in range(2):
            out = up(g, "out", np.full(C + 9, 0.5, np.float32))
            run(g, device.column_sum(g, M, C, ba, 1, C + 3, out, 4,
                                     *((bb, 0, C) if use_b else ())))
            runs.append(read(g, out, (C + 9,)))
        want = (a[:, 1:C + 1].astype(np.float64) * (b if use_b else 1)).sum(axis=0)
        assert nerr(runs[0][4:4 + C] - 0.5, want) <= 1e-5
        assert np.all(runs[0][:4] == 0.5) and np.all(runs[0][4 + C:] == 0.5)
        assert np.array_equal(runs[0], runs[1])
