"""mamba_ext — exact forward and backward of Mamba-1 (S6 selective scan) models.

CPU: typed Cython compiled to C (float32/float64, BLAS, OpenMP).
GPU: WGSL kernels run by wgpu (``mamba_ext.gpu``).

The public names are loaded lazily (PEP 562) so that ``import mamba_ext`` is
cheap and optional parts (``mamba_ext.gpu`` needs wgpu) load only when used.
"""
import importlib
import os

# Our kernels alternate OpenMP regions with BLAS calls that run OpenBLAS's own
# threads; idle threads of either pool spinning take the cores from the other.
# - libgomp's default keeps idle threads spinning: size-c forward+backward 590 ms
#   spinning vs 370 ms passive on 2 cores.
# - OpenBLAS's idle threads spin ~0.1 s after each GEMM, i.e. through the whole scan
#   that follows (perf: 27% of size-c cycles in blas_thread_server); 2^4 cycles makes
#   them sleep at once, and waking them costs far less than a GEMM.
# Both are read once, when libgomp / scipy's OpenBLAS load, so they are set here,
# before any compiled module; a user's own setting wins. (If scipy.linalg was
# imported before mamba_ext, OpenBLAS keeps its setting.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"


def _check_built() -> None:
    """A clear error instead of "cannot import name 'block'" when Python picks up an
    unbuilt source checkout (e.g. ``python -m mamba_ext`` run in the repository root
    after a plain ``pip install .``, since ``-m`` puts the current folder first)."""
    from importlib.machinery import EXTENSION_SUFFIXES
    here = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(here, "cpu", "block" + sfx)) for sfx in EXTENSION_SUFFIXES):
        return
    if os.path.exists(os.path.join(here, os.pardir, "setup.py")):
        raise ImportError(
            f"mamba_ext is being imported from the source checkout {os.path.dirname(here)}, "
            f"whose compiled modules are not built. Build them in place "
            f"(python -m pip install -e .  or  python setup.py build_ext --inplace), "
            f"or run from another folder so that the installed mamba_ext is imported.")


_check_built()

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
