"""mamba_ext — exact forward and backward of Mamba-1 (S6 selective scan) models.

CPU: typed Cython compiled to C (float32/float64, BLAS, OpenMP).
GPU: WGSL kernels run by wgpu (``mamba_ext.gpu``).

The public names are loaded lazily (PEP 562) so that ``import mamba_ext`` is
cheap and optional parts (``mamba_ext.gpu`` needs wgpu) load only when used.
"""
import importlib
import os

# Spinning OpenMP threads (libgomp's default wait policy) take the cores from
# OpenBLAS's threads between our kernels: measured size-c forward+backward 590 ms
# spinning vs 370 ms passive on 2 cores. libgomp reads this once, when the first
# compiled module loads, so it is set here, before any of them; a user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "BLOCK_PARAM_NAMES": "_validate",
    "mamba1_forward": "block",
    "mamba1_backward": "block",
    "init_mamba1_params": "block",
    "BlockCache": "block",
    "MODEL_PARAM_NAMES": "model",
    "model_forward": "model",
    "model_loss_and_grads": "model",
    "init_model_params": "model",
    "AdamW": "optim",
    "clip_grad_norm": "optim",
}

__all__ = sorted(list(_EXPORTS) + ["get_include", "amp", "gpu", "__version__"])


def get_include() -> str:
    """Folder holding ``mamba_ext/mamba_ext.h`` (the C API); pass it to ``-I``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module("." + mod, __name__), name)
        globals()[name] = value
        return value
    if name in ("amp", "gpu"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'mamba_ext' has no attribute {name!r}")


def __dir__():
    return __all__
