"""The WebGPU implementation under mamba_ext.gpu (backends/): chosen by
MAMBA_EXT_GPU_BACKEND, refused clearly when unknown; Dawn (wgpudawn) runs the same
kernels and gives the CPU's block. Dawn needs real GPU hardware: it does not start on
Debian 12's lavapipe (Mesa 22.3), so its run below skips there, CI included (the one
exception of the optional-dependency rule: code that needs a GPU CI cannot have)."""
from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest

from gpu_support import run_on_dawn
from mamba_ext.gpu import backends


def test_selection_and_refusal(monkeypatch):
    monkeypatch.delenv("MAMBA_EXT_GPU_BACKEND", raising=False)
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
