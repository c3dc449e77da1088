"""Mixed precision with f16 products (mamba_ext.gpu.linear_f16, BlockLayer's f16 mode,
ResidentTrainer(scaler=...) with f16_products): the f16 operands, the biases (a start value,
a fill) and the f16 caches around in_proj's and out_proj's products.

The tensor-core kernel needs a device with f16 subgroup matrices, which CI's lavapipe does
not have (the Dawn run of tests/gpu/test_linear_f16.py checks it on real hardware). The
data path around it is the same with kernels/linear_f16_ref.wgsl, the portable kernel of the
same product (``linear_f16.REFERENCE``), so these tests run it everywhere."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import nerr, random_model, read, require_gpu, run, run_with_f16_matrices, upload

g = require_gpu()
from mamba_ext import gpu as G  # noqa: E402
from mamba_ext.amp import DynamicLossScaler  # noqa: E402
from mamba_ext.bench.gpu import check_f16_model, f16_loss_and_grads  # noqa: E402
from mamba_ext.gpu import linear_f16 as lf  # noqa: E402
from mamba_ext.gpu.model import check_model  # noqa: E402
from test_amp import _edge_values  # noqa: E402


@pytest.fixture
def reference(monkeypatch):
    """The portable kernel of the f16 product, on any device."""
    monkeypatch.setattr(lf, "REFERENCE", True)


def _f16(a):
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float32).astype(np.float16)


def test_pack_is_numpys_float16():
    """Every rounding case (ties, overflow to inf, subnormals, -0, NaN) from a strided
    block of a larger buffer into a dense one at an offset."""
    x = _edge_values()
    cols = 40
    rows = x.size // cols
    x = x[:rows * cols].reshape(rows, cols)
    big = np.zeros((rows, cols + 6), np.float32)
    big[:, 3:3 + cols] = x
    src, dst = upload(g, "src", big), g.buffer(rows * cols // 2 + 5, "dst")
    run(g, lf.pack(g, dst, src, rows, cols, src_off=3, src_rs=cols + 6, dst_off=10))
    got = read(g, dst, (rows * cols // 2 + 5,), np.uint32)[5:].view(np.float16).reshape(rows, cols)
    want = _f16(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])   # -0 too
    with pytest.raises(ValueError, match="even"):
        lf.pack(g, dst, src, 2, 3)
    # every 4099th float32 bit pattern (all binades, both signs, NaN payloads)
    x = (np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)).view(np.float32)
    x = x[:x.size // 2 * 2]
    src, dst = upload(g, "src", x), g.buffer(x.size // 2, "dst")
    run(g, lf.pack(g, dst, src, 1, x.size))
    got, want = read(g, dst, (x.size // 2,), np.uint32).view(np.float16), _f16(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_f16_cache_reads_are_exact():
    """The kernels that read the f16 mode's cache (act_value in common.wgsl; here
    gate_backward's y): every f16 value (all 65536 bit patterns: subnormals, -0, inf, NaN)
    read as the f32 of the same value, so the results are those of an f32 copy, bit for
    bit; pack then that read is NumPy's round trip."""
    from mamba_ext.gpu.activations import gate_backward

    def gate_dY(n, yb, half, z=0.75):
        """dY's z half of gate_backward with dgated = 1: y * SiLU'(z), for n values y (yb:
        f32, or f16 pairs with ``half``), as n / 2 rows of D = 2 channels."""
        Y = np.full((n // 2, 4), z, np.float32)
        dg, dy, dY = upload(g, "dg", np.ones(n, np.float32)), g.buffer(n, "dy"), g.buffer(2 * n, "dY")
        Yb = upload(g, "Y", Y) if not half else g.buffer(n, "Y16", _f16(Y).view(np.uint32))
        run(g, gate_backward(g, n // 2, 2, dg, yb, Yb, dy, dY, half=half))
        return read(g, dY, (n // 2, 4))[:, 2:].ravel()

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = gate_dY(bits.size, g.buffer(bits.size // 2, "y16", bits.view(np.uint32)), True)
    want = gate_dY(bits.size, upload(g, "y", bits.view(np.float16).astype(np.float32)), False)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])   # -0 too
    x = _edge_values()[:256]
    hb = g.buffer(128, "h")
    run(g, lf.pack(g, hb, upload(g, "x", x), 1, 256))
    got, want = gate_dY(256, hb, True), gate_dY(256, upload(g, "y", _f16(x).astype(np.float32)), False)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    with pytest.raises(ValueError, match="even D"):      # f16 pairs: one word per invocation
        gate_backward(g, 2, 3, hb, hb, hb, hb, hb, half=True)


def test_pack_pads_rows_with_zeros():
    """pack with dst_cols > cols: each packed row is the f16 block row then zeros, whatever
    the buffer held before (a narrow product's operand padded to whole tiles)."""
    rng = np.random.default_rng(4)
    rows, cols, dc = 5, 6, 16
    x = rng.standard_normal((rows, cols + 2)).astype(np.float32)
    src = upload(g, "src", x)
    dst = g.buffer(rows * dc // 2 + 3, "dst", np.full(rows * dc // 2 + 3, 0xffffffff, np.uint32))
    run(g, lf.pack(g, dst, src, rows, cols, src_off=1, src_rs=cols + 2, dst_off=6,
                   dst_cols=dc))
    got = read(g, dst, (rows * dc // 2 + 3,), np.uint32)
    assert np.all(got[:3] == 0xffffffff)                        # before dst_off: untouched
    h = got[3:].view(np.float16).reshape(rows, dc)
    assert np.array_equal(h[:, :cols], _f16(x[:, 1:1 + cols]))
    assert not h[:, cols:].view(np.uint16).any()
    with pytest.raises(ValueError, match="dst_cols"):
        lf.pack(g, dst, src, rows, cols, dst_cols=4)


def test_reference_narrow_products(reference):
    """The narrow products of x_proj and dt_proj (n_valid of a padded tile's columns
    stored; a weight gradient stored transposed), split over K, against float64; sizes
    the kernel cannot store are refused by name."""
    from mamba_ext.bench.gpu import check_narrow_f16_products
    res = check_narrow_f16_products(g, lf, np.random.default_rng(8))
    assert len(res) == 3 and max(res.values()) < 1e-5, res
    assert "multiple of 16" in lf.unsupported(128, 128, 64, 64, 64, 48, n_valid=40)
    assert "at most N" in lf.unsupported(128, 128, 64, 64, 64, 48, n_valid=144)
    assert lf.unsupported(128, 128, 64, 64, 64, 48, n_valid=48) is None


def test_narrow_products_run_where_they_fit(reference):
    """x_proj and dt_proj run in f16 where dt_rank and dt_rank + 2 d_state are multiples of
    16 (d_model 256: 16 and 48), else in f32 (d_model 128: 8 and 40), and the tied head
    where the vocabulary is; their f16 weights are zero-padded to whole tiles; activation
    checkpointing gives the same bits."""
    from mamba_ext.gpu.block import BlockScratch, half_weights, narrow_f16_unsupported
    from mamba_ext.gpu.device import arena_layout
    from mamba_ext.gpu.model import ModelPlan
    assert narrow_f16_unsupported(48, 16) is None
    assert "multiples of 16" in narrow_f16_unsupported(40, 8)
    for Dm, narrow in ((256, True), (128, False)):
        p = random_model(64, Dm, 1, 2 * Dm, 16, 4, Dm // 16, 1)
        arrays, dims = check_model(p)
        offs, n = arena_layout([(k, a.shape) for k, a in arrays.items()])
        w = g.buffer(n, "params", np.concatenate([a.ravel() for a in arrays.values()]))
        half = half_weights(g, w, offs, {k: a.shape for k, a in arrays.items()})
        plan = ModelPlan(arrays, dims, 1, 128, list(arrays), w=w, f16=half)
        assert plan.layers[0].narrow16 is narrow
        assert ("layer0.wDtProj" in half.offs) is narrow
        # the narrow products' scratch (ddelta_pre's f16 copies, u's transpose) only for them
        sc = BlockScratch(g, dims.block, plan.layers[0].s, f16=True, narrow16=narrow)
        assert all(hasattr(sc, k) is narrow for k in ("narrow16", "narrow16_t", "u16_t"))
        assert plan.head16 is not None            # vocabulary 64: the tied head in f16 too
        if narrow:
            run(g, half.ops)
            D, R = arrays["layer0.wDtProj"].shape
            words = read(g, half.buf, (half.buf.size // 4,), np.uint32)
            at, ld = half.offs["layer0.wDtProj"], half.ld["layer0.wDtProj"]
            copy = words.view(np.float16)[at:at + 128 * -(-D // 128) * ld].reshape(-1, ld)
            assert ld == 128 and np.array_equal(copy[:D, :R], _f16(arrays["layer0.wDtProj"]))
            assert not copy[:, R:].view(np.uint16).any() and not copy[D:].view(np.uint16).any()
    p = random_model(70, 128, 1, 256, 16, 4, 8, 1)          # vocabulary 70: the head in f32
    half = half_weights(g, g.buffer(4, "w0"), dict.fromkeys(p, 0), {k: a.shape for k, a in p.items()})
    assert "embedding" not in half.offs and "layer0.wInProj" in half.offs
    arrays, dims = check_model({k: _f16(v).astype(np.float32)
                                for k, v in random_model(64, 256, 2, 512, 16, 4, 16, 3).items()})
    rng = np.random.default_rng(6)
    tok, tgt = rng.integers(0, 64, (1, 128)), rng.integers(0, 64, (1, 128))
    runs = [f16_loss_and_grads(g, arrays, dims, tok, tgt, f16=True, checkpointing=ck,
                               loss_scale=2.0 ** 12) for ck in (False, True)]
    assert runs[0][0] == runs[1][0]
    assert all(np.array_equal(runs[0][1][k], runs[1][1][k]) for k in arrays)


def test_f16_mode_cache_is_small(reference):
    """BlockLayer's f16 mode keeps Y and y in f16 and u and delta_pre not at all: its cache
    is the f16 xn^T, gated^T, Y and y, rstd, xproj and the scan's chunk states; the f32
    activations are one buffer for all layers."""
    from mamba_ext.gpu.block import BlockLayer, half_weights
    from mamba_ext.gpu.device import arena_layout
    from mamba_ext.gpu.model import ModelPlan
    arrays, dims = check_model(_model(n_layers=2))
    order = list(arrays)
    B, L = 2, 128
    plans = {}
    for f16 in (False, True):
        offs, n = arena_layout([(k, arrays[k].shape) for k in order])
        w = g.buffer(n, "params")
        half = half_weights(g, w, offs, {k: a.shape for k, a in arrays.items()}) if f16 else None
        plans[f16] = ModelPlan(arrays, dims, B, L, order, w=w, f16=half)
    d, M = dims.block, B * L
    lay32, lay16 = plans[False].layers[0], plans[True].layers[0]
    chunks = sum(getattr(lay16, k).size for k in ("hchunk", "achunk", "hstate"))
    words = M * d.Dm // 2 + M * d.D // 2 + M * d.D + M * d.D // 2 + M + M * d.P
    assert sum(b.size for b in lay16.buffers()) == 4 * words + chunks
    assert sum(b.size for b in lay32.buffers()) == 4 * (M * (6 * d.D + d.Dm + d.P + 1)) + chunks
    assert isinstance(lay16, BlockLayer) and lay16.Y16 is not plans[True].layers[1].Y16
    for name in ("Y", "u", "delta_pre", "y"):
        assert getattr(lay16, name) is getattr(plans[True].layers[1], name), name
        assert getattr(lay32, name) is not getattr(plans[False].layers[1], name), name


@pytest.mark.parametrize("row,trans", [(True, True), (False, True), (True, False)])
def test_pack_pair_is_both_layouts(row, trans):
    """pack_pair: the row-major copy and the transposed one (each when asked, at an offset
    of its buffer) of a strided block, bit for bit NumPy's float16 (edge values included);
    what is not asked for, and the words before the offsets, untouched."""
    rng = np.random.default_rng(2)
    rows, cols, rs = 128, 128, 134          # 2 x 2 tiles of 64 x 64
    x = np.zeros((rows, rs), np.float32)
    vals = _edge_values()
    x[:, 4:4 + cols] = rng.choice(vals, (rows, cols))
    src = upload(g, "src", x)
    n = rows * cols // 2 + 3
    dst, dst_t = (g.buffer(n, k, np.full(n, 0xffffffff, np.uint32)) for k in ("dst", "dst_t"))
    run(g, lf.pack_pair(g, dst if row else None, dst_t if trans else None, src, rows, cols,
                        src_off=4, src_rs=rs, dst_off=6 if row else 0, dst_t_off=6 if trans else 0))
    want = _f16(x[:, 4:4 + cols])
    for buf, ref, on in ((dst, want, row), (dst_t, want.T, trans)):
        words = read(g, buf, (n,), np.uint32)
        if not on:
            assert np.all(words == 0xffffffff)
            continue
        assert np.all(words[:3] == 0xffffffff)
        got = words[3:].view(np.float16).reshape(ref.shape)
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint16)[~nan], np.ascontiguousarray(ref).view(np.uint16)[~nan])
    for bad in ((96, 64), (128, 96)):
        with pytest.raises(ValueError, match="multiples of 64"):
            lf.pack_pair(g, dst, dst_t, src, *bad)
    for off, stride, doff in ((3, rs, 0), (4, rs - 1, 0), (4, rs, 5)):   # f32 and f16 pairs
        with pytest.raises(ValueError, match="even"):
            lf.pack_pair(g, dst, dst_t, src, rows, cols, src_off=off, src_rs=stride, dst_off=doff)
    with pytest.raises(ValueError, match="nothing to write"):
        lf.pack_pair(g, None, None, src, rows, cols)


def test_half_weights_keeps_transposes():
    """HalfWeights with ``transposed``: the named matrix also as its f16 transpose (the
    forward's B operand) at its own offset, the others as before; a matrix that is not whole
    tiles cannot be kept transposed."""
    rng = np.random.default_rng(9)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((256, 128), (80, 48)))
    arena = upload(g, "arena", np.concatenate([np.zeros(2, np.float32), a.ravel(), b.ravel()]))
    hw = lf.HalfWeights(g, arena, [("a", 2, 256, 128), ("b", 2 + a.size, 80, 48)], transposed=["a"])
    run(g, hw.ops)
    words = read(g, hw.buf, (hw.buf.size // 4,), np.uint32).view(np.float16)
    at = lambda k, r, c: words[hw.offs[k]:hw.offs[k] + r * c].reshape(r, c)   # noqa: E731
    assert hw.ld["a.T"] == 256 and hw.ld["a"] == 128
    assert np.array_equal(at("a", 256, 128), _f16(a))
    assert np.array_equal(at("a.T", 128, 256), _f16(a).T)
    got_b = at("b", 128, 128)
    assert np.array_equal(got_b[:80, :48], _f16(b)) and not got_b[80:].any() and not got_b[:, 48:].any()
    assert "b.T" not in hw.offs and all(o % 8 == 0 for o in hw.offs.values())
    with pytest.raises(ValueError, match="whole tiles"):
        lf.HalfWeights(g, arena, [("b", 2 + a.size, 80, 48)], transposed=["b"])


def test_half_weights_packs_each_matrix_of_every_layer_at_once():
    """A model's HalfWeights: the same matrix of every layer (same shape, constant strides
    in the arena and in the f16 buffer) packed by one dispatch, its transposes by another;
    a layer whose matrix sits at another stride starts a run of its own. Every copy equals
    NumPy's float16 of its matrix, the padding zero."""
    rng = np.random.default_rng(11)
    shapes = {"wa": (256, 128), "wb": (16, 40)}
    arrays, tensors, at = [np.zeros(4, np.float32)], [], 4
    for i in range(4):
        if i == 3:                                   # a gap: layer 3 breaks the strides
            arrays.append(np.zeros(6, np.float32))
            at += 6
        for k, shp in shapes.items():
            a = rng.standard_normal(shp).astype(np.float32)
            arrays.append(a.ravel())
            tensors.append((f"layer{i}.{k}", at, *shp))
            at += a.size
    arena = np.concatenate(arrays)
    hw = lf.HalfWeights(g, upload(g, "arena", arena), tensors,
                        transposed=[t[0] for t in tensors if t[0].endswith("wa")])
    # wa: layers 0-2, then 3; wb the same; wa's transposes the same: 6 dispatches, not 12
    assert len(hw.ops) == 6
    run(g, hw.ops)
    words = read(g, hw.buf, (hw.buf.size // 4,), np.uint32).view(np.float16)
    for name, off, r, c in tensors:
        want = _f16(arena[off:off + r * c].reshape(r, c))
        R, C = lf.padded(r), lf.padded(c)
        got = words[hw.offs[name]:hw.offs[name] + R * C].reshape(R, C)
        assert np.array_equal(got[:r, :c], want), name
        assert not got[r:].any() and not got[:, c:].any(), name
        if name.endswith("wa"):
            t = words[hw.offs[name + ".T"]:hw.offs[name + ".T"] + r * c].reshape(c, r)
            assert np.array_equal(t, want.T), name
    with pytest.raises(ValueError, match="count"):
        lf.pack(g, hw.buf, hw.buf, 2, 4, count=2, dst_stride=4)


def test_gate_forward_f16_is_the_gate_and_its_packs():
    """gate_forward_f16 (the f16 mode's forward gate): gated16 and its transpose are
    NumPy's float16 of gate_forward's f32 gated, y16 and Y16 of y and Y, bit for bit (edge
    values included); sizes that are not whole 64 x 64 tiles are refused by name."""
    from mamba_ext.gpu.activations import gate_forward, gate_forward_f16
    rng = np.random.default_rng(12)
    M, D = 128, 192                         # 2 x 3 tiles
    vals = _edge_values()
    y = rng.choice(vals, (M, D)).astype(np.float32)
    Y = np.where(rng.random((M, 2 * D)) < 0.5, rng.choice(vals, (M, 2 * D)),
                 rng.standard_normal((M, 2 * D)) * 4).astype(np.float32)
    yb, Yb, gated = upload(g, "y", y), upload(g, "Y", Y), g.buffer(M * D, "gated")
    run(g, gate_forward(g, M, D, yb, Yb, gated))
    want_gated = read(g, gated, (M, D))
    bufs = {k: g.buffer(n, k) for k, n in (("y16", M * D // 2), ("Y16", M * D),
                                          ("gated16", M * D // 2), ("gated16_t", M * D // 2))}
    run(g, gate_forward_f16(g, M, D, yb, Yb, *bufs.values()))
    for name, ref in (("y16", y), ("Y16", Y), ("gated16", want_gated), ("gated16_t", want_gated.T)):
        got = read(g, bufs[name], (ref.size // 2,), np.uint32).view(np.float16).reshape(ref.shape)
        want = _f16(ref)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), name
        assert np.array_equal(got.view(np.uint16)[~nan],
                              np.ascontiguousarray(want).view(np.uint16)[~nan]), name
    for bad in ((96, 64), (128, 96)):
        with pytest.raises(ValueError, match="multiples of 64"):
            gate_forward_f16(g, *bad, yb, Yb, *bufs.values())


def test_gate_backward_f16_is_the_gate_backward_and_its_pack(monkeypatch):
    """gate_backward_f16 (the f16 mode's backward gate): dy bit for bit gate_backward's on
    the same f16 cache; dY16's z half NumPy's float16 of gate_backward's f32 dz (its xc half
    untouched); in_proj's bias gradient of the z half += the column sums of that f32 dz (to
    float32 rounding of float64's, the same bits on a second run, the rest of the arena
    untouched); D not a multiple of 64 refused by name."""
    from mamba_ext.gpu import activations
    from mamba_ext.gpu.activations import gate_backward, gate_backward_f16
    monkeypatch.setattr(activations, "_GATE_ROW_BLOCKS", 2)
    rng = np.random.default_rng(13)
    M, D = 200, 128                          # two row blocks of 128 (4 steps), the last partial
    y16 = _f16(rng.standard_normal((M, D)) * 2)
    Y16 = _f16(rng.standard_normal((M, 2 * D)) * 3)
    dgated = rng.standard_normal((M, D)).astype(np.float32)
    yb = g.buffer(M * D // 2, "y16", y16.view(np.uint32))
    Yb = g.buffer(M * D, "Y16", Y16.view(np.uint32))
    dgb = upload(g, "dgated", dgated)
    dy, dY = g.buffer(M * D, "dy"), g.buffer(M * 2 * D, "dY")
    run(g, gate_backward(g, M, D, dgb, yb, Yb, dy, dY, half=True))
    want_dy, want_dz = read(g, dy, (M, D)), read(g, dY, (M, 2 * D))[:, D:]
    db_off = 5
    start = rng.standard_normal(2 * D + 10).astype(np.float32)
    fill = np.full(M * D, 0x7e007e00, np.uint32)           # f16 NaN pairs: what is not written
    sums = []
    for _ in range(2):
        dy16, dY16, gr = g.buffer(M * D, "dy16"), g.buffer(M * D, "dY16", fill), upload(g, "gr", start)
        ops = gate_backward_f16(g, M, D, dgb, yb, Yb, dy16, dY16, gr, db_off)
        run(g, ops)
        assert np.array_equal(read(g, dy16, (M, D)).view(np.uint32), want_dy.view(np.uint32))
        got16 = read(g, dY16, (M * D,), np.uint32).view(np.float16).reshape(M, 2 * D)
        assert np.array_equal(got16[:, D:].view(np.uint16), _f16(want_dz).view(np.uint16))
        assert np.all(got16[:, :D].view(np.uint16) == 0x7e00)
        got = read(g, gr, (start.size,))
        sums.append(got)
        ref = want_dz.astype(np.float64).sum(axis=0)
        assert nerr(got[db_off + D:db_off + 2 * D].astype(np.float64) - start[db_off + D:db_off + 2 * D],
                    ref) <= 1e-5
        untouched = np.r_[0:db_off + D, db_off + 2 * D:start.size]
        assert np.array_equal(got[untouched], start[untouched])
    assert np.array_equal(sums[0], sums[1])
    with pytest.raises(ValueError, match="multiple of 64"):
        gate_backward_f16(g, M, 96, dgb, yb, Yb, dy, dY, gr, 0)


def test_pack_pair_bias_adds_the_column_sums():
    """pack_pair_bias: the same two f16 copies as pack_pair, and the column sums of the f32
    block added to a bias gradient at an offset of the arena (the rest untouched), to f32
    rounding of float64's, the same bits on a second run (a fixed order)."""
    rng = np.random.default_rng(3)
    rows, cols = 192, 128                   # 3 x 2 tiles
    x = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, cols)))).astype(np.float32)
    src = upload(g, "src", x)
    dst, dst_t = g.buffer(rows * cols // 2, "dst"), g.buffer(rows * cols // 2, "dst_t")
    start = rng.standard_normal(cols + 10).astype(np.float32)
    sums = []
    for _ in range(2):
        grad = upload(g, "grad", start)
        run(g, lf.pack_pair_bias(g, dst, dst_t, src, rows, cols, grad, 7))
        sums.append(read(g, grad, (cols + 10,)))
    assert np.array_equal(sums[0].view(np.uint32), sums[1].view(np.uint32))
    got = sums[0]
    assert np.array_equal(got[:7], start[:7]) and np.array_equal(got[7 + cols:], start[7 + cols:])
    want = start[7:7 + cols].astype(np.float64) + x.astype(np.float64).sum(axis=0)
    scale = np.abs(start[7:7 + cols].astype(np.float64)) + np.abs(x.astype(np.float64)).sum(axis=0)
    assert np.all(np.abs(got[7:7 + cols] - want) <= 2e-6 * scale)
    h = read(g, dst_t, (rows * cols // 2,), np.uint32).view(np.float16).reshape(cols, rows)
    assert np.array_equal(h, _f16(x).T)
    h = read(g, dst, (rows * cols // 2,), np.uint32).view(np.float16).reshape(rows, cols)
    assert np.array_equal(h, _f16(x))


@pytest.mark.parametrize("accumulate", [False, True])
def test_reference_products_against_float64(reference, accumulate):
    """forward, dinput and dweight of a linear layer (f16 operands at offsets, f32 result)
    against float64 products of the same f16 values."""
    rng = np.random.default_rng(3)
    M, I, O = 256, 128, 384
    x, w, dy = (_f16(rng.standard_normal(s)) for s in ((M, I), (O, I), (M, O)))
    c0 = {"y": rng.standard_normal((M, O)), "dx": rng.standard_normal((M, I)),
          "dw": rng.standard_normal((O, I)), "dw_t": rng.standard_normal((O, I))}
    bufs = {}
    for name, a in (("x", x), ("w", w), ("dy", dy), ("xt", x.T), ("dyt", dy.T)):
        h = np.concatenate([np.zeros(8, np.float16), np.ravel(a)])     # at f16 offset 8
        bufs[name] = g.buffer(h.size // 2, name, h.view(np.uint32))
    out = {k: upload(g, k, np.concatenate([np.zeros(4), v.ravel()]).astype(np.float32))
           for k, v in c0.items()}
    ops = [lf.product(g, out["y"], bufs["x"], bufs["w"], M, O, I, a_kmajor=True, b_kmajor=True,
                      lda=I, ldb=I, ldc=O, a_off=8, b_off=8, c_off=4, accumulate=accumulate),
           lf.product(g, out["dx"], bufs["dy"], bufs["w"], M, I, O, a_kmajor=True,
                      b_kmajor=False, lda=O, ldb=I, ldc=I, a_off=8, b_off=8, c_off=4,
                      accumulate=accumulate),
           lf.product(g, out["dw"], bufs["dy"], bufs["x"], O, I, M, a_kmajor=False,
                      b_kmajor=False, lda=O, ldb=I, ldc=I, a_off=8, b_off=8, c_off=4,
                      accumulate=accumulate),
           lf.product(g, out["dw_t"], bufs["dyt"], bufs["xt"], O, I, M, a_kmajor=True,
                      b_kmajor=True, lda=M, ldb=M, ldc=I, a_off=8, b_off=8, c_off=4,
                      accumulate=accumulate)]
    run(g, ops)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    want = {"y": x64 @ w64.T, "dx": dy64 @ w64, "dw": dy64.T @ x64, "dw_t": dy64.T @ x64}
    for k, v in want.items():
        if accumulate:
            v = v + c0[k].astype(np.float32)
        got = read(g, out[k], (v.size + 4,))[4:].reshape(v.shape)
        assert nerr(got, v) <= 2e-6, k


def test_reference_split_weight_gradient(reference):
    """linear_f16.dweight split over K (partial products summed in slice order into the
    gradient, linear.split_sum) and unsplit, against float64 (bench.check_f16_products)."""
    from mamba_ext.bench.gpu import check_f16_products
    assert lf.dweight_splits(4 * lf.SPLIT_MIN_K, 384, 128) == 4
    assert lf.dweight_splits(256, 384, 128) == 1
    res = check_f16_products(g, lf, np.random.default_rng(0))
    assert "dweight+= in 4 K slices" in res and max(res.values()) < 1e-5, res


def _model(Dm=128, D=256, n_layers=2, V=64, seed=3):
    p = random_model(V, Dm, n_layers, D, 16, 4, 8, seed)
    return {k: _f16(v).astype(np.float32) for k, v in p.items()}   # f16 values


def test_model_with_f16_products_matches_f32(reference):
    """Loss and every gradient of a two-layer model with in_proj/out_proj in f16 against
    the f32 products on the same (f16-valued) weights: the only difference is the f16
    rounding of the products' activations (2^-11 relative), so agreement to ~1e-3; a lost
    bias, bias gradient or offset would be off by O(1). Checkpointing changes nothing."""
    arrays, dims = check_model(_model())
    rng = np.random.default_rng(5)
    tok, tgt = rng.integers(0, 64, (2, 64)), rng.integers(0, 64, (2, 64))
    loss32, g32 = f16_loss_and_grads(g, arrays, dims, tok, tgt, f16=False)
    loss16, g16 = f16_loss_and_grads(g, arrays, dims, tok, tgt, f16=True)
    assert abs(loss16 - loss32) <= 1e-4 * abs(loss32)
    for k in arrays:
        assert nerr(g16[k], g32[k]) <= 5e-3, k
    loss_ck, g_ck = f16_loss_and_grads(g, arrays, dims, tok, tgt, f16=True, checkpointing=True)
    assert loss_ck == loss16
    assert all(np.array_equal(g_ck[k], g16[k]) for k in arrays)


def test_trainer_runs_the_f16_products_and_skips_on_overflow(reference):
    """ResidentTrainer with a scaler runs the f16 products (f16_active, products()); a
    scale whose gradient seed overflows f16 in the products' operands skips the step with
    the weights bit for bit unchanged and halves the scale; then training proceeds close
    to the f32 products' run."""
    params = _model(n_layers=1)
    rng = np.random.default_rng(7)
    tok, tgt = rng.integers(0, 64, (1, 128)), rng.integers(0, 64, (1, 128))
    tr = G.ResidentTrainer(params, lr=1e-3, scaler=DynamicLossScaler(init_scale=2.0 ** 24))
    assert "tensor cores" in tr.products(1, 128)
    tr.step(tok, tgt)
    assert tr.f16_active and tr.skipped == 1 and tr.t == 0 and tr.scaler.scale == 2.0 ** 23
    got = tr.params()
    assert all(np.array_equal(got[k], params[k]) for k in params)
    ref = G.ResidentTrainer(params, lr=1e-3, f16_products=False,
                            scaler=DynamicLossScaler(init_scale=2.0 ** 8))
    assert "f16_products=False" in ref.products(1, 128)
    tr.scaler = DynamicLossScaler(init_scale=2.0 ** 8)
    for _ in range(3):
        a, b = tr.step(tok, tgt), ref.step(tok, tgt)
        assert abs(a - b) <= 1e-3 * abs(b)
    assert not ref.f16_active and tr.t == 3
    got, want = tr.params(), ref.params()
    for k in params:
        # AdamW's first steps move every weight by about lr whatever its gradient's size,
        # so weights with near-zero gradients may move either way: the changes agree on
        # average, not element by element
        d, e = got[k] - params[k], want[k] - params[k]
        assert np.mean(np.abs(d - e)) <= 0.01 * np.mean(np.abs(e)), k


def test_trainer_says_why_not(reference):
    """Sizes the kernel does not tile (d_model 64) run the f32 products, and say so."""
    params = random_model(64, 64, 1, 128, 16, 4, 8, 1)
    tr = G.ResidentTrainer(params, scaler=DynamicLossScaler())
    assert "multiples of 128" in tr.products(2, 64)
    tok = np.random.default_rng(0).integers(0, 64, (2, 64))
    tr.step(tok, tok)
    assert not tr.f16_active


def test_without_subgroup_matrices_amp_runs_f32_products():
    """Where the device has no f16 subgroup matrices (CI's lavapipe) and the reference is
    not asked for, AMP keeps the f32 products and says why."""
    if lf.available(g):
        pytest.skip("this device has f16 subgroup matrices")
    tr = G.ResidentTrainer(_model(n_layers=1), scaler=DynamicLossScaler())
    assert "MAMBA_EXT_GPU_BACKEND=dawn" in tr.products(1, 128)


def test_dawn_model_with_tensor_core_products():
    """The same comparison as test_model_with_f16_products_matches_f32 with the
    tensor-core kernel (real GPU hardware only)."""
    res = run_with_f16_matrices("bench.check_f16_model(g, np.random.default_rng(0))")
    assert res["loss"] <= 1e-4 and res["grads"] <= 5e-3, res


@pytest.mark.parametrize("Dm", [128, 256])
def test_check_f16_model_on_the_reference(reference, Dm):
    """bench.check_f16_model on the portable kernel: at d_model 256 x_proj's and dt_proj's
    products run in f16 too (test_narrow_products_run_where_they_fit)."""
    res = check_f16_model(g, np.random.default_rng(0), Dm=Dm, n_layers=1, B=1, L=128)
    assert res["loss"] <= 1e-4 and res["grads"] <= 5e-3, res


def test_products_on_the_reference(reference):
    """Every product of linear_f16 on the portable kernel against float64, and forward's
    start value from a bias exactly the bias."""
    from mamba_ext.bench.gpu import check_f16_products
    res = check_f16_products(g, lf, np.random.default_rng(11))
    assert max(res.values()) < 1e-5, res
    assert res["start value"] == 0.0, res
    c, x, bias = g.buffer(128 * 128, "c"), g.buffer(128 * 64, "x"), g.buffer(128, "bias")
    with pytest.raises(ValueError, match="bias start value"):
        lf.forward(g, c, x, x, 128, 128, 128, accumulate=True, bias=(bias, 0))
    with pytest.raises(ValueError, match="bias start value"):
        lf.product(g, c, x, x, 128, 128, 128, a_kmajor=True, b_kmajor=True, lda=128, ldb=128,
                   ldc=128, splits=2, bias=(bias, 0))


def test_bias_fill_is_exact():
    """linear.bias_fill: y[:, off:off+O] = b (+ res[:, :O], rows y_rs apart, as
    linear_forward's residual), other columns untouched; rows not a multiple of 4, columns
    past one block of 256."""
    from mamba_ext.gpu.linear import bias_fill
    rng = np.random.default_rng(11)
    for M, O, rs, with_res in ((37, 24, 40, False), (37, 24, 40, True), (9, 300, 310, True)):
        w = rng.standard_normal(O + 10).astype(np.float32)
        res = rng.standard_normal((M, rs)).astype(np.float32)
        y0 = rng.standard_normal((M, rs)).astype(np.float32)
        wb, rb = upload(g, "w", w), upload(g, "res", res)
        yb = upload(g, "y", y0)
        run(g, bias_fill(g, M, O, wb, 7, yb, 8, rs, res=rb if with_res else None))
        got = read(g, yb, (M, rs))
        want = y0.copy()
        want[:, 8:8 + O] = w[7:7 + O] + (res[:, :O] if with_res else 0)   # res: row stride rs
        assert np.array_equal(got, want), with_res


def test_gpu_training_writes_metrics_with_grad_norms(tmp_path):
    """train --device gpu --amp: the metrics file has each step's loss and the GPU's
    gradient norm, and says in the log which products ran."""
    import json
    from mamba_ext.training.loop import TrainConfig, train
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"def f(x):\n    return x * 2\n" * 400)
    logs = []
    res = train(TrainConfig(data=str(corpus), device="gpu", amp=True, steps=3, d_model=32,
                            n_layers=1, batch=2, seq_len=32), tmp_path / "run", progress=None,
                log=logs.append)
    rows = [json.loads(line) for line in open(res["metrics"], encoding="utf-8")]
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert [r["loss"] for r in rows[:3]] == res["losses"]
    assert all(r["grad_norm"] > 0 for r in rows[:3])
    assert any(m.startswith("amp on the GPU: ") for m in logs)
