"""mamba_ext.gpu.device: adapter limits and messages, the kernel loader and pipeline
cache, and the house rules of every kernels/*.wgsl file (legend, binding table,
vocabulary, entry-point names)."""
from __future__ import annotations

import re

import pytest

from gpu_support import require_gpu

g = require_gpu()
from mamba_ext.gpu.device import Gpu, kernel_dir, kernel_source  # noqa: E402

KERNEL_FILES = sorted(p.name for p in kernel_dir().iterdir()
                      if p.name.endswith(".wgsl"))


def test_limits_refused_with_message():
    with pytest.raises(ValueError, match="max_storage_buffer_binding_size"):
        g.buffer(g.max_binding // 4 + 1, "too_big")
    with pytest.raises(ValueError, match="max_compute_workgroups_per_dimension"):
        g.check_grid((g.max_groups + 1, 1, 1), "test")
    gx = g.grid1d(g.max_groups * 3 + 1, "split")     # split into y instead of refused
    assert gx[0] <= g.max_groups and gx[0] * gx[1] >= g.max_groups * 3 + 1


def test_no_adapter_message(monkeypatch):
    from mamba_ext.gpu import backends
    backend = backends.load()       # the module the device asks: wgpu-native's or Dawn's
    monkeypatch.setattr(backend.module().gpu, "request_adapter_sync", lambda **kw: None)
    monkeypatch.delenv("MAMBA_EXT_GPU_INDEX", raising=False)
    want = "mesa-vulkan-drivers" if backend.NAME == "wgpu" else "found no adapter"
    with pytest.raises(RuntimeError, match=want):
        Gpu()


def test_kernel_sources_found_and_included():
    src = kernel_source("scan")
    assert "fn scan_backward_grads" in src and "fn expm1_f" in src     # common.wgsl prepended
    assert "fn block_reduce" in kernel_source("rmsnorm")               # the include expanded


def test_pipelines_built_once():
    from mamba_ext.gpu import scan as S
    a = g.pipeline("scan_sums_workgroup", "scan_forward_carry", S.scan_constants(128))
    b = g.pipeline("scan_sums_workgroup", "scan_forward_carry", S.scan_constants(128))
    c = g.pipeline("scan_sums_workgroup", "scan_forward_carry", S.scan_constants(256))
    assert a is b and a is not c


def _accumulating_product(seed, c0=99.0):
    """A small integer product C (5, 7) += A (5, 6) @ B (6, 7) (exact in float32): (A, B,
    the buffers a, b, c (C starts at c0) and its ops)."""
    import numpy as np
    from mamba_ext.gpu.linear import Mat, gemm
    rng = np.random.default_rng(seed)
    A = rng.integers(-3, 4, (5, 6)).astype(np.float32)
    B = rng.integers(-3, 4, (6, 7)).astype(np.float32)
    a, b = g.buffer(A.size, "t_a", A), g.buffer(B.size, "t_b", B)
    c = g.buffer(35, "t_c", np.full(35, c0, np.float32))
    return A, B, a, b, c, gemm(g, "linear_forward", 5, 7, 6, Mat(a, 0, 6), Mat(b, 0, 7),
                               Mat(c, 0, 7), beta=1)


def test_submit_in_several_command_buffers_runs_every_op_after_the_clears():
    """A submit longer than SUBMIT_FIRST goes in several command buffers: every op runs
    once, after the clears (and the clears only once), as in one pass."""
    import numpy as np
    from mamba_ext.gpu import device as dev
    A, B, a, b, c, op = _accumulating_product(0)
    count = 3 * dev.SUBMIT_FIRST + 5                  # three command buffers
    g.submit(op * count, clears=[c])
    got = g.read(c, 35).reshape(5, 7)
    np.testing.assert_array_equal(got, count * (A @ B))   # small integers: exact
    first, second = g.read_many([(c, 35), (a, 30)])
    np.testing.assert_array_equal(first, got.ravel())
    np.testing.assert_array_equal(second, A.ravel())


@pytest.mark.parametrize("direct", [True, False], ids=["wgpu-native", "wgpu-py"])
@pytest.mark.skipif(g.backend.NAME != "wgpu", reason="wgpu-native's private entry points")
def test_ops_recorded_directly_or_through_wgpu_py_alike(direct, monkeypatch):
    """Ops are recorded by wgpu-native's entry points where the backend has them (the
    default here), else by wgpu-py's methods: the same results, and an invalid dispatch
    still raises when its encoder finishes (wgpu validates the pass there)."""
    import numpy as np
    import wgpu
    from mamba_ext.gpu import device as dev
    assert g._record is not None                      # wgpu-py's wgpu-native backend
    if not direct:
        monkeypatch.setattr(g, "_record", None)
    A, B, a, b, c, op = _accumulating_product(1)
    g.submit(op * 3, clears=[c])
    np.testing.assert_array_equal(g.read(c, 35).reshape(5, 7), 3 * (A @ B))
    g.submit_encoded(g.encode(op * 2, clears=[c]))
    np.testing.assert_array_equal(g.read(c, 35).reshape(5, 7), 2 * (A @ B))
    bad = dev.Op(op[0].pipeline, op[0].bind_group, (g.max_groups + 1, 1, 1), "too_many")
    with pytest.raises(wgpu.GPUValidationError, match="dispatch group size"):
        g.encode([bad])


@pytest.mark.parametrize("native", [True, False], ids=["wgpu-native", "wgpu-py"])
@pytest.mark.skipif(g.backend.NAME != "wgpu", reason="wgpu-native's private entry points")
def test_read_staged_after_later_submissions(native, monkeypatch):
    """read_staged of a step's staging buffer, with that step's submission index, after a
    later step was submitted (as ResidentTrainer.step_async reads back): the values that
    step wrote, by wgpu-native's map-and-poll (waiting for that submission only) or by
    wgpu-py's map_sync; then the later one."""
    import numpy as np
    assert g._native is not None                      # wgpu-py's wgpu-native backend
    if not native:
        monkeypatch.setattr(g, "_native", None)
    A, B, a, b, c, op = _accumulating_product(2, c0=0.0)
    st = [g.staging(35 + 6, f"t_staging{i}") for i in range(2)]
    idx = []
    for i in range(2):                  # C += A @ B (i + 1 times), read back with rows of A
        g.write(a, A if i == 0 else 2 * A)
        idx.append(g.submit_encoded(g.encode(op, reads=(st[i], [(c, 35), (a, 6)]))))
    assert (idx[0] is None) == (not native) and (not native or idx[1] > idx[0])
    first, row = g.read_staged(st[0], [35, 6], idx[0])
    np.testing.assert_array_equal(first.reshape(5, 7), A @ B)     # small integers: exact
    np.testing.assert_array_equal(row, A[0])
    second, row = g.read_staged(st[1], [35, 6], idx[1])
    np.testing.assert_array_equal(second.reshape(5, 7), 3 * (A @ B))
    np.testing.assert_array_equal(row, 2 * A[0])
    again, _ = g.read_staged(st[1], [35, 6])             # no index: waits for everything
    np.testing.assert_array_equal(again, second)
    if native:       # a buffer that cannot be mapped: a clear error, no hang
        with pytest.raises(RuntimeError, match="mapping a read-back buffer failed"):
            g.read_staged(c, [35])


def test_slices_bound_as_their_own_bindings():
    """slices(): arrays of one buffer on 256-byte boundaries, each bound from its own
    offset (the kernel indexes it from 0). A buffer may not be read and written by one
    dispatch, so the copies go to another buffer (the model's batch buffer is only read)."""
    import numpy as np
    from mamba_ext.gpu.device import elementwise, slices
    buf, (a, b, c) = slices(g, "t_slices", (8, 100, 4))
    assert [s.offset for s in (a, b, c)] == [0, 256, 768] and b.size == 400
    assert buf.size >= 768 + 16
    data = np.arange(buf.size // 4, dtype=np.float32)
    g.write(buf, data)
    out = g.buffer(32, "t_slices_out", np.full(32, -1.0, np.float32))
    for src, n, lo in ((b, 8, 64), (c, 1, 768 // 4)):
        g.submit([elementwise(g, "selftest", "copy_vec4", n, [n], [src, out])])
        np.testing.assert_array_equal(g.read(out, 4 * n), data[lo:lo + 4 * n])


def test_shader_checks_chosen_by_environment(monkeypatch):
    from mamba_ext.gpu import device as dev
    monkeypatch.delenv("MAMBA_EXT_GPU_CHECKS", raising=False)
    assert dev._shader_checks() == "bounds"             # the default
    for name in dev.SHADER_CHECKS:
        monkeypatch.setenv("MAMBA_EXT_GPU_CHECKS", f" {name.upper()} ")
        assert dev._shader_checks() == name
    monkeypatch.setenv("MAMBA_EXT_GPU_CHECKS", "fast")
    with pytest.raises(ValueError, match="MAMBA_EXT_GPU_CHECKS must be one of full, bounds, none"):
        dev._shader_checks()


@pytest.mark.skipif(g.backend.NAME != "wgpu", reason="wgpu-native's trusted shader modules")
@pytest.mark.parametrize("trusted", [True, False])
def test_every_shader_checks_mode_gives_the_cpu_block(monkeypatch, trusted):
    """Each MAMBA_EXT_GPU_CHECKS mode compiles every kernel of a block forward and
    backward and gives the CPU result (golden tolerance); trusted=False: a wgpu backend
    without wgpuDeviceCreateShaderModuleTrusted falls back to create_shader_module."""
    import numpy as np
    import mamba_ext
    from mamba_ext import gpu as G
    from mamba_ext.gpu import block as gblock
    from mamba_ext.gpu import device as dev
    from gpu_support import nerr
    if not trusted:
        from wgpu.backends.wgpu_native import _ffi
        monkeypatch.setattr(_ffi, "lib", object())      # no trusted entry point
    rng = np.random.default_rng(5)
    p = mamba_ext.init_mamba1_params(32, seed=2)
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    co, cc = mamba_ext.mamba1_forward(x, p)
    cdx, cgr = mamba_ext.mamba1_backward(dout, p, cc)
    saved = (g.checks, g._modules, g._pipelines)
    plain, real = [], type(g.device).create_shader_module
    monkeypatch.setattr(g.device, "create_shader_module",
                        lambda **kw: plain.append(kw["label"]) or real(g.device, **kw),
                        raising=False)
    try:
        for mode in dev.SHADER_CHECKS:
            g.checks, g._modules, g._pipelines = mode, {}, {}
            monkeypatch.setattr(gblock, "_POOL", {})     # no plan recorded in another mode
            plain.clear()                                # modules made by create_shader_module
            o, c = G.mamba1_forward(x, p)
            dx, gr = G.mamba1_backward(dout, p, c)
            assert set(g._modules) >= {"scan_sums_workgroup", "linear", "conv1d"}, mode
            # the trusted entry point made every module, unless absent or mode "full"
            assert sorted(plain) == (sorted(g._modules) if mode == "full" or not trusted
                                     else []), mode
            assert nerr(o - x, co - x) < 1e-4 and nerr(dx, cdx) < 1e-4, mode
            assert max(nerr(gr[k], cgr[k]) for k in p) < 1e-4, mode
    finally:
        g.checks, g._modules, g._pipelines = saved


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_kernel_file_has_legend_and_binding_table(name):
    """Each file opens with its comment block: what it is, the size letters, its bindings."""
    text = kernel_dir().joinpath(name).read_text(encoding="utf-8")
    head = "\n".join(line for line in text.splitlines()[:60] if line.startswith("//"))
    assert text.startswith(f"// {name} — "), name
    assert "Size letters:" in head, name
    assert re.search(r"[Bb]indings", head), name


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_vocabulary(name):
    """One name per thing (HELPERS.md): no retired names in the kernels."""
    text = kernel_dir().joinpath(name).read_text(encoding="utf-8")
    for old in ("scan_fwd_", "scan_bwd_", "hck", "hstates", "Delta", "dpre", "linear_gemm",
                "reduce_cols", "fn sumsq_", "copy_f32"):
        assert old not in text, (name, old)
    assert not re.search(r"\binv\b", text), name
    entries = re.findall(r"@compute[^\n]*\n(?:@[^\n]*\n)*fn (\w+)", text)
    # <step>_ref.wgsl: the portable reference of <step>.wgsl, with its entry points' names
    step = name[:-len(".wgsl")].removesuffix("_ref")
    for e in entries:      # <step>_forward / <step>_backward (+ phase), or a probe
        ok = (e.startswith(step + "_") or step in ("activations", "reduce", "selftest")
              or e.startswith(("gate_", "softplus_")))
        assert ok, (name, e)


def test_writable_binding_aliasing_refused():
    """WebGPU forbids one buffer behind two bindings of a dispatch where either is
    writable (Dawn refuses such a pass; wgpu-native does not check yet): every op is
    checked when it is recorded, so the whole GPU suite runs conformant dispatches."""
    import numpy as np
    from mamba_ext.gpu.device import Slice, binding_access
    acc = binding_access("linear")
    assert acc[7] and acc[8] and acc[9] and not acc[1] and not acc[6]
    buf = g.buffer(256, "t_alias")
    other = g.buffer(64, "t_alias_other")
    params = [1] * 17
    bufs = [other, other, other, other, other, other, buf, g.dummy(0), buf]
    with pytest.raises(ValueError, match="bindings 7 and 9 alias"):
        g.op("linear", "linear_backward", (1, 1, 1), params, bufs)
    # read-only twice is allowed; disjoint slices of one buffer are too
    bufs = [other, other, other, other, other, other, Slice(buf, 0, 256), g.dummy(0),
            Slice(buf, 256, 256)]
    g.op("linear", "linear_backward", (1, 1, 1), params, bufs)
    # placeholders of one dispatch are distinct buffers
    assert g.dummy(0) is not g.dummy(1) and g.dummy(1) is g.dummy(1)
    # dW and db in one gradient arena: the bias gradient goes through c's binding
    from mamba_ext.gpu.linear import Mat, gemm
    rng = np.random.default_rng(0)
    A = rng.integers(-3, 4, (3, 4)).astype(np.float32)      # dY^T (3 out, 4 rows)
    X = rng.integers(-3, 4, (4, 5)).astype(np.float32)      # X (4 rows, 5 in)
    a, x = g.buffer(A.size, "t_dy", A.T.copy()), g.buffer(X.size, "t_x", X)
    arena = g.buffer(3 * 5 + 3, "t_arena")
    ops = gemm(g, "linear_backward", 3, 5, 4, Mat(a, 0, 1, 3), Mat(x, 0, 5), Mat(arena, 0, 5),
               beta=1, dbias=arena, db_off=15)
    g.submit(ops)
    got = g.read(arena, 18)
    np.testing.assert_array_equal(got[:15].reshape(3, 5), A @ X)
    np.testing.assert_array_equal(got[15:], A.sum(axis=1))
