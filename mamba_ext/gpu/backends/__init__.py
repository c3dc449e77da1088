"""The WebGPU implementation under mamba_ext.gpu, chosen by ``MAMBA_EXT_GPU_BACKEND``
(read, never written):

- ``wgpu``: wgpu-native through wgpu-py (``pip install "mamba_ext[gpu]"``), the default
  install and the CI path (lavapipe);
- ``dawn``: Dawn through wgpudawn (``pip install "mamba_ext[dawn]"``);
- ``auto`` (the default): Dawn where wgpudawn is installed, ``MAMBA_EXT_GPU_CHECKS=none``
  and Dawn's adapter offers f16 x f16 -> f32 subgroup matrices; else wgpu-native. Dawn's
  reason to be chosen is its tensor cores from WGSL: mixed precision multiplies there, and
  the fp32 products run split into three f16 products (mamba_ext.gpu.linear_split), which
  made the fp32 training step faster on Dawn than on wgpu-native (docs/gpu.md). With the
  checks on, Dawn's robust access makes those products 4.5x slower, so auto keeps
  wgpu-native there. The probe (Dawn's adapter, once per process) never raises: any failure
  of it means wgpu-native.

Each backend module gives the same small interface: ``NAME``; ``THREAD_SAFE`` (whether
two threads may call its device at once); ``POLLED_MAPS`` (whether a map's promise is
resolved by a thread of its own, so that it can be waited for in slices); ``FEATURES``
(device features asked for where the adapter has them); ``SUBGROUP_FEATURE`` and
``SUBGROUP_DIRECTIVE`` (its name for the subgroups feature, and what a kernel calling
subgroup builtins starts with); ``module()``
(the wgpu-py API module); ``prepare(checks)`` (set-up before the first adapter is requested);
``shader_module(device, label, code, checks)``; ``native_dispatch()`` (a function
recording ops into a pass, or None); ``native_queue(device)`` (submits with an index
and reads back a buffer by submission, or None). Everything private to one WebGPU
implementation lives in its module.
"""
from __future__ import annotations

import importlib
import os

BACKENDS = ("auto", "wgpu", "dawn")


def env_choice(variable: str, choices, default: str) -> str:
    """The value of the environment variable ``variable`` (lower case; ``default`` when
    unset or empty), one of ``choices`` or a ValueError naming the variable."""
    name = os.environ.get(variable, "").strip().lower() or default
    if name not in choices:
        raise ValueError(f"{variable} must be one of {', '.join(choices)}; got {name!r}")
    return name


def selected() -> str:
    """The backend ``MAMBA_EXT_GPU_BACKEND`` names ("auto" when unset), checked."""
    return env_choice("MAMBA_EXT_GPU_BACKEND", BACKENDS, "auto")


def load(name: str | None = None):
    """The backend module for ``name`` (None: :func:`selected`; "auto": :func:`auto_choice`)."""
    name = selected() if name is None else name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        name = auto_choice()
    return importlib.import_module(
        f"mamba_ext.gpu.backends.{'dawn' if name == 'dawn' else 'wgpu_native'}")


# what the probe of auto_choice found: [] until it ran, then ["dawn"] or ["wgpu"]
_probed: list = []


def auto_choice() -> str:
    """The backend "auto" stands for: "dawn" where MAMBA_EXT_GPU_CHECKS is "none" and Dawn's
    adapter (the one the device would open) offers f16 subgroup matrices, else "wgpu"
    (module docstring). The adapter is probed once per process, only with the checks off."""
    from ..device import _shader_checks
    if _shader_checks() != "none":
        return "wgpu"
    if not _probed:
        _probed.append("dawn" if _dawn_has_f16_matrices() else "wgpu")
    return _probed[0]


def _dawn_has_f16_matrices() -> bool:
    """Whether Dawn opens the adapter the device would use (MAMBA_EXT_GPU_INDEX or
    use_adapter(), else the high-performance one) with shader-f16 and f16 subgroup
    matrices. False where wgpudawn is missing or Dawn does not start (lavapipe)."""
    from . import dawn
    try:
        wgpu = dawn.module()
    except RuntimeError:                       # wgpudawn not installed
        return False
    from ..device import f16_matrix_configs, open_adapter
    try:
        dawn.prepare("none")
        adapter = open_adapter(wgpu)
        return adapter is not None and bool(f16_matrix_configs(dawn, adapter, adapter.features))
    except Exception:                          # a probe: any failure of Dawn means wgpu-native
        return False
