"""What the binary wheel ships, and that the type stubs match the compiled modules.

The wheel is the one named by the environment variable MAMBA_EXT_WHEEL
(wheels/build.sh sets it to the repaired manylinux wheel it just built);
without it, one wheel is built from a clean copy of the sources, once per test
session (``pip wheel --no-build-isolation``: compiles every module, a minute
or two on 2 cores).
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_PKG = REPO / "mamba_ext"
CPU_PKG = SOURCE_PKG / "cpu"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def compiled_module_names():
    """Every mamba_ext/cpu/*.pyx of the source tree becomes one compiled module (``cpu.<name>``)."""
    names = sorted("cpu." + p.stem for p in CPU_PKG.glob("*.pyx"))
    assert names, f"no .pyx files under {CPU_PKG}"
    return names


def expected_wheel_files():
    """Paths (inside the wheel) that must be there, derived from the sources."""
    kernels = sorted((REPO / "kernels").glob("*.wgsl"))
    assert kernels, "no WGSL kernels in kernels/"
    files = {f"mamba_ext/kernels/{p.name}" for p in kernels}
    files |= {f"mamba_ext/cpu/{p.name}" for p in CPU_PKG.glob("*.pxd")}
    files |= {f"mamba_ext/cpu/csrc/{p.name}" for p in CPU_PKG.glob("csrc/*.h")}
    files |= {"mamba_ext/include/mamba_ext/mamba_ext.h", "mamba_ext/py.typed",
              "mamba_ext/__init__.py"}
    for mod in compiled_module_names():
        files |= {f"mamba_ext/{mod.replace('.', '/')}.pyi"}
    # every Python module of the source tree (a subpackage missing from setup.py's
    # packages would be left out of the wheel and of a plain `pip install .`)
    files |= {f"mamba_ext/{p.relative_to(REPO / 'mamba_ext').as_posix()}"
              for p in (REPO / "mamba_ext").rglob("*.py")}
    return files


def _has_compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0]) is not None


@pytest.fixture(scope="session")
def wheel_path(tmp_path_factory) -> Path:
    given = os.environ.get("MAMBA_EXT_WHEEL")
    if given:
        path = Path(given)
        assert path.is_file(), f"MAMBA_EXT_WHEEL={given} does not exist"
        return path
    if not _has_compiler() and not os.environ.get("CI"):
        pytest.skip("building a wheel needs a C compiler (set MAMBA_EXT_WHEEL to check a built one)")
    # Build from a clean copy of the sources (never writes into the checkout).
    spec = importlib.util.spec_from_file_location("copy_source", REPO / "wheels" / "copy_source.py")
    copier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copier)
    work = tmp_path_factory.mktemp("wheel")
    copier.copy_source(str(REPO), str(work / "src"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(work / "src"), "--no-deps",
                        "--no-build-isolation", "-w", str(work / "dist")],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (path,) = (work / "dist").glob("mamba_ext-*.whl")
    return path


def test_wheel_ships_kernels_pxd_header_stubs_and_modules(wheel_path):
    names = set(zipfile.ZipFile(wheel_path).namelist())
    missing = sorted(expected_wheel_files() - names)
    assert not missing, f"{wheel_path.name} lacks {missing}"
    for mod in compiled_module_names():
        # one binary per .pyx, for the wheel's own Python tag
        stem = f"mamba_ext/{mod.replace('.', '/')}."
        built = [n for n in names if n.startswith(stem) and n.endswith(".so")]
        assert len(built) == 1, f"{mod}: compiled module not in the wheel ({built})"
    assert not [n for n in names if n.startswith("tests/")], "tests leaked into the wheel"
    assert not [n for n in names if n.startswith("mamba_ext/") and n.endswith(".c")], \
        "generated C sources leaked into the wheel"
    if "manylinux" in wheel_path.name:        # a repaired wheel bundles OpenMP's runtime
        assert any("gomp" in n for n in names if n.startswith("mamba_ext.libs/")), \
            "repaired wheel without a bundled libgomp"


def test_installed_distribution_lists_the_data_files():
    """The pip-installed package (CI) holds the same data files as the wheel."""
    pkg = Path(importlib.util.find_spec("mamba_ext").origin).parent
    if pkg.resolve() == (REPO / "mamba_ext").resolve():
        # an editable install (`pip install -e .`, the README's main job) or an in-place
        # build on PYTHONPATH: the source tree is imported, no installed file list exists
        if os.environ.get("CI"):
            pytest.fail("CI runs against a pip-installed mamba_ext, but the source tree's is "
                        "imported")
        pytest.skip("mamba_ext is imported from the source tree (editable or in-place build); "
                    "`pip install .` to check the installed files")
    # the metadata installed beside the imported package (not, say, an egg-info directory of
    # the source tree that happens to be on sys.path)
    dists = [d for d in importlib.metadata.distributions(path=[str(pkg.parent)])
             if d.metadata["Name"] == "mamba_ext"]
    assert len(dists) == 1, f"{len(dists)} mamba_ext distributions in {pkg.parent}"
    installed = {str(f).replace(os.sep, "/") for f in dists[0].files or ()}
    missing = sorted(expected_wheel_files() - installed)
    assert not missing, f"installed mamba_ext lacks {missing}"
    assert (pkg / "include" / "mamba_ext" / "mamba_ext.h").is_file()


def _stub_functions(pyi: Path) -> dict:
    """name -> parameter names of the top-level defs of a .pyi file."""
    tree = ast.parse(pyi.read_text(), filename=str(pyi))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            out[node.name] = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return out


@pytest.mark.parametrize("mod", compiled_module_names())
def test_stub_matches_compiled_module(mod):
    """Every Python-callable function of a compiled module is in its .pyi stub with
    the same parameters, and the stub declares nothing the module lacks."""
    import importlib
    module = importlib.import_module(f"mamba_ext.{mod}")
    pyi = Path(module.__file__).with_name(f"{mod.split('.')[-1]}.pyi")
    assert pyi.is_file(), f"no type stub {pyi.name} next to {module.__file__}"
    stubs = _stub_functions(pyi)
    funcs = {name: f for name, f in vars(module).items()
             if callable(f) and not isinstance(f, type) and not name.startswith("__")
             and getattr(f, "__module__", None) == module.__name__}
    assert sorted(stubs) == sorted(funcs), (
        f"{pyi.name}: stub functions {sorted(stubs)} != module functions {sorted(funcs)}")
    for name, f in funcs.items():
        params = list(inspect.signature(f).parameters)
        assert stubs[name] == params, f"{mod}.{name}: stub {stubs[name]} != module {params}"


def test_checkout_root_shadows_no_installed_package(tmp_path):
    """Run from the checkout's root (``python -m mamba_ext ...`` puts it first on sys.path),
    the top-level kernels/ folder (WGSL sources, installed as mamba_ext.kernels) must not hide
    an installed package of the same name: PyPI's ``kernels``, which transformers imports.
    A folder without ``__init__.py`` is only a namespace portion, which a regular package
    later on sys.path overrides."""
    installed = tmp_path / "kernels"
    installed.mkdir()
    (installed / "__init__.py").write_text("WHO = 'installed'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.WHO)"],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "installed", r.stdout + r.stderr
    # and the package's own kernels still load from the checkout
    from mamba_ext.gpu.device import kernel_source
    assert "fn " in kernel_source("linear")
