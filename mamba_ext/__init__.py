"""mamba_ext — exact forward and backward of Mamba-1 (S6 selective scan) models.

CPU: typed Cython compiled to C (float32/float64, BLAS, OpenMP).
GPU: WGSL kernels run by wgpu (``mamba_ext.gpu``).

The public names are loaded lazily (PEP 562) so that ``import mamba_ext`` is
cheap and optional parts (``mamba_ext.gpu`` needs wgpu) load only when used.
Importing or calling changes nothing in the process (no environment variable is set, and
BLAS thread counts are as they were after every call); :func:`configure_threads` is an
optional knob.
"""
from __future__ import annotations

import importlib
import os
import sys

# The one version string: setuptools reads it (pyproject.toml, dynamic version).
__version__ = "0.1.0"


def _libgomp_loaded() -> bool:
    """Whether libgomp is already mapped into this process (Linux: /proc/self/maps;
    elsewhere: whether a compiled mamba_ext module, which links it, is imported)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libgomp" in f.read()
    except OSError:
        return any(m.startswith("mamba_ext.cpu.") for m in list(sys.modules))


def _scipy_openblas_loaded() -> bool:
    """Whether SciPy's BLAS (the one our kernels call, through scipy.linalg.cython_blas)
    is already loaded. NumPy's own OpenBLAS is another library and does not matter here."""
    return any(m in sys.modules for m in ("scipy.linalg.cython_blas", "scipy.linalg._fblas"))


def configure_threads() -> dict[str, bool]:
    """Make idle OpenMP and OpenBLAS threads sleep at once instead of spinning (optional).

    The core needs no tuning: it runs one thread pool (``mamba_ext/cpu/linear.pyx``,
    Design), so a plain library call runs as fast as a configured one (docs/api.md,
    Threads; measured within the noise at sizes b and c, the 2 x 64 and 4 x 256 training
    steps, and a script mixing its own NumPy products with our calls). What this still
    changes: libgomp's idle threads sleep after ``GOMP_SPINCOUNT=10000`` spins instead of its
    default ~300,000 (~10 ms), with ``OMP_WAIT_POLICY=PASSIVE``, and OpenBLAS's idle threads
    (NumPy's and SciPy's) after 2^4 cycles instead of ~0.1 s (``OPENBLAS_THREAD_TIMEOUT=4``);
    that may help where other thread pools share the cores with ours.

    Neither library has a call to change this at run time: they read the variables once,
    when they load. So this function sets those environment variables of the process (a
    value the user already set is kept) and must run before the first compiled kernel or
    ``scipy.linalg`` loads them: call it right after ``import mamba_ext``. Nothing else in
    mamba_ext changes the environment, and the command line does not call it.
    (``GOMP_SPINCOUNT`` is libgomp's, the GCC builds' OpenMP; Clang's libomp ignores it.)

    Returns ``{variable: takes_effect}``: False for a variable whose library was already
    loaded when the function ran (libgomp, or SciPy's OpenBLAS).
    """
    gomp = _libgomp_loaded()
    loaded = {"OMP_WAIT_POLICY": gomp, "GOMP_SPINCOUNT": gomp,
              "OPENBLAS_THREAD_TIMEOUT": _scipy_openblas_loaded()}
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    return {var: not was_loaded for var, was_loaded in loaded.items()}


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
    "model_param_names": "model",
    "MODEL_PARAM_NAMES": "model",
    "model_forward": "model",
    "model_loss_and_grads": "model",
    "init_model_params": "model",
    "AdamW": "optim",
    "clip_grad_norm": "optim",
}

__all__ = sorted(list(_EXPORTS) + ["get_include", "configure_threads", "amp", "gpu", "constants",
                                    "__version__"])


def get_include() -> str:
    """Folder holding ``mamba_ext/mamba_ext.h`` (the C API); pass it to ``-I``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module("." + mod, __name__), name)
        globals()[name] = value
        return value
    if name in ("amp", "gpu", "constants"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'mamba_ext' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
