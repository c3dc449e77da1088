"""The WebGPU implementation under mamba_ext.gpu (backends/): chosen by
MAMBA_EXT_GPU_BACKEND, refused clearly when unknown; Dawn (wgpudawn) runs the same
kernels and gives the CPU's block. Dawn needs real GPU hardware: it does not start on
Debian 12's lavapipe (Mesa 22.3), so its run below skips there, CI included (the one
exception of the optional-dependency rule: code that needs a GPU CI cannot have)."""
from __future__ import annotations

import sys

import pytest

from conftest import optional
from gpu_support import WGPU_WHY, run_on_dawn
from mamba_ext.gpu import backends


def test_selection_and_refusal(monkeypatch):
    monkeypatch.delenv("MAMBA_EXT_GPU_BACKEND", raising=False)
    monkeypatch.delenv("MAMBA_EXT_GPU_CHECKS", raising=False)    # auto: wgpu-native with checks on
    assert backends.selected() == "auto" and backends.load().NAME == "wgpu"
    for name, want in (("wgpu", "wgpu"), ("DAWN", "dawn"), ("auto", "wgpu")):
        monkeypatch.setenv("MAMBA_EXT_GPU_BACKEND", name)
        assert backends.load().NAME == want
    monkeypatch.setenv("MAMBA_EXT_GPU_BACKEND", "vulkan")
    with pytest.raises(ValueError, match="MAMBA_EXT_GPU_BACKEND must be one of auto, wgpu, dawn"):
        backends.selected()
    # every backend module has the same interface
    for name in ("wgpu", "dawn"):
        be = backends.load(name)
        for attr in ("NAME", "THREAD_SAFE", "POLLED_MAPS", "module", "prepare",
                     "shader_module", "native_dispatch", "native_queue"):
            assert hasattr(be, attr), (name, attr)
    assert backends.load("wgpu").POLLED_MAPS and not backends.load("dawn").POLLED_MAPS


def test_dawn_toggles(monkeypatch):
    """Dawn's instance is set up with the toggles that expose f16 subgroup matrices, Tint's
    index clamps off only for MAMBA_EXT_GPU_CHECKS=none, and timestamps not quantized (the
    profiles' resolution); each a toggle this wgpudawn knows, at the stage it is given."""
    from wgpudawn.backends.dawn import extras      # a test dependency (not the device)
    dawn = backends.load("dawn")
    known = extras.all_toggles()
    calls = []
    monkeypatch.setattr(extras, "set_instance_extras", lambda **kw: calls.append(kw))
    for checks, robust in (("none", False), ("bounds", True)):
        calls.clear()
        monkeypatch.setattr(dawn, "_prepared", [])
        dawn.prepare(checks)
        dawn.prepare(checks)                        # once per process
        assert len(calls) == 1
        on, off = calls[0]["enable_toggles"], calls[0]["disable_toggles"]
        assert {"allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"} <= set(on)
        assert ("disable_robustness" in on) is not robust
        assert off == ["timestamp_quantization"]
        assert all(t in known for t in on + off)
    # a Dawn without the quantization toggle: the others still, nothing unknown asked for
    monkeypatch.setattr(extras, "all_toggles", lambda: {k: v for k, v in known.items()
                                                        if k != "timestamp_quantization"})
    calls.clear()
    monkeypatch.setattr(dawn, "_prepared", [])
    dawn.prepare("none")
    assert calls[0]["disable_toggles"] == [] and "disable_robustness" in calls[0]["enable_toggles"]


