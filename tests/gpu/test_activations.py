"""kernels/activations.wgsl (mamba_ext.gpu.activations: the SiLU gate) and
the scalar helpers of kernels/common.wgsl against float64 NumPy."""
from __future__ import annotations

import numpy as np

from gpu_support import f32, nerr, read, require_gpu, run, upload
from mamba_ext.testing import reference

g = require_gpu()
from mamba_ext.gpu.activations import gate_backward, gate_forward  # noqa: E402
from mamba_ext.gpu.device import elementwise  # noqa: E402


def test_helpers_match_numpy():
    """expm1 / log1p / softplus / sigmoid of common.wgsl."""
    x = np.concatenate([np.float32(2.0) ** -np.arange(1, 40, dtype=np.float32),
                        np.linspace(-30, 30, 601, dtype=np.float32),
                        np.array([0.0, 0.4999, 0.5, -0.5, 1e-30, -1e-7], np.float32)])
    x = np.concatenate([x, -x]).astype(np.float32)
    xb, ob = upload(g, "x", x), g.buffer(4 * x.size, "out")
    run(g, elementwise(g, "selftest", "eval_helpers", x.size, [x.size], [xb, ob], wg=64))
    out = read(g, ob, (4, x.size)).astype(np.float64)
    xd = x.astype(np.float64)
    rel = lambda a, b: np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))
    # GPU exp/log may be a few ulp off and exp(x) for |x| ~ 30 carries the
    # rounding of x*log2(e): 1e-5 relative overall; near 0 the series must be
    # accurate to float32 rounding (where exp(x) - 1 would lose everything).
    # expm1_f takes x <= 0 (x = delta * A in every kernel): past 0 only its direct
    # form, from 0.5 on, is checked.
    near0 = np.abs(xd) < 0.5
    dom = (xd <= 0) | (xd >= 0.5)
    assert rel(out[0][dom], np.expm1(xd[dom])) < 1e-5
    assert rel(out[0][near0 & dom], np.expm1(xd[near0 & dom])) < 1e-6
    assert rel(out[1], np.log1p(np.abs(xd))) < 1e-5
    assert rel(out[1][near0], np.log1p(np.abs(xd[near0]))) < 1e-6
    assert rel(out[2], reference.softplus(xd)) < 1e-5
    assert rel(out[3], 1.0 / (1.0 + np.exp(-xd))) < 1e-5   # (reference.sigmoid's tanh form
    # loses relative accuracy where the result is tiny)
    # the naive single-precision form that expm1_f replaces is far off here
    tiny = np.float32(4.54e-5) * np.float32(0.1)
    assert abs((np.exp(tiny) - np.float32(1)) / tiny - 1) > 1e-3


def test_gate_forward_backward():
    rng = np.random.default_rng(2)
    M, D = 41, 23
    y, Y, dgated = f32(rng, M, D), f32(rng, M, 2 * D, sd=3.0), f32(rng, M, D)
    by, bY, bdg = upload(g, "y", y), upload(g, "Y", Y), upload(g, "dgated", dgated)
    gated, dy = g.buffer(M * D, "gated"), g.buffer(M * D, "dy")
    dY0 = f32(rng, M, 2 * D)
    dY = upload(g, "dY", dY0)
    run(g, [gate_forward(g, M, D, by, bY, gated), gate_backward(g, M, D, bdg, by, bY, dy, dY)])
    z = Y[:, D:].astype(np.float64)
    y64, dg = y.astype(np.float64), dgated.astype(np.float64)
    assert nerr(read(g, gated, (M, D)), reference.gate_forward(y64, z)) <= 1e-6
    s = reference.sigmoid(z)
    assert nerr(read(g, dy, (M, D)), dg * reference.silu(z)) <= 1e-6
    got_dY = read(g, dY, (M, 2 * D))
    assert nerr(got_dY[:, D:], dg * y64 * s * (1 + z * (1 - s))) <= 1e-6
    assert np.array_equal(got_dY[:, :D], dY0[:, :D])      # the xc half is conv1d's
