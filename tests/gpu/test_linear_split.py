"""mamba_ext.gpu.linear_split: the fp32 products as three f16 products of split, scaled
operands (kernels/linear_split.wgsl, then linear_f16.wgsl with SCALED).

The tensor-core kernel needs a device with f16 subgroup matrices, which CI's lavapipe does
not have; the splitting, the scales, the tripled layouts and the epilogues are the same
with kernels/linear_f16_ref.wgsl, the portable kernel of the same product
(``linear_f16.REFERENCE``), so these tests run them everywhere through the public fp32
entry points (mamba_ext.gpu.linear). The Dawn run of the GPU suite on real hardware takes
the subgroup-matrix kernel (test_dawn_split_products_match_float64)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import f32, nerr, read, require_gpu, run, run_with_f16_matrices, upload

g = require_gpu()
from mamba_ext.gpu import linear_f16 as lf  # noqa: E402
from mamba_ext.gpu import linear_split as ls  # noqa: E402
from mamba_ext.gpu.linear import Mat, linear_backward, linear_forward  # noqa: E402


@pytest.fixture
def split(monkeypatch):
    """Every fp32 product that fits runs split, on the portable kernel (any device)."""
    monkeypatch.setattr(lf, "REFERENCE", True)
    monkeypatch.setattr(ls, "ENABLED", True)


def _entries(ops):
    return [op.name for op in ops]


# (M, I, O, scale of x, of W, of dy): magnitudes far from 1 (the scales are powers of two
# found on the device) and one mixed
CASES = [(256, 128, 128, 1.0, 0.05, 1.0), (128, 256, 384, 3e-7, 2e3, 1e-9),
         (384, 128, 256, 5e4, 1e-3, 1e-30)]


@pytest.mark.parametrize("M,I,O,sx,sw,sd", CASES)
@pytest.mark.parametrize("residual", [False, True])
def test_forward_to_float32_accuracy(M, I, O, sx, sw, sd, residual, split):
    """Y = X W^T + b (+ res) split: within float32's rounding of the float64 product, where
    one f16 product is ~1e-3 off."""
    rng = np.random.default_rng(M + I + O)
    x, W, b, res = f32(rng, M, I) * sx, f32(rng, O, I) * sw, f32(rng, O), f32(rng, M, O)
    x, W = x.astype(np.float32), W.astype(np.float32)
    arena = np.concatenate([np.zeros(4, np.float32), W.ravel(), b])
    bx, bw, bres = upload(g, "x", x), upload(g, "w", arena), upload(g, "res", res)
    y = g.buffer(M * O, "y")
    ops = linear_forward(g, M, I, O, bx, 0, I, bw, 4, 4 + W.size, y, 0, O,
                         res=bres if residual else None)
    assert "linear_split_pack" in _entries(ops) and "linear_forward" not in _entries(ops)
    run(g, ops)
    x64, W64 = x.astype(np.float64), W.astype(np.float64)
    ref = x64 @ W64.T + b + (res if residual else 0)
    prod = np.abs(x64) @ np.abs(W64).T
    err = np.abs(read(g, y, (M, O)) - ref)
    # float32's own bound: a few units of 2^-24 of sum |x||w| (plus the rounding of b + res)
    assert np.all(err <= 2e-6 * prod + 1e-6 * (np.abs(b) + np.abs(res) * residual) + 1e-37)


@pytest.mark.parametrize("M,I,O,sx,sw,sd", CASES)
def test_backward_to_float32_accuracy(M, I, O, sx, sw, sd, split):
    """dX = dY W (written and added to) and dW += dY^T X with db += the column sums of dY,
    from three splits (dY once for both products; X transposed on its way to the tensor
    cores, dW stored transposed)."""
    rng = np.random.default_rng(3 * M + I)
    x, W, dy = f32(rng, M, I) * sx, f32(rng, O, I) * sw, f32(rng, M, O) * sd
    x, W, dy = (a.astype(np.float32) for a in (x, W, dy))
    dx0 = f32(rng, M, I) * np.float32(sd * sw)
    arena = np.concatenate([W.ravel(), f32(rng, O)])
    gr0 = (f32(rng, arena.size) * np.float32(sd * sx)).astype(np.float32)
    bx, bw, bdy = upload(g, "x", x), upload(g, "w", arena), upload(g, "dy", dy)
    x64, W64, dy64 = (a.astype(np.float64) for a in (x, W, dy))
    for beta in (0, 1):
        dx, gr = upload(g, "dx", dx0), upload(g, "gr", gr0)
        ops = linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, W.size, gr,
                              dx=dx, dx_rs=I, dx_beta=beta)
        names = _entries(ops)
        assert names.count("linear_split_pack") == 3 and "linear_backward" not in names
        run(g, ops)
        want = dy64 @ W64 + (dx0 if beta else 0)
        bound = 2e-6 * (np.abs(dy64) @ np.abs(W64)) + 1e-6 * np.abs(dx0) * beta + 1e-37
        assert np.all(np.abs(read(g, dx, (M, I)) - want) <= bound)
        got = read(g, gr, (arena.size,))
        want = gr0[:W.size].reshape(O, I) + dy64.T @ x64
        bound = 2e-6 * (np.abs(dy64).T @ np.abs(x64)) + 1e-6 * np.abs(want) + 1e-37
        assert np.all(np.abs(got[:W.size].reshape(O, I) - want) <= bound)
        assert nerr(got[W.size:], gr0[W.size:] + dy64.sum(0)) <= 1e-5


def test_split_k_products(split, monkeypatch):
    """A product of few tiles and a long contraction (a weight gradient's) runs in K slices,
    each unscaled, summed in order into C (and added to it)."""
    monkeypatch.setattr(lf, "SPLIT_TARGET", 4)
    monkeypatch.setattr(lf, "SPLIT_MIN_K", 64)
    M, I, O = 512, 128, 128
    rng = np.random.default_rng(5)
    x, W, dy = f32(rng, M, I), f32(rng, O, I), f32(rng, M, O) * 1e-6
    x, W, dy = (a.astype(np.float32) for a in (x, W, dy))
    arena = np.concatenate([W.ravel(), f32(rng, O)])
    gr0 = f32(rng, arena.size) * np.float32(1e-4)
    gr = upload(g, "gr", gr0)
    ops = linear_backward(g, M, I, O, upload(g, "dy", dy), 0, O, upload(g, "x", x), 0, I,
                          upload(g, "w", arena), 0, W.size, gr)
    assert "linear_split_sum" in _entries(ops)
    run(g, ops)
    want = gr0[:W.size].reshape(O, I) + dy.astype(np.float64).T @ x
    bound = 2e-6 * (np.abs(dy.astype(np.float64)).T @ np.abs(x)) + 1e-6 * np.abs(want)
    assert np.all(np.abs(read(g, gr, (arena.size,))[:W.size].reshape(O, I) - want) <= bound)


def test_nan_and_inf_stay_in_their_rows(split):
    """A NaN or inf in X reaches only the rows of Y that read it (the scale falls back to 1
    for that operand; the other rows stay finite and close)."""
    M, I, O = 128, 64, 128
    rng = np.random.default_rng(9)
    x, W = f32(rng, M, I), f32(rng, O, I, sd=0.1)
    x[3, 5], x[7, 0] = np.nan, np.inf
    arena = np.concatenate([W.ravel(), np.zeros(O, np.float32)])
    y = g.buffer(M * O, "y")
    run(g, linear_forward(g, M, I, O, upload(g, "x", x), 0, I, upload(g, "w", arena), 0,
                          W.size, y, 0, O))
    got = read(g, y, (M, O))
    assert np.isnan(got[3]).all() and not np.isfinite(got[7]).any()
    rest = np.ones(M, bool)
    rest[[3, 7]] = False
    ref = x[rest].astype(np.float64) @ W.T.astype(np.float64)
    assert np.all(np.isfinite(got[rest])) and nerr(got[rest], ref) <= 1e-5


def test_what_does_not_fit_runs_fp32(split):
    """Sizes off the tiles, and epilogues the split path lacks, go to the fp32 kernel."""
    def un(M, N, K, **kw):
        A = Mat(None, 0, K)
        return ls.unsupported(g, M, N, K, A, Mat(None, 0, N), Mat(None, 0, N), **kw)
    assert un(256, 128, 128) is None
    assert "multiples" in un(200, 128, 128) and "multiples" in un(256, 128, 96)
    assert "beta" in un(256, 128, 128, beta=1, bias=object())
    assert "residual" in un(256, 128, 128, res=object())
    assert "bias gradient" in un(256, 128, 128, dbias=object())
    rng = np.random.default_rng(2)
    M, I, O = 130, 48, 70                       # nothing fits: the fp32 kernel, as before
    x, W = f32(rng, M, I), f32(rng, O, I)
    arena = np.concatenate([W.ravel(), np.zeros(O, np.float32)])
    ops = linear_forward(g, M, I, O, upload(g, "x", x), 0, I, upload(g, "w", arena), 0,
                         W.size, g.buffer(M * O, "y"), 0, O)
    assert _entries(ops) == ["linear_forward"]


def test_off_by_default_without_subgroup_matrices():
    """ENABLED None: only where the device has f16 subgroup matrices (never the portable
    reference kernel, which is slow)."""
    assert ls.ENABLED is None
    assert ls.active(g) == lf.available(g)


def test_dawn_split_products_match_float64():
    """On the tensor cores: forward, dX and dW of block-like shapes split, against float64
    (float32-like accuracy: max error / max |ref| far below one f16 product's ~1e-3; on an
    H200 1.0-2.1e-6, where the portable kernel's f32 sums give ~2e-7: the tensor cores'
    accumulation truncates)."""
    res = run_with_f16_matrices("bench.check_split_products(g, np.random.default_rng(0))")
    assert set(res) == {"forward", "forward+bias+res", "dinput+=", "dweight+= db"}
    assert max(res.values()) < 1e-5, res


def test_the_bench_check_runs_split(split):
    """bench.check_split_products (the Dawn test's and ``bench --f16-gemm``'s check) on the
    portable kernel: every product split, float32-like errors."""
    from mamba_ext.bench.gpu import check_split_products
    res = check_split_products(g, np.random.default_rng(1))
    assert set(res) == {"forward", "forward+bias+res", "dinput+=", "dweight+= db"}
    assert max(res.values()) < 2e-6, res


def test_gemm_weight_gradient_with_bias_gradient(split):
    """linear.gemm's own form of a weight gradient (A = dY^T, the buffer's columns as its
    rows) with the bias gradient's row sums, split: what linear_backward runs per product
    where the layer as a whole does not fit the shared split (e.g. an unaligned dX)."""
    from mamba_ext.gpu.linear import gemm
    M, I, O = 256, 128, 128
    rng = np.random.default_rng(4)
    x, dy = f32(rng, M, I), (f32(rng, M, O) * np.float32(1e-7)).astype(np.float32)
    gr0 = (f32(rng, O * I + O) * np.float32(1e-6)).astype(np.float32)
    gr = upload(g, "gr", gr0)
    ops = gemm(g, "linear_backward", O, I, M, Mat(upload(g, "dy", dy), 0, 1, O),
               Mat(upload(g, "x", x), 0, I), Mat(gr, 0, I), beta=1, dbias=gr, db_off=O * I)
    assert "linear_split_pack" in _entries(ops) and "linear_backward" not in _entries(ops)
    run(g, ops)
    got = read(g, gr, (gr0.size,)).astype(np.float64)
    dy64 = dy.astype(np.float64)
    want = gr0[:O * I].reshape(O, I) + dy64.T @ x
    bound = 2e-6 * (np.abs(dy64).T @ np.abs(x)) + 1e-6 * np.abs(want)
    assert np.all(np.abs(got[:O * I].reshape(O, I) - want) <= bound)
    assert nerr(got[O * I:], gr0[O * I:] + dy64.sum(0)) <= 1e-5


@pytest.mark.parametrize("pad", [4, 3])
def test_strided_operands(pad, split):
    """Operands that are column slices of wider buffers (a row stride past the width, an
    offset): with strides and offsets multiples of 4 the splits load 4 floats at a time, with
    odd ones one; the forward's output and the backward's dX land in their slices only."""
    M, I, O = 256, 128, 128
    rng = np.random.default_rng(11 + pad)
    xs = f32(rng, M, I + pad)
    W = f32(rng, O, I, sd=0.05)
    dys = (f32(rng, M, O + pad) * np.float32(1e-3)).astype(np.float32)
    arena = np.concatenate([np.zeros(4, np.float32), W.ravel(), f32(rng, O)])
    w_off, b_off = 4, 4 + W.size      # (dW's place: a multiple of 4, as the kernel stores)
    x, dy = xs[:, pad:], dys[:, pad:]
    y0 = f32(rng, M, O + 4)
    y = upload(g, "y", y0)
    bx, bw, bdy = upload(g, "x", xs), upload(g, "w", arena), upload(g, "dy", dys)
    ops = linear_forward(g, M, I, O, bx, pad, I + pad, bw, w_off, b_off, y, 4, O + 4)
    assert "linear_split_pack" in _entries(ops)
    run(g, ops)
    x64, W64, dy64 = (a.astype(np.float64) for a in (x, W, dy))
    got = read(g, y, (M, O + 4))
    assert np.array_equal(got[:, :4], y0[:, :4])
    want = x64 @ W64.T + arena[b_off:]
    assert np.all(np.abs(got[:, 4:] - want) <= 2e-6 * (np.abs(x64) @ np.abs(W64).T) + 1e-6)
    dx0 = f32(rng, M, I + 4)
    dx, gr = upload(g, "dx", dx0), upload(g, "gr", np.zeros(arena.size, np.float32))
    ops = linear_backward(g, M, I, O, bdy, pad, O + pad, bx, pad, I + pad, bw, w_off, b_off, gr,
                          dx=dx, dx_off=4, dx_rs=I + 4)
    assert _entries(ops).count("linear_split_pack") == 3
    run(g, ops)
    got = read(g, dx, (M, I + 4))
    assert np.array_equal(got[:, :4], dx0[:, :4])
    assert np.all(np.abs(got[:, 4:] - dy64 @ W64) <= 2e-6 * (np.abs(dy64) @ np.abs(W64)) + 1e-12)
    grs = read(g, gr, (arena.size,))
    assert np.all(np.abs(grs[w_off:b_off].reshape(O, I) - dy64.T @ x64)
                  <= 2e-6 * (np.abs(dy64).T @ np.abs(x64)) + 1e-12)
    assert nerr(grs[b_off:], dy64.sum(0)) <= 1e-5
