"""Public block API: contract, dtypes, bad input, empty shapes, cache misuse, cache size."""
import math
import tracemalloc

import numpy as np
import pytest
from conftest import golden_tolerance, load_golden

import mamba_ext
from mamba_ext.testing.gradcheck import random_block_params

NAMES = mamba_ext.BLOCK_PARAM_NAMES
fwd, bwd = mamba_ext.mamba1_forward, mamba_ext.mamba1_backward


def make(Dm=4, D=8, N=3, K=3, R=2, B=2, L=7, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    params = random_block_params(rng, Dm, D, N, K, R, dtype)
    x = rng.normal(size=(B, L, Dm)).astype(dtype)
    dout = rng.normal(size=(B, L, Dm)).astype(dtype)
    return x, params, dout


def run(x, params, dout, **kw):
    out, cache = fwd(x, params, **kw)
    dx, grads = bwd(dout, params, cache)
    return out, dx, grads


# --- the contract ---------------------------------------------------------------------------

def test_param_names_follow_golden_order():
    keys = [k[2:] for k in load_golden("block_basic") if k.startswith("w_")]
    assert tuple(NAMES) == tuple(keys) and len(NAMES) == 13


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shapes_and_dtypes(dtype):
    x, params, dout = make(dtype=dtype)
    out, cache = fwd(x, params)
    assert out.shape == x.shape and out.dtype == dtype
    dx, grads = bwd(dout, params, cache)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert isinstance(grads, dict) and list(grads) == list(NAMES)
    for n in NAMES:
        assert grads[n].shape == params[n].shape and grads[n].dtype == dtype, n
        assert np.all(np.isfinite(grads[n])), n


def test_inputs_are_not_modified():
    x, params, dout = make()
    copies = {n: p.copy() for n, p in params.items()}
    x0, d0 = x.copy(), dout.copy()
    run(x, params, dout)
    assert np.array_equal(x, x0) and np.array_equal(dout, d0)
    for n in NAMES:
        assert np.array_equal(params[n], copies[n]), n


def test_backward_twice_from_one_cache_is_identical():
    x, params, dout = make()
    _, cache = fwd(x, params)
    dx1, g1 = bwd(dout, params, cache)
    dx2, g2 = bwd(dout, params, cache)
    assert np.array_equal(dx1, dx2)
    for n in NAMES:
        assert np.array_equal(g1[n], g2[n]), n


def test_float32_agrees_with_float64():
    """Longer than one scan chunk; float32 within the golden rule of the float64 result."""
    x, params, dout = make(Dm=16, D=32, N=8, K=4, R=2, B=2, L=150, seed=3)
    out64, dx64, g64 = run(x, params, dout)
    out32, dx32, g32 = run(x.astype(np.float32), {n: p.astype(np.float32) for n, p in params.items()},
                           dout.astype(np.float32))
    pairs = [("out", out32, out64), ("dx", dx32, dx64)] + [("g_" + n, g32[n], g64[n]) for n in NAMES]
    for name, ours, ref in pairs:
        tol = golden_tolerance(name, ref, "float32_vs_float64")
        assert np.all(np.abs(ours - ref) <= tol), f"{name}: max err {np.max(np.abs(ours - ref)):.3g}"


def test_thread_count_does_not_change_results():
    x, params, dout = make(Dm=8, D=16, N=4, B=3, L=70)
    ref = run(x, params, dout, n_threads=1)
    for n_threads in (None, 2):
        out, dx, grads = run(x, params, dout, n_threads=n_threads)
        np.testing.assert_allclose(out, ref[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx, ref[1], rtol=1e-12, atol=1e-12)
        for n in NAMES:
            np.testing.assert_allclose(grads[n], ref[2][n], rtol=1e-10, atol=1e-12 * np.abs(ref[2][n]).max())


def test_array_likes_and_non_contiguous_inputs():
    x, params, dout = make()
    out, dx, grads = run(x, params, dout)
    # nested Python lists everywhere -> float64
    l_out, l_dx, l_grads = run(x.tolist(), {n: p.tolist() for n, p in params.items()}, dout.tolist())
    assert l_out.dtype == np.float64
    np.testing.assert_array_equal(l_out, out)
    np.testing.assert_array_equal(l_dx, dx)
    # Fortran-ordered and strided views give the same numbers
    xf = np.asfortranarray(x)
    pf = {n: np.asfortranarray(p) for n, p in params.items()}
    pf["wInProj"] = np.ascontiguousarray(params["wInProj"][:, ::-1])[:, ::-1]  # negative strides
    doutv = np.repeat(dout, 2, axis=2)[:, :, ::2]
    s_out, s_dx, s_grads = run(xf, pf, doutv)
    np.testing.assert_array_equal(s_out, out)
    np.testing.assert_array_equal(s_dx, dx)
    for n in NAMES:
        np.testing.assert_array_equal(s_grads[n], grads[n])
        np.testing.assert_array_equal(l_grads[n], grads[n])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_init_params(dtype):
    p = mamba_ext.init_mamba1_params(16, dtype=dtype)
    D, N, K, R = 32, 16, 4, 1
    shapes = {"wInProj": (2 * D, 16), "bInProj": (2 * D,), "wConv": (D, K), "bConv": (D,),
              "wXProj": (R + 2 * N, D), "bXProj": (R + 2 * N,), "wDtProj": (D, R), "bDtProj": (D,),
              "A_log": (D, N), "D_vec": (D,), "wOutProj": (16, D), "bOutProj": (16,), "normWeight": (16,)}
    assert list(p) == list(NAMES)
    for n in NAMES:
        assert p[n].shape == shapes[n] and p[n].dtype == dtype, n
    np.testing.assert_allclose(p["A_log"], np.log(np.arange(1, N + 1))[None, :].repeat(D, 0), rtol=1e-6)
    assert np.all(p["D_vec"] == 1) and np.all(p["normWeight"] == 1)
    for n in ("bInProj", "bXProj", "bOutProj"):     # bConv, bDtProj: tests/api/test_init.py
        assert np.all(p[n] == 0), n
    for n in ("wInProj", "wConv", "wXProj", "wDtProj", "wOutProj"):
        assert 0 < np.std(p[n]) < 1, n
    # sizes and determinism
    q = mamba_ext.init_mamba1_params(33, d_state=5, d_conv=2, expand=3, seed=1, dtype=dtype)
    assert q["wDtProj"].shape == (99, math.ceil(33 / 16)) and q["A_log"].shape == (99, 5)
    assert q["wConv"].shape == (99, 2)
    assert mamba_ext.init_mamba1_params(12, dt_rank=4)["wDtProj"].shape == (24, 4)
    again = mamba_ext.init_mamba1_params(33, d_state=5, d_conv=2, expand=3, seed=1, dtype=dtype)
    other = mamba_ext.init_mamba1_params(33, d_state=5, d_conv=2, expand=3, seed=2, dtype=dtype)
    assert all(np.array_equal(q[n], again[n]) for n in NAMES)
    assert not np.array_equal(q["wInProj"], other["wInProj"])
    out, cache = fwd(np.ones((1, 3, 33), dtype), q)
    assert np.all(np.isfinite(out))


# --- empty shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("B,L", [(0, 5), (2, 0), (0, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_batch_or_sequence(B, L, dtype):
    _, params, _ = make(dtype=dtype)
    x = np.zeros((B, L, 4), dtype)
    out, cache = fwd(x, params)
    assert out.shape == (B, L, 4) and out.dtype == dtype
    dx, grads = bwd(np.zeros((B, L, 4), dtype), params, cache)
    assert dx.shape == (B, L, 4) and dx.dtype == dtype
    for n in NAMES:
        assert grads[n].shape == params[n].shape and grads[n].dtype == dtype
        assert np.all(grads[n] == 0), n


# --- bad input ------------------------------------------------------------------------------

def test_mixed_dtypes_are_type_errors():
    x, params, dout = make(dtype=np.float32)
    with pytest.raises(TypeError):
        fwd(x.astype(np.float64), params)
    p = dict(params, A_log=params["A_log"].astype(np.float64))
    with pytest.raises(TypeError, match="A_log"):
        fwd(x, p)
    _, cache = fwd(x, params)
    with pytest.raises(TypeError, match="dout"):
        bwd(dout.astype(np.float64), params, cache)


@pytest.mark.parametrize("bad", [np.int32, np.int64, np.complex64, np.complex128, object, np.float16, bool])
def test_bad_dtypes_of_x(bad):
    x, params, _ = make()
    with pytest.raises(TypeError, match="x"):
        fwd(x.astype(bad), params)


@pytest.mark.parametrize("bad", [np.int64, np.complex128, object])
@pytest.mark.parametrize("name", ["wInProj", "A_log", "normWeight"])
def test_bad_dtypes_of_params(name, bad):
    x, params, _ = make()
    p = dict(params)
    p[name] = params[name].astype(bad)
    with pytest.raises(TypeError, match=name):
        fwd(x, p)


@pytest.mark.parametrize("shape", [(2, 7), (7, 4), (1, 2, 7, 4), (2, 7, 5), (2, 7, 3)])
def test_bad_x_shape(shape):
    _, params, _ = make()
    with pytest.raises(ValueError, match="x|wInProj") as e:
        fwd(np.zeros(shape), params)
    assert str(shape[-1]) in str(e.value) or str(shape) in str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_bad_param_shape_names_the_parameter(name):
    x, params, _ = make()
    p = dict(params)
    bigger = params[name].shape[:-1] + (params[name].shape[-1] + 1,)
    if name in ("wConv", "A_log", "wDtProj", "wInProj"):
        # these define dConv, dState, dtRank, dModel: a new last axis is a consistent
        # new size, so change the first axis instead (dInner / 2*dInner)
        bigger = (params[name].shape[0] + 1,) + params[name].shape[1:]
    p[name] = np.zeros(bigger)
    with pytest.raises(ValueError) as e:
        fwd(x, p)
    msg = str(e.value)
    assert name in msg, msg
    assert "expected" in msg.lower(), msg


@pytest.mark.parametrize("name", NAMES)
def test_bad_param_rank_names_the_parameter(name):
    x, params, _ = make()
    p = dict(params)
    p[name] = params[name][..., None]
    with pytest.raises(ValueError, match=name):
        fwd(x, p)
    # a scalar is reported as given, shape () (not as the (1,) a contiguous copy would make)
    p[name] = params[name].dtype.type(1)
    with pytest.raises(ValueError, match=rf"{name}: expected a {params[name].ndim}-D array, "
                                         r"got shape \(\)"):
        fwd(x, p)


def test_missing_unknown_and_non_mapping_params():
    x, params, _ = make()
    p = dict(params)
    del p["D_vec"]
    with pytest.raises(ValueError, match="D_vec"):
        fwd(x, p)
    with pytest.raises(ValueError, match="extra_w"):
        fwd(x, dict(params, extra_w=np.zeros(3)))
    with pytest.raises(TypeError, match="params"):
        fwd(x, list(params.values()))


def test_zero_sizes_in_params_are_refused():
    x, params, _ = make()
    p = dict(params, A_log=np.zeros((8, 0)))
    with pytest.raises(ValueError):
        fwd(x, p)


def test_bad_discretization():
    x, params, _ = make()
    with pytest.raises(ValueError, match="discretization"):
        fwd(x, params, discretization="bilinear")


def test_overflowing_sizes_raise_value_error():
    """B*L*dInner overflows the kernels' indexing: refused before any allocation."""
    _, params, _ = make()
    huge = np.broadcast_to(np.zeros((1, 1, 4)), (2 ** 28, 2 ** 28, 4))   # a view, no memory
    with pytest.raises(ValueError):
        fwd(huge, params)


# --- cache misuse ---------------------------------------------------------------------------

def test_cache_with_other_params_or_dout_shape():
    x, params, dout = make()
    _, cache = fwd(x, params)
    changed = dict(params, D_vec=params["D_vec"] + 1.0)
    with pytest.raises(ValueError):
        bwd(dout, changed, cache)
    _, other, _ = make(Dm=4, D=6, N=2, K=2, R=1)
    with pytest.raises(ValueError):
        bwd(dout, other, cache)
    with pytest.raises(ValueError, match="dout"):
        bwd(dout[:, :-1], params, cache)
    with pytest.raises(ValueError, match="dout"):
        bwd(dout[None], params, cache)
    with pytest.raises(TypeError):
        bwd(dout, params, None)
    with pytest.raises(TypeError):
        bwd(dout, params, np.zeros(100))


def test_cache_of_other_dtype():
    x, params, dout = make(dtype=np.float32)
    _, cache = fwd(x, params)
    p64 = {n: p.astype(np.float64) for n, p in params.items()}
    with pytest.raises((TypeError, ValueError)):
        bwd(dout.astype(np.float64), p64, cache)


# --- cache size -----------------------------------------------------------------------------

def test_cache_nbytes_is_lean():
    """No (B, L, D, N) tensor: cache and traced peak memory well below its size."""
    B, L, Dm, D, N = 1, 2048, 16, 64, 64
    x, params, dout = make(Dm=Dm, D=D, N=N, K=4, R=1, B=B, L=L, dtype=np.float32)
    full = B * L * D * N * 4
    tracemalloc.start()
    try:
        _, cache = fwd(x, params)
        bwd(dout, params, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(cache.nbytes, int)
    assert 0 < cache.nbytes < 0.25 * full, (cache.nbytes, full)
    assert peak < 0.5 * full, f"traced peak {peak} bytes vs B*L*D*N*4 = {full}"


def test_cache_nbytes_scales_linearly_and_with_itemsize():
    sizes = dict(Dm=8, D=16, N=8, K=4, R=1, B=2)
    n = {}
    for L in (256, 512):
        for dtype in (np.float32, np.float64):
            x, params, _ = make(L=L, dtype=dtype, **sizes)
            n[L, dtype] = fwd(x, params)[1].nbytes
    assert 1.8 <= n[512, np.float32] / n[256, np.float32] <= 2.2
    assert 1.9 <= n[256, np.float64] / n[256, np.float32] <= 2.1


@pytest.mark.parametrize("B,L", [(1, 1), (2, 63), (2, 64), (3, 65), (1, 200)])
def test_cache_nbytes_matches_documented_formula(B, L):
    """BlockCache docstring / README: itemsize * (M*(Dm + 1 + 4D + P) + B*ceil(L/T)*D*N)."""
    from mamba_ext.cpu import block as _block
    T = _block.SCAN_CHUNK
    Dm, D, N, K, R = 5, 12, 3, 4, 2
    for dtype in (np.float32, np.float64):
        x, params, _ = make(Dm=Dm, D=D, N=N, K=K, R=R, B=B, L=L, dtype=dtype)
        M, P = B * L, R + 2 * N
        expected = np.dtype(dtype).itemsize * (M * (Dm + 1 + 4 * D + P) + B * math.ceil(L / T) * D * N)
        assert fwd(x, params)[1].nbytes == expected
