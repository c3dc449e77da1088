"""The Dawn backend (wgpudawn: the wgpu-py API on Chrome's WebGPU implementation):
``pip install "mamba_ext[dawn]"``. The same WGSL and the same public-API calls as the
wgpu-native path; no private fast paths (device.py records and submits through wgpu-py's
methods). MAMBA_EXT_GPU_CHECKS maps to Dawn's own robustness: "none" turns on the adapter
toggle ``disable_robustness`` (Tint's index clamps off), "bounds" and "full" keep Dawn's
default (robust access on). Dawn does not start on Debian 12's lavapipe (Mesa 22.3 lacks
shaderUniform*ArrayDynamicIndexing), so it runs on real GPUs only.
"""
from __future__ import annotations

NAME = "dawn"

_prepared = []


def module():
    """The wgpudawn module (its API is wgpu-py's)."""
    try:
        import wgpudawn
    except ImportError as e:
        raise RuntimeError('MAMBA_EXT_GPU_BACKEND=dawn needs the wgpudawn package: pip install '
                           '"mamba_ext[dawn]" (or pip install wgpudawn)') from e
    return wgpudawn


def prepare(checks: str) -> None:
    """Dawn's instance toggles, set once before its instance is created (by the first
    adapter request): ``disable_robustness`` for MAMBA_EXT_GPU_CHECKS=none."""
    if _prepared:
        return
    _prepared.append(checks)
    if checks == "none":
        from wgpudawn.backends.dawn.extras import set_instance_extras
        set_instance_extras(enable_toggles=["disable_robustness"])


def shader_module(device, label: str, code: str, checks: str):
    return device.create_shader_module(label=label, code=code)


def native_dispatch():
    return None


def native_queue(device):
    return None
