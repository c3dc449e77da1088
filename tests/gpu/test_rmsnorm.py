"""kernels/rmsnorm.wgsl (mamba_ext.gpu.rmsnorm) against the float64 reference step
reference.rmsnorm_forward and the analytic float64 backward."""
from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

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
