"""The Dawn backend (wgpudawn: the wgpu-py API on Chrome's WebGPU implementation):
``pip install "mamba_ext[dawn]"``. The same WGSL and the same public-API calls as the
wgpu-native path; no private fast paths (device.py records and submits through wgpu-py's
methods). MAMBA_EXT_GPU_CHECKS maps to Dawn's own robustness: "none" turns on the adapter
toggle ``disable_robustness`` (Tint's index clamps off), "bounds" and "full" keep Dawn's
default (robust access on). Dawn does not start on Debian 12's lavapipe (Mesa 22.3 lacks
shaderUniform*ArrayDynamicIndexing), so it runs on real GPUs only.

Tensor cores: Dawn offers WGSL subgroup matrices (``chromium-experimental-subgroup-matrix``,
an experimental feature behind the toggle ``allow_unsafe_apis``) with f16 operands
(``shader-f16``, which Dawn hides on NVIDIA's Vulkan driver unless the toggle
``vulkan_enable_f16_on_nvidia`` is on); both toggles are set here, and the f16 kernels
(kernels/linear_f16.wgsl) run where the adapter lists an f16 x f16 -> f32 configuration.
"""
from __future__ import annotations

NAME = "dawn"
# device features asked for beyond timestamp-query, where the adapter has them
FEATURES = ("shader-f16", "subgroups", "chromium-experimental-subgroup-matrix")
# the feature that allows subgroup builtins, and the directive a kernel calling them starts with
SUBGROUP_FEATURE = "subgroups"
SUBGROUP_DIRECTIVE = "enable subgroups;\n"
# whether two threads may call the device at once: not Dawn's (its objects are not
# thread-safe without the implicit-device-synchronization feature, not requested here)
THREAD_SAFE = False
# whether a map's promise is resolved by a thread of the backend's own: not Dawn's (its
# callbacks run only inside a wait or an event-processing call of the waiting thread)
POLLED_MAPS = False

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
    adapter request): the two that expose f16 subgroup matrices (module docstring),
    ``disable_robustness`` for MAMBA_EXT_GPU_CHECKS=none, and ``timestamp_quantization``
    off: Dawn rounds timestamps down to 2^16 ns by default (a browser's guard against
    timing attacks, none in a process of one's own), too coarse for the benches' per-kernel
    profiles (every dispatch read as 0, 65.5, 131 ... us), where this Dawn has that toggle."""
    if _prepared:
        return
    _prepared.append(checks)
    from wgpudawn.backends.dawn.extras import all_toggles, set_instance_extras
    toggles = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
    set_instance_extras(enable_toggles=toggles + (["disable_robustness"] if checks == "none" else []),
                        disable_toggles=[t for t in ("timestamp_quantization",) if t in all_toggles()])


def subgroup_matrix_configs(adapter):
    """The adapter's f16 x f16 -> f32 subgroup-matrix shapes, [{"m", "n", "k", "subgroup"},
    ...] (the tensor-core tile sizes differ by vendor: 16x16x16, 16x8x16 and 16x8x8 on
    NVIDIA; "subgroup": the subgroup size they run with where Dawn fixes one, else 0)."""
    from wgpudawn.backends.dawn import extras
    props = extras.get_adapter_properties(adapter)
    out = []
    for c in props.get("subgroup_matrix_configs", []):
        if c.get("component_type") == "f16" and c.get("result_component_type") == "f32":
            lo, hi = int(c.get("min_subgroup_size") or 0), int(c.get("max_subgroup_size") or 0)
            out.append({"m": int(c["m"]), "n": int(c["n"]), "k": int(c["k"]),
                        "subgroup": hi if lo == hi else 0})
    return out


def shader_module(device, label: str, code: str, checks: str):
    return device.create_shader_module(label=label, code=code)


def native_dispatch():
    return None


def native_queue(device):
    return None
