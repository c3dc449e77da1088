"""Build of mamba_ext: every ``mamba_ext/cpu/*.pyx`` becomes one extension module.

Environment switches
--------------------
MAMBA_EXT_DEBUG=1        bounds/wraparound checks on, -O0 -g (debug build).
MAMBA_EXT_NO_OPENMP=1    build without OpenMP even where the compiler has it (the `omp simd`
                         loops still vectorise: -fopenmp-simd where the compiler has it).
CC=clang                 any GCC-compatible compiler (GCC, Clang, Apple Clang) or MSVC;
                         OpenMP is probed with that compiler.
MAMBA_EXT_MODULES=a,b    build only these modules (e.g. ``scan,block``); for
                         quick rebuilds during development.
"""
import os
import sys
import glob
import shutil
import tempfile
import warnings

import numpy
from setuptools import setup, Extension
from setuptools.command.build_ext import build_ext as _build_ext
from Cython.Build import cythonize

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("MAMBA_EXT_DEBUG", "0") not in ("", "0")


def _disabled(name):
    return os.environ.get(name, "0") not in ("", "0")


def _accepts(compiler, flags, source, link=True):
    """True if `compiler` (a setuptools compiler object: the one that builds the
    extensions, so $CC is honoured) compiles, and links, `source` with `flags`."""
    tmp = tempfile.mkdtemp()
    try:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        with open(os.devnull, "w") as null:
            out, err = os.dup(1), os.dup(2)          # keep the probe's errors off the log
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            try:
                objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
                if link:
                    compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=flags)
            finally:
                os.dup2(out, 1)
                os.dup2(err, 2)
                os.close(out)
                os.close(err)
        return True
    except Exception:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compiler_flags(compiler):
    """(compile_args, link_args) for this compiler: optimisation, OpenMP (threads) and
    OpenMP's SIMD directives. GCC / Clang / Apple Clang take GNU-style flags, MSVC its own.
    -fopenmp-simd (with -DMX_OPENMP_SIMD for csrc/mx_compat.h) honours the `omp simd`
    loops even without the OpenMP runtime (no-OpenMP builds, Clang without libomp)."""
    msvc = compiler.compiler_type == "msvc"
    if msvc:
        opt = ["/Od", "/Zi"] if DEBUG else ["/O2"]
        omp = ["/openmp"]
    else:
        opt = ["-O3", "-fno-math-errno"] if not DEBUG else ["-O0", "-g"]
        omp = ["-fopenmp"]
    c_args, l_args = list(opt), []
    if _disabled("MAMBA_EXT_NO_OPENMP"):
        warnings.warn("mamba_ext: OpenMP disabled by MAMBA_EXT_NO_OPENMP; "
                      "kernels run single-threaded.", stacklevel=2)
        print("mamba_ext: OpenMP disabled by MAMBA_EXT_NO_OPENMP; kernels run single-threaded.",
              file=sys.stderr)
    elif _accepts(compiler, omp, "#include <omp.h>\nint main(void)"
                  "{return omp_get_max_threads() > 0 ? 0 : 1;}\n"):
        c_args += omp
        l_args += [] if msvc else omp
    else:
        warnings.warn("mamba_ext: the C compiler has no OpenMP; kernels run single-threaded.",
                      stacklevel=2)
        print("WARNING: mamba_ext is built WITHOUT OpenMP (single-threaded kernels).",
              file=sys.stderr)
    simd = ["-fopenmp-simd", "-DMX_OPENMP_SIMD"]
    if not msvc and "-fopenmp" not in c_args and _accepts(
            compiler, simd + ["-Werror"], "int main(void){return 0;}\n", link=False):
        c_args += simd
    return c_args, l_args


class build_ext(_build_ext):
    """Adds the compiler's flags (compiler_flags) to every extension."""

    def build_extensions(self):
        c_args, l_args = compiler_flags(self.compiler)
        for ext in self.extensions:
            ext.extra_compile_args = c_args + list(ext.extra_compile_args or [])
            ext.extra_link_args = l_args + list(ext.extra_link_args or [])
        super().build_extensions()


def extensions():
    only = [m for m in os.environ.get("MAMBA_EXT_MODULES", "").split(",") if m]
    exts = []
    for pyx in sorted(glob.glob(os.path.join("mamba_ext", "cpu", "*.pyx"))):
        mod = os.path.splitext(os.path.basename(pyx))[0]
        if only and mod not in only:
            continue
        exts.append(Extension(
            "mamba_ext.cpu." + mod, [pyx],
            include_dirs=[numpy.get_include(), os.path.join("mamba_ext", "include"),
                          os.path.join("mamba_ext", "cpu")],   # "csrc/mx_*.h"
            depends=sorted(glob.glob(os.path.join("mamba_ext", "cpu", "csrc", "*.h"))),
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ))
    directives = dict(
        language_level=3,
        boundscheck=DEBUG, wraparound=DEBUG, initializedcheck=DEBUG,
        cdivision=not DEBUG,
        embedsignature=True,
    )
    return cythonize(exts, compiler_directives=directives, include_path=["."],
                     nthreads=int(os.environ.get("MAMBA_EXT_CYTHON_JOBS", "0")) or None)


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": build_ext},
    # The WGSL sources live in kernels/ at the top of the repository and ship
    # inside the wheel as the package ``mamba_ext.kernels``. That folder has no
    # __init__.py: run from the checkout's root, a regular package there would hide
    # an installed package named ``kernels`` (PyPI's, which transformers imports).
    packages=["mamba_ext", "mamba_ext.cpu", "mamba_ext.gpu", "mamba_ext.gpu.backends",
              "mamba_ext.io", "mamba_ext.training", "mamba_ext.testing", "mamba_ext.bench",
              "mamba_ext.cli", "mamba_ext.torch", "mamba_ext.kernels", "mamba_ext.include"],
    package_dir={"mamba_ext.kernels": "kernels"},
    package_data={
        "mamba_ext": ["py.typed"],
        "mamba_ext.cpu": ["*.pxd", "*.pyi", "csrc/*.h"],
        "mamba_ext.kernels": ["*.wgsl"],
        "mamba_ext.include": ["mamba_ext/*.h"],
    },
    include_package_data=False,
    zip_safe=False,
)
