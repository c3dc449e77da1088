"""Build of mamba_ext: every ``mamba_ext/cpu/*.pyx`` becomes one extension module.

Environment switches
--------------------
MAMBA_EXT_DEBUG=1        bounds/wraparound checks on, -O0 -g (debug build).
MAMBA_EXT_NO_OPENMP=1    build without OpenMP even where the compiler has it.
MAMBA_EXT_MODULES=a,b    build only these modules (e.g. ``scan,block``); for
                         quick rebuilds during development.
"""
import os
import sys
import glob
import shutil
import tempfile
import subprocess
import sysconfig
import warnings

import numpy
from setuptools import setup, Extension
from Cython.Build import cythonize

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("MAMBA_EXT_DEBUG", "0") not in ("", "0")


def openmp_flags():
    """Return (compile_args, link_args) for OpenMP, or ([], []) with a warning."""
    if os.environ.get("MAMBA_EXT_NO_OPENMP", "0") not in ("", "0"):
        warnings.warn("mamba_ext: OpenMP disabled by MAMBA_EXT_NO_OPENMP; "
                      "kernels run single-threaded.")
        return [], []
    cc = sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()
    flags = ["-fopenmp"]
    tmp = tempfile.mkdtemp()
    try:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        r = subprocess.run(cc + flags + [src, "-o", os.path.join(tmp, "t")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if r.returncode == 0:
            return flags, flags
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    warnings.warn("mamba_ext: the C compiler has no OpenMP; kernels run single-threaded.")
    print("WARNING: mamba_ext is built WITHOUT OpenMP (single-threaded kernels).",
          file=sys.stderr)
    return [], []


def extensions():
    omp_c, omp_l = openmp_flags()
    only = [m for m in os.environ.get("MAMBA_EXT_MODULES", "").split(",") if m]
    opt = ["-O0", "-g"] if DEBUG else ["-O3", "-fno-math-errno"]
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
            extra_compile_args=opt + omp_c,
            extra_link_args=omp_l,
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
    # The WGSL sources live in kernels/ at the top of the repository and ship
    # inside the wheel as the package ``mamba_ext.kernels``.
    packages=["mamba_ext", "mamba_ext.cpu", "mamba_ext.gpu", "mamba_ext.io", "mamba_ext.training",
              "mamba_ext.testing", "mamba_ext.bench", "mamba_ext.cli", "mamba_ext.kernels",
              "mamba_ext.include"],
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
