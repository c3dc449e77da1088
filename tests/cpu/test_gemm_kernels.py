"""The float32 GEMM behind every linear layer: SciPy's BLAS or mamba_ext's AVX-512 sgemm
(csrc/mx_sgemm.h; its C test: tests/csrc/test_mx_sgemm.c), chosen by
mamba_ext.cpu.linear.set_gemm ("auto": ours where the CPU has AVX-512 and OpenBLAS runs
kernels without it).

Size letters: M rows, IC input columns, OC output columns.
"""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext import mamba1_backward, mamba1_forward, model_loss_and_grads
from mamba_ext.block import init_mamba1_params
from mamba_ext.cpu import linear
from mamba_ext.model import init_model_params

try:
    linear.set_gemm(linear.set_gemm("avx512"))
    HAS_AVX512 = True
except ValueError:
    HAS_AVX512 = False
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512F: the "
                                  "core never runs mamba_ext's sgemm here")
KINDS = ["blas"] + (["avx512"] if HAS_AVX512 else [])


@pytest.fixture
def gemm():
    """set_gemm for one test, restored after it."""
    prev = linear.set_gemm("auto")
    yield linear.set_gemm
    linear.set_gemm(prev)


def _cpu_is_amd():
    """From /proc/cpuinfo (Linux), else platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return "AuthenticAMD" in f.read()
    except OSError:
        import platform
        return "AMD" in platform.processor()


def test_auto_follows_the_cpu_and_the_blas(gemm):
    gemm("auto")
    core = linear.blas_corename().lower()
    openblas = HAS_AVX512 and linear.BLAS_CONTROLS == "openblas" and core != ""
    want = openblas and core not in ("skylakex", "cooperlake", "sapphirerapids")
    assert linear.gemm_kernel() == ("avx512" if want else "blas")
    # the weight gradients: ours also on an AMD CPU whose OpenBLAS runs AVX-512 kernels
    want_dw = want or (openblas and _cpu_is_amd())
    assert linear.gemm_kernel(weight_gradient=True) == ("avx512" if want_dw else "blas")
    assert gemm("blas") == "auto" and linear.gemm_kernel() == "blas"
    assert linear.gemm_kernel(weight_gradient=True) == "blas"
    if HAS_AVX512:
        gemm("avx512")
        assert linear.gemm_kernel() == linear.gemm_kernel(weight_gradient=True) == "avx512"


def test_bad_choices_refused(gemm):
    with pytest.raises(ValueError, match="kind must be one of auto, blas, avx512"):
        gemm("fast")
    with pytest.raises(ValueError, match="kind must be one of"):
        gemm(None)
    if not HAS_AVX512:
        with pytest.raises(ValueError, match="needs an x86-64 CPU with AVX-512F"):
            gemm("avx512")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M, IC, OC", [(1, 7, 5), (3, 33, 70), (95, 64, 13), (300, 200, 97),
                                       (1000, 385, 40), (70, 1, 2100)])
def test_product_matches_float64(gemm, kind, dtype, M, IC, OC):
    gemm(kind)
    rng = np.random.default_rng(M + IC)
    x = rng.standard_normal((M, IC)).astype(dtype)
    w = rng.standard_normal((OC, IC)).astype(dtype)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = linear.product(x, w, n_threads=2)
    assert got.dtype == dtype and got.shape == (M, OC)
    eps = np.finfo(dtype).eps
    bound = (IC + 2) * eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(got - want) <= bound + 1e-30)


def test_product_refuses_bad_input():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(TypeError, match="x must be a 2-D float32 or float64"):
        linear.product([[1.0]], x)
    with pytest.raises(TypeError, match="weight must be a 2-D float32 or float64"):
        linear.product(x, np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="one dtype"):
        linear.product(x, np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match=r"weight must be \(OC, 3\)"):
        linear.product(x, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        linear.product(np.zeros((3, 4), np.float32).T, x)
    with pytest.raises(ValueError, match="n_threads: expected None or an integer"):
        linear.product(x, x, n_threads=0)
    with pytest.raises(TypeError, match="n_threads: expected None or an integer"):
        linear.product(x, x, n_threads=True)
    assert np.array_equal(linear.product(np.zeros((2, 0), np.float32),
                                         np.zeros((3, 0), np.float32)), np.zeros((2, 3)))


def test_product_into_out():
    """out=: the product written into the given array (which is returned), bitwise the
    product into a new one; an unusable out is refused, naming it."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((70, 24)).astype(np.float32)
    w = rng.standard_normal((33, 24)).astype(np.float32)
    out = np.full((70, 33), np.nan, np.float32)
    got = linear.product(x, w, n_threads=2, out=out)
    assert got is out
    assert np.array_equal(out, linear.product(x, w, n_threads=2))
    with pytest.raises(TypeError, match=r"out must be None or a float32 numpy array of shape \(70, 33\)"):
        linear.product(x, w, out=np.zeros((70, 33), np.float64))
    with pytest.raises(TypeError, match="out must be None"):
        linear.product(x, w, out=np.zeros((33, 70), np.float32))
    with pytest.raises(TypeError, match="out must be None"):
        linear.product(x, w, out=[[0.0] * 33] * 70)
    with pytest.raises(ValueError, match="out must be C-contiguous and writeable"):
        linear.product(x, w, out=np.zeros((33, 70), np.float32).T)
    ro = np.zeros((70, 33), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be C-contiguous and writeable"):
        linear.product(x, w, out=ro)
    sq = rng.standard_normal((24, 24)).astype(np.float32)
    with pytest.raises(ValueError, match="out must not overlap"):
        linear.product(sq, sq, out=sq)


# Shapes around OpenBLAS's small-matrix bound (10^6 multiply-adds; its AVX-512 kernel sets
# sum such products in another order): whole products just above it, whose slices on 2-8
# threads would fall below, a TN product of few output columns (its small kernel needs
# OC * rows <= 1200), and one below the bound (one call on every thread count).
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M, IC, OC", [(390, 160, 21), (1000, 40, 26), (480, 100, 30),
                                       (200, 64, 64), (4096, 4, 128)])
