"""Shared helpers of the GPU tests (tests/gpu/test_*.py import this module: pyproject.toml's
pytest ``pythonpath`` has this folder).

``require_gpu()`` applies the project's optional-dependency rule (conftest.optional:
skip with a reason locally, FAIL under CI=true) to wgpu and to a wgpu adapter.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import optional

WGPU_WHY = "the GPU tests need wgpu: pip install -e '.[test]' (or pip install wgpu)"
ADAPTER_WHY = ("the GPU tests need a Vulkan/Metal/DX12 adapter; on Linux install the software "
               "driver lavapipe: apt-get install mesa-vulkan-drivers")


def require_gpu():
    """Skip (locally) or fail (CI=true) the calling test module unless wgpu imports and
    finds an adapter; returns the mamba_ext.gpu device."""
    from mamba_ext.gpu import backends
    if backends.selected() != "dawn":
        optional("wgpu", WGPU_WHY)
    from mamba_ext.gpu.device import gpu
    try:
        return gpu()
    except RuntimeError as e:
        msg = f"no wgpu adapter ({e}); {ADAPTER_WHY}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true: " + msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def optional_hardware(why: str):
    """Skip the calling test for want of what this device lacks; under CI=true (lavapipe,
    which has it) fail instead."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true: " + why, pytrace=False)
    pytest.skip(why)


def nerr(ours, ref):
    """max|ours - ref| / max|ref| (absolute error for an all-zero reference)."""
    ref = np.asarray(ref, np.float64)
    d = float(np.max(np.abs(np.asarray(ours, np.float64) - ref))) if ref.size else 0.0
    s = float(np.max(np.abs(ref))) if ref.size else 0.0
    return d / s if s > 0 else d


def rand_params(Dm, D, N, K, R, seed, a_log_range=(-2.0, 2.0)):
    """Random float32 block parameters with O(1) activations (biases non-zero)."""
    rng = np.random.default_rng(seed)
    P = R + 2 * N
    f = lambda *s, sd=1.0: (rng.standard_normal(s) * sd).astype(np.float32)
    return {
        "wInProj": f(2 * D, Dm, sd=Dm ** -0.5), "bInProj": f(2 * D, sd=0.3),
        "wConv": f(D, K, sd=(0.81 / K) ** 0.5), "bConv": f(D, sd=0.3),
        "wXProj": f(P, D, sd=D ** -0.5), "bXProj": f(P, sd=0.3),
        "wDtProj": f(D, R, sd=(0.25 / R) ** 0.5),
        "bDtProj": rng.uniform(-2, 0.5, D).astype(np.float32),
        "A_log": rng.uniform(*a_log_range, (D, N)).astype(np.float32),
        "D_vec": f(D, sd=0.5) + 1, "wOutProj": f(Dm, D, sd=D ** -0.5),
        "bOutProj": f(Dm, sd=0.3), "normWeight": f(Dm, sd=0.2) + 1,
    }


def random_model(V, Dm, n_layers, D, N, K, R, seed):
    rng = np.random.default_rng(seed)
    p = {"embedding": (rng.standard_normal((V, Dm)) * 0.5).astype(np.float32),
         "final_norm": (1 + 0.2 * rng.standard_normal(Dm)).astype(np.float32),
         "lm_head_bias": (0.3 * rng.standard_normal(V)).astype(np.float32)}
    for i in range(n_layers):
        for k, v in rand_params(Dm, D, N, K, R, seed + i).items():
            p[f"layer{i}.{k}"] = v
    return p


def f32(rng, *shape, sd=1.0):
    return (rng.standard_normal(shape) * sd).astype(np.float32)


def upload(g, name, arr):
    """A storage buffer holding ``arr`` (float32 or uint32), flattened."""
    a = np.ascontiguousarray(arr).ravel()
    return g.buffer(a.size, name, a)


def run(g, ops, clears=()):
    g.submit(ops if isinstance(ops, list) else [ops], clears)


def read(g, buf, shape, dtype=np.float32):
    return g.read(buf, int(np.prod(shape)), dtype).reshape(shape)


def run_on_dawn(code: str) -> dict:
    """Run the Python ``code`` in a fresh interpreter with MAMBA_EXT_GPU_BACKEND=dawn and
    return the JSON object of its last output line; skip the calling test when that object
    has a "skip" reason (Dawn found no adapter, or the adapter lacks what the test needs:
    real GPU hardware only, the one exception of the optional-dependency rule)."""
    import json
    import subprocess
    import sys
    import textwrap
    optional("wgpudawn", 'pip install "mamba_ext[dawn]"')
    env = dict(os.environ, MAMBA_EXT_GPU_BACKEND="dawn")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"real GPU hardware only: {res['skip']}")
    return res


_F16_PRELUDE = """
import json, numpy as np
from mamba_ext.bench import gpu as bench
from mamba_ext.gpu import device, linear_f16 as lf
try:
    g = device.gpu()
except RuntimeError as e:
    print(json.dumps({"skip": f"Dawn found no adapter: {e}"})); raise SystemExit(0)
if not lf.available(g):
    print(json.dumps({"skip": f"no f16 subgroup matrices on {g.info.get('device')!r}"}))
    raise SystemExit(0)
"""


def run_with_f16_matrices(expr: str) -> dict:
    """:func:`run_on_dawn` for a check that needs f16 subgroup matrices: the JSON value of
    the Python expression ``expr``, evaluated with ``g`` (the device), ``lf``
    (mamba_ext.gpu.linear_f16), ``bench`` (mamba_ext.bench.gpu) and ``np`` in scope;
    skips where Dawn finds no adapter or the adapter has no f16 subgroup matrices."""
    return run_on_dawn(_F16_PRELUDE + f"print(json.dumps({expr}))\n")


_PROBE = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn probe(@builtin(local_invocation_index) li: u32, @builtin(subgroup_invocation_id) lane: u32,
         @builtin(subgroup_size) size: u32) {
    out[li * 3u] = lane;
    out[li * 3u + 1u] = size;
    out[li * 3u + 2u] = subgroupBroadcastFirst(li);
}
"""


def subgroup_layout(g) -> int:
    """The subgroup size a 64-wide workgroup of this device runs with, where its subgroups
    are what kernels/scan_sums_subgroup.wgsl takes (each ``size`` consecutive invocations,
    lane li % size); 0 where the device has no subgroups or they are laid out otherwise."""
    if g.subgroup_directive is None:
        return 0
    import wgpu
    dev = g.device
    mod = dev.create_shader_module(code=g.subgroup_directive + _PROBE)
    pl = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "probe"})
    buf = dev.create_buffer(size=64 * 12, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    bg = dev.create_bind_group(layout=pl.get_bind_group_layout(0),
                               entries=[{"binding": 0, "resource": {"buffer": buf}}])
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pl)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(1)
    cp.end()
    dev.queue.submit([enc.finish()])
    lane, size, first = np.frombuffer(dev.queue.read_buffer(buf), np.uint32).reshape(64, 3).T
    s = int(size[0])
    li = np.arange(64)
    ok = s > 0 and (size == s).all() and (lane == li % s).all() and (first == li - li % s).all()
    return s if ok else 0