def test_wait_for_slices_only_where_the_backend_polls_maps():
    """Gpu.wait_for: in slices (idle between them) only where a thread of the backend's own
    resolves a map's promise (wgpu-native); on Dawn, whose promises carry the same event but
    never see it set, one idle call and then the blocking wait, which resolves it (the
    streamed reduce hung in the first form, docs/gpu_h200.txt run 119)."""
    import threading
    from types import SimpleNamespace
    from mamba_ext.gpu.device import Gpu

    class Promise:
        def __init__(self):
            self._thread_event = threading.Event()     # set by nobody, as on Dawn
            self.waited = False

        def sync_wait(self):
            self.waited = True
    idles = []
    fake = SimpleNamespace(backend=backends.load("dawn"))
    p = Promise()
    t = threading.Thread(target=Gpu.wait_for, args=(fake, p), kwargs={"idle": lambda: idles.append(1)},
                         daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "wait_for looped on an event nobody sets (the Dawn hang)"
    assert p.waited and idles == [1]
    fake = SimpleNamespace(backend=backends.load("wgpu"))
    p = Promise()
    threading.Timer(0.02, p._thread_event.set).start()   # wgpu-py's poller, played
    Gpu.wait_for(fake, p, idle=lambda: idles.append(2))
    assert p.waited and idles.count(2) >= 1


_DAWN_BLOCK = """
import json, numpy as np, mamba_ext
from mamba_ext import gpu as G
from mamba_ext.gpu import device
try:
    g = device.gpu()
except RuntimeError as e:
    print(json.dumps({"skip": f"Dawn found no adapter: {e}"})); raise SystemExit(0)
p = mamba_ext.init_mamba1_params(32, d_state=8, seed=0)
x = np.random.default_rng(0).standard_normal((2, 70, 32)).astype(np.float32)
out, cache = G.mamba1_forward(x, p)
dx, grads = G.mamba1_backward(np.ones_like(out), p, cache)
o2, c2 = mamba_ext.mamba1_forward(x, p)
dx2, g2 = mamba_ext.mamba1_backward(np.ones_like(o2), p, c2)
rel = lambda a, b: float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
print(json.dumps({"backend": g.backend.NAME, "device": g.info.get("device"),
                  "err": max([rel(out, o2), rel(dx, dx2)] + [rel(grads[k], g2[k]) for k in g2])}))
"""


def test_dawn_runs_the_block_as_the_cpu():
    res = run_on_dawn(_DAWN_BLOCK)
    assert res["backend"] == "dawn"
    assert res["err"] < 1e-4, res


def test_auto_keeps_wgpu_native_while_the_checks_are_on(monkeypatch):
    """With Tint's checks on (the default "bounds", or "full") Dawn's tensor-core products run
    4.5x slower, so auto is wgpu-native, without a probe of Dawn."""
    def probe():
        raise AssertionError("auto probed Dawn with the checks on")
    monkeypatch.setattr(backends, "_probed", [])
    monkeypatch.setattr(backends, "_dawn_has_f16_matrices", probe)
    monkeypatch.setenv("MAMBA_EXT_GPU_BACKEND", "auto")
    for checks in (None, "bounds", "full"):
        if checks is None:
            monkeypatch.delenv("MAMBA_EXT_GPU_CHECKS", raising=False)
        else:
            monkeypatch.setenv("MAMBA_EXT_GPU_CHECKS", checks)
        assert backends.auto_choice() == "wgpu" and backends.load().NAME == "wgpu"
    monkeypatch.setenv("MAMBA_EXT_GPU_CHECKS", "off")
    with pytest.raises(ValueError, match="MAMBA_EXT_GPU_CHECKS must be one of"):
        backends.auto_choice()


def test_auto_with_the_checks_off_follows_one_probe_of_dawn(monkeypatch):
    monkeypatch.setenv("MAMBA_EXT_GPU_CHECKS", "none")
    monkeypatch.delenv("MAMBA_EXT_GPU_BACKEND", raising=False)
    for found, want in ((True, "dawn"), (False, "wgpu")):
        probes = []
        monkeypatch.setattr(backends, "_probed", [])
        monkeypatch.setattr(backends, "_dawn_has_f16_matrices", lambda f=found, n=probes: n.append(1) or f)
        assert backends.load().NAME == want and backends.load("auto").NAME == want
        assert backends.load("wgpu").NAME == "wgpu" and backends.load("dawn").NAME == "dawn"
        assert probes == [1]                        # once per process


class _FakeAdapter:
    def __init__(self, features, name="gpu"):
        self.features = set(features)
        self.info = {"device": name, "backend_type": "Vulkan", "adapter_type": "DiscreteGPU"}


_TENSOR_CORES = ("shader-f16", "chromium-experimental-subgroup-matrix", "subgroups")


@pytest.mark.parametrize("features, configs, want", [
    (_TENSOR_CORES, [{"m": 16, "n": 16, "k": 16, "subgroup": 32}], True),
    (_TENSOR_CORES, [], False),                                  # no f16 -> f32 shape
    (("shader-f16", "subgroups"), [{"m": 16, "n": 16, "k": 16, "subgroup": 32}], False),
    (("chromium-experimental-subgroup-matrix",), [{"m": 8, "n": 8, "k": 8, "subgroup": 32}], False),
    (None, [], False),                                           # Dawn found no adapter
    ("raise", [], False),                                        # Dawn failed to start
])
def test_dawn_probe_reads_the_adapter_the_device_would_open(monkeypatch, features, configs, want):
    from types import SimpleNamespace
    from mamba_ext.gpu import device as dev
    dawn = backends.load("dawn")
    asked = []

    def request(**kw):
        asked.append(kw)
        if features == "raise":
            raise RuntimeError("vkCreateInstance failed")
        return None if features is None else _FakeAdapter(features)
    fake = SimpleNamespace(gpu=SimpleNamespace(request_adapter_sync=request))
    monkeypatch.setattr(dawn, "module", lambda: fake)
    monkeypatch.setattr(dawn, "prepare", lambda checks: asked.append(checks))
    monkeypatch.setattr(dawn, "subgroup_matrix_configs", lambda a: configs)
    monkeypatch.setattr(dev, "_ADAPTER_INDEX", None)
    monkeypatch.delenv("MAMBA_EXT_GPU_INDEX", raising=False)
    assert backends._dawn_has_f16_matrices() is want
    assert asked[0] == "none" and asked[1] == {"power_preference": "high-performance"}


def test_dawn_probe_opens_the_indexed_adapter_and_needs_wgpudawn(monkeypatch):
    from types import SimpleNamespace
    from mamba_ext.gpu import device as dev
    dawn = backends.load("dawn")
    adapters = [_FakeAdapter(_TENSOR_CORES, "a"), _FakeAdapter(("shader-f16",), "b")]
    fake = SimpleNamespace(gpu=SimpleNamespace(enumerate_adapters_sync=lambda: adapters))
    monkeypatch.setattr(dawn, "module", lambda: fake)
    monkeypatch.setattr(dawn, "prepare", lambda checks: None)
    monkeypatch.setattr(dawn, "subgroup_matrix_configs",
                        lambda a: [{"m": 16, "n": 16, "k": 16, "subgroup": 32}])
    monkeypatch.setattr(dev, "_ADAPTER_INDEX", None)
    for index, want in (("0", True), ("1", False), ("7", False)):   # 7: no such adapter
        monkeypatch.setenv("MAMBA_EXT_GPU_INDEX", index)
        assert backends._dawn_has_f16_matrices() is want, index
    monkeypatch.setattr(dev, "_ADAPTER_INDEX", 0)                 # use_adapter() first
    assert backends._dawn_has_f16_matrices() is True

    def missing():
        raise RuntimeError("MAMBA_EXT_GPU_BACKEND=dawn needs the wgpudawn package")
    monkeypatch.setattr(dawn, "module", missing)
    assert backends._dawn_has_f16_matrices() is False


_AUTO_DEVICE = """
import json
from mamba_ext.gpu import device
try:
    g = device.gpu()
except RuntimeError as e:
    print(json.dumps({"backend": None, "why": str(e)})); raise SystemExit(0)
print(json.dumps({"backend": g.backend.NAME, "f16_matrices": bool(g.f16_matrices)}))
"""


def test_auto_opens_dawn_exactly_where_its_tensor_cores_run():
    """End to end, each in a fresh process with the checks off: auto opens Dawn where a Dawn
    device has f16 subgroup matrices, else wgpu-native (lavapipe, CI: Dawn does not start)."""
    import json
    import os
    import subprocess
    optional("wgpu", WGPU_WHY)

    def device_in(backend):
        env = dict(os.environ, MAMBA_EXT_GPU_BACKEND=backend, MAMBA_EXT_GPU_CHECKS="none")
        r = subprocess.run([sys.executable, "-c", _AUTO_DEVICE], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    optional("wgpudawn", 'pip install "mamba_ext[dawn]"')
    dawn_cores = bool(device_in("dawn").get("f16_matrices"))
    auto = device_in("auto")
    if auto["backend"] is None:
        pytest.skip(f"no adapter: {auto['why']}")
    assert auto["backend"] == ("dawn" if dawn_cores else "wgpu"), auto