def test_product_bitwise_for_any_thread_count(gemm, kind, dtype, M, IC, OC):
    gemm(kind)
    rng = np.random.default_rng(M * OC)
    x = rng.standard_normal((M, IC)).astype(dtype)
    w = rng.standard_normal((OC, IC)).astype(dtype)
    ref = linear.product(x, w, n_threads=1)
    for nt in range(2, 9):
        np.testing.assert_array_equal(linear.product(x, w, n_threads=nt), ref,
                                      err_msg=f"n_threads={nt}")


def _block(n_threads, dm=80):
    p = init_mamba1_params(dm, d_state=8, seed=2, dtype=np.float32)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (3, 130, dm)).astype(np.float32)
    dout = rng.normal(0, 1, x.shape).astype(np.float32)
    out, cache = mamba1_forward(x, p, n_threads=n_threads)
    dx, g = mamba1_backward(dout, p, cache, n_threads=n_threads)
    return out, dx, g


# d_model 80: every weight gradient with fewer rows than columns formed transposed in scratch;
# 192: out_proj's (192 x 384) split by its rows instead (linear.pyx, DWT_MAX_OC). "auto":
# where it gives the weight gradients of in_proj and out_proj (dm 192) to our sgemm and the
# other products to the BLAS, the mix is bitwise for any thread count as well.
@needs_avx512
@pytest.mark.parametrize("kind", ["avx512", "auto"])
@pytest.mark.parametrize("dm", [80, 192])
def test_own_sgemm_block_bitwise_for_any_thread_count_and_close_to_blas(gemm, dm, kind):
    gemm(kind)
    ref = _block(1, dm)
    for nt in (2, 3, 5):
        out, dx, g = _block(nt, dm)
        np.testing.assert_array_equal(out, ref[0])
        np.testing.assert_array_equal(dx, ref[1])
        assert all(np.array_equal(g[k], ref[2][k]) for k in g)
    gemm("blas")
    out, dx, g = _block(2, dm)
    for a, b in [(out, ref[0]), (dx, ref[1])] + [(g[k], ref[2][k]) for k in g]:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


@needs_avx512
@pytest.mark.parametrize("kind", ["avx512", "auto"])
def test_own_sgemm_model_gradients_close_to_blas(gemm, kind):
    p = init_model_params(64, 48, 2, seed=0)
    rng = np.random.default_rng(0)
    tok, tgt = rng.integers(0, 64, (4, 150)), rng.integers(0, 64, (4, 150))
    gemm("blas")
    l0, g0 = model_loss_and_grads(tok, tgt, p, n_threads=2)
    gemm(kind)
    l1, g1 = model_loss_and_grads(tok, tgt, p, n_threads=3)
    assert abs(l1 - l0) <= 1e-6 * abs(l0)
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=1e-3, atol=1e-5 * np.abs(g0[k]).max())
