"""kernels/linear_f16.wgsl (mamba_ext.gpu.linear_f16): the tensor-core products, f16
operands and f32 accumulation through WGSL subgroup matrices.

They run only on a device with f16 subgroup matrices, i.e. Dawn on a real GPU: Dawn does
not start on Debian 12's lavapipe (Mesa 22.3), so the run against float64 below skips
there, CI included (the one exception of the optional-dependency rule: code that needs
GPU hardware CI cannot have). What CI runs: the planning of the kernel from an adapter's
subgroup-matrix shapes, the size checks, and the clear refusal on a device without them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_support import require_gpu, run_with_f16_matrices
from mamba_ext.gpu import linear_f16 as lf

NVIDIA = [{"m": 16, "n": 16, "k": 16}, {"m": 16, "n": 8, "k": 16}, {"m": 16, "n": 8, "k": 8}]


def test_tall_tile_only_where_the_device_allows_it(monkeypatch):
    """A tile of 512 invocations is laid out 4 x 4 (64 x 32 per subgroup) where the device
    allows 512 invocations and its workgroup memory; a product takes it where its sizes
    divide, else the unit tile."""
    tall = (256, 128, 16, 512)
    big = SimpleNamespace(subgroup_size=32, f16_matrices=NVIDIA, max_invocations=1024,
                          wg_memory=49152)
    assert lf.plan(big, tall) == ({"m": 16, "n": 16, "k": 16}, 4, 4)
    assert lf.plan(SimpleNamespace(**{**vars(big), "max_invocations": 256}), tall) is None
    assert lf.plan(SimpleNamespace(**{**vars(big), "wg_memory": 32768}), tall) is None
    assert lf._staged_bytes(lf.UNIT_TILE) <= 49152
    monkeypatch.setattr(lf, "TILES", (tall, lf.UNIT_TILE))
    assert lf.tile_for(big, 16384, 3072, 768) == tall
    assert lf.tile_for(big, 128 * 3, 3072, 768) == (128, 128, 32, 256)     # M not a multiple of 256
    assert lf.tile_for(SimpleNamespace(**{**vars(big), "max_invocations": 256}), 16384, 3072,
                       768) == (128, 128, 32, 256)
    text = lf.prelude(big, True, True, False, 768, 768, 768, 3072, tile=tall)
    assert "const BM : u32 = 256u;\nconst BN : u32 = 128u;\nconst BK : u32 = 16u;\n" in text
    assert "const WGS : u32 = 512u;" in text and "const WN : u32 = 4u;" in text


def test_tiles_follow_the_workgroup_memory():
    """With 48 KB of workgroup memory the products take k steps of 32; with 32 KB (Apple's
    GPUs) steps of 16, whose staging fits; with 16 KB no tile does: not available (the fp32
    products are the fallback), and a product asked for anyway is refused by name."""
    apple = [{"m": 8, "n": 8, "k": 8}]
    dev = lambda mem, mats=NVIDIA: SimpleNamespace(subgroup_size=32, f16_matrices=mats,   # noqa: E731
                                                   max_invocations=1024, wg_memory=mem)
    assert lf.available(dev(49152)) and lf.tile_for(dev(49152), 16384, 3072, 768) == (128, 128, 32, 256)
    assert lf.available(dev(32768, apple))
    assert lf.tile_for(dev(32768, apple), 16384, 3072, 768) == (128, 128, 16, 256)
    assert lf.plan(dev(32768, apple), (128, 128, 16, 256)) == (apple[0], 2, 4)
    assert lf._staged_bytes((128, 128, 16, 256)) <= 32768 < lf._staged_bytes((128, 128, 32, 256))
    assert not lf.available(dev(16384))
    with pytest.raises(ValueError, match="no workgroup tile"):
        lf.tile_for(dev(16384), 16384, 3072, 768)


def test_plan_follows_the_adapter():
    """The subgroup-matrix shape is the adapter's largest that tiles a subgroup's block;
    the subgroups of a workgroup form a grid as square as it goes, WN >= WM."""
    plan = lf.plan(SimpleNamespace(subgroup_size=32, f16_matrices=NVIDIA))
    assert plan == ({"m": 16, "n": 16, "k": 16}, 2, 4)
    plan = lf.plan(SimpleNamespace(subgroup_size=64, f16_matrices=NVIDIA))  # AMD wave64
    assert plan[1:] == (2, 2)
    plan = lf.plan(SimpleNamespace(subgroup_size=32, f16_matrices=[{"m": 8, "n": 8, "k": 8}]))
    assert plan == ({"m": 8, "n": 8, "k": 8}, 2, 4)                          # Apple
    assert lf.plan(SimpleNamespace(subgroup_size=32, f16_matrices=[])) is None
    assert lf.plan(SimpleNamespace(subgroup_size=0, f16_matrices=NVIDIA)) is None
    assert lf.plan(SimpleNamespace(subgroup_size=32, f16_matrices=[{"m": 48, "n": 16, "k": 16}])) is None
    text = lf.prelude(SimpleNamespace(subgroup_size=32, f16_matrices=NVIDIA), True, False, True,
                      768, 768, 3072, 3072)
    assert "const BM : u32 = 128u;\nconst BN : u32 = 128u;\nconst BK : u32 = 32u;\n" in text
    assert text.startswith("enable f16;\nenable chromium_experimental_subgroup_matrix;\n")
    for line in ("const TM : u32 = 16u;", "const WM : u32 = 2u;", "const A_KMAJOR : bool = true;",
                 "const B_KMAJOR : bool = false;", "const ACCUMULATE : bool = true;",
                 "const KLEN : u32 = 768u;", "const LDC : u32 = 3072u;"):
        assert line in text


def test_subgroup_size_from_the_adapter():
    """A fixed size where the adapter reports one (min = max); 32 on NVIDIA, for which Dawn
    (wgpudawn: keys spelled stackgroup_*) reports only its bounds 4 .. 128; else unknown."""
    from mamba_ext.gpu.device import _subgroup_size
    assert _subgroup_size({"subgroup_min_size": 32, "subgroup_max_size": 32}) == 32
    assert _subgroup_size({"stackgroup_min_size": 4, "stackgroup_max_size": 128,
                           "vendor": "NVIDIA", "vendor_id": 4318}) == 32
    assert _subgroup_size({"stackgroup_min_size": 4, "stackgroup_max_size": 128,
                           "vendor": "AMD", "vendor_id": 4098}) == 0
    assert _subgroup_size({}) == 0


def test_sizes_the_kernel_refuses():
    assert lf.unsupported(256, 128, 64, 64, 64, 128) is None
    assert "multiples of 128" in lf.unsupported(200, 128, 64, 64, 64, 128)
    assert "multiples of 128" in lf.unsupported(256, 128, 48, 48, 64, 128)
    assert "multiples of 8" in lf.unsupported(256, 128, 64, 68, 64, 128)
    assert "multiples of 8" in lf.unsupported(256, 128, 64, 64, 64, 128, a_off=4)
    assert "multiples of 4" in lf.unsupported(256, 128, 64, 64, 64, 130)
    assert "empty" in lf.unsupported(0, 128, 64, 64, 64, 128)


def test_refused_clearly_without_subgroup_matrices():
    """wgpu-native (CI's lavapipe) has no subgroup matrices: available() says so and a
    product is refused with the way to get them, before anything is recorded."""
    g = require_gpu()
    if g.f16_matrices:
        pytest.skip("this device has f16 subgroup matrices")
    assert not lf.available(g)
    with pytest.raises(RuntimeError, match="MAMBA_EXT_GPU_BACKEND=dawn"):
        lf.forward(g, None, None, None, 128, 128, 128)


def test_dawn_products_match_float64():
    """forward, dX and dW, written and accumulated, against float64 products of the same
    f16 inputs: f32 accumulation of exact f16 x f16 products."""
    res = run_with_f16_matrices("bench.check_f16_products(g, lf, np.random.default_rng(0))")
    assert set(res) == {"forward", "forward+=", "dinput", "dinput+=", "dweight", "dweight+=",
                        "forward+bias", "start value", "dweight+= in 4 K slices",
                        "narrow forward+bias", "narrow dW^T+= in 4 K slices",
                        "narrow dW+= in 4 K slices"}
    assert max(res.values()) < 1e-5, res
    assert res["start value"] == 0.0, res      # the bias, exactly
