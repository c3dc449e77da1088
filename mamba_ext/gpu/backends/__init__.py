"""The WebGPU implementation under mamba_ext.gpu, chosen by ``MAMBA_EXT_GPU_BACKEND``
(read, never written):

- ``wgpu``: wgpu-native through wgpu-py (``pip install "mamba_ext[gpu]"``), the default
  install and the CI path (lavapipe);
- ``dawn``: Dawn through wgpudawn (``pip install "mamba_ext[dawn]"``);
- ``auto`` (the default): wgpu-native. Dawn's reason to be chosen is its subgroup
  matrices (tensor cores from WGSL, which mixed precision uses); but the backend is chosen
  when the device is made, before a run says whether it multiplies in f16, and the fp32
  kernels run faster on wgpu-native (H200: block d 16.6 ms against 20.8 on Dawn,
  docs/gpu.md), so auto does not pick Dawn: ask for it. (Since mamba_ext.gpu.linear_split
  the fp32 products run split on Dawn's tensor cores: the 24 x 768 fp32 step is then faster
  there, block d about as fast; docs/gpu.md.)

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
    """The backend module for ``name`` (None: :func:`selected`)."""
    name = selected() if name is None else name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    return importlib.import_module(
        f"mamba_ext.gpu.backends.{'dawn' if name == 'dawn' else 'wgpu_native'}")
