"""C API and Cython-level API of the INSTALLED mamba_ext.

Two small external extensions (sources in tests/capi/capi_ext/) are compiled here
against the package that ``import mamba_ext`` finds (the pip-installed one in
CI; the in-place build with PYTHONPATH=<repo> during development), never
against the source tree by path:

* capi_client.c — plain C, includes <mamba_ext/mamba_ext.h> from
  ``mamba_ext.get_include()``, calls ``import_mamba_ext()`` and runs the block,
  model and AdamW entries through the capsule's function table;
* cy_client.pyx — cimports the kernels from the installed ``.pxd`` files
  (``from mamba_ext.cpu.block cimport block_forward ...``).

Both are checked against the golden vectors; the table's layout is checked
against the snapshot tests/capi/capi_abi.txt so that an accidental ABI change fails.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from conftest import (BLOCK_GOLDEN, MODEL_GOLDEN, assert_clamped_grad_zero,
                      assert_golden_close, load_golden)

import mamba_ext
from mamba_ext import BLOCK_PARAM_NAMES

TESTS = Path(__file__).resolve().parent
CLIENT_SOURCES = TESTS / "capi_ext"
ABI_SNAPSHOT = TESTS / "capi_abi.txt"
# The one source of the C API table is the header; capi.pyx (which fills the table)
# and the snapshot are checked against it below, entry by entry.
SOURCE_HEADER = TESTS.parents[1] / "mamba_ext" / "include" / "mamba_ext" / "mamba_ext.h"
CAPI_PYX = TESTS.parents[1] / "mamba_ext" / "cpu" / "capi.pyx"


# ------------------------------------------------------------ the installed package

def installed_package_dir() -> Path:
    """Folder of the mamba_ext that Python imports (site-packages in CI)."""
    spec = importlib.util.find_spec("mamba_ext")
    assert spec is not None and spec.origin, "mamba_ext is not importable"
    return Path(spec.origin).resolve().parent


def installed_header() -> Path:
    return installed_package_dir() / "include" / "mamba_ext" / "mamba_ext.h"


def c_compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0])


# Building the clients needs a C compiler. Where none is on PATH (e.g. the
# compiler-less pass of wheels/build.sh) they are skipped — except in CI, which
# installs gcc, so a missing compiler fails there.
needs_compiler = pytest.mark.skipif(
    c_compiler() is None and not os.environ.get("CI"),
    reason="no C compiler on PATH (the C-API build tests need one; CI has it)")


def _build_extension(name: str, sources, workdir: Path, *, cython_include=None,
                     extra_compile_args=()):
    """Compile one extension module into workdir and import it from there."""
    from setuptools import Distribution, Extension

    work_sources = []
    for src in sources:                      # never write next to the sources
        dst = workdir / src.name
        shutil.copyfile(src, dst)
        work_sources.append(str(dst))
    ext = Extension(name, work_sources, include_dirs=[mamba_ext.get_include()],
                    extra_compile_args=list(extra_compile_args))
    if cython_include is not None:
        from Cython.Build import cythonize
        (ext,) = cythonize([ext], include_path=[str(cython_include)], quiet=True,
                           compiler_directives={"language_level": 3}, force=True)
    dist = Distribution({"name": name, "ext_modules": [ext]})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(workdir / "lib")
    cmd.build_temp = str(workdir / "temp")
    cmd.force = True
    cmd.ensure_finalized()
    cmd.run()
    path = Path(cmd.build_lib) / cmd.get_ext_filename(name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def c_client(tmp_path_factory):
    """capi_client.c built against the installed header (warnings are errors)."""
    return _build_extension(
        "capi_client", [CLIENT_SOURCES / "capi_client.c"],
        tmp_path_factory.mktemp("capi_client"),
        extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Werror"])


@pytest.fixture(scope="session")
def cy_client(tmp_path_factory):
    """cy_client.pyx cimporting from the installed package's .pxd files."""
    return _build_extension(
        "cy_client", [CLIENT_SOURCES / "cy_client.pyx"],
        tmp_path_factory.mktemp("cy_client"),
        cython_include=installed_package_dir().parent)


# ------------------------------------------------------------ golden helpers

def block_dims(data):
    Dm, N, K, D, R, B, L = (int(v) for v in data["dims"])
    return (B, L, Dm, D, N, K, R)


def check_block_result(case, data, out, dx, grads):
    assert_golden_close("out", out, data["out"], case)
    assert_golden_close("dx", dx, data["dx"], case)
    for name, g in zip(BLOCK_PARAM_NAMES, grads):
        assert_golden_close("g_" + name, g, data["g_" + name], case)
    assert_clamped_grad_zero(grads[BLOCK_PARAM_NAMES.index("A_log")], data["w_A_log"])


def run_c_block(c_client, data, dtype):
    x = data["x"].astype(dtype)
    dout = data["dout"].astype(dtype)
    params = [data["w_" + n].astype(dtype) for n in BLOCK_PARAM_NAMES]
    grads = [np.zeros_like(p) for p in params]
    out = np.full_like(x, np.nan)            # must be fully written
    dx = np.zeros_like(x)
    n_cache = c_client.block_forward_backward(block_dims(data), x, dout, params, out, dx, grads)
    return out, dx, grads, n_cache


# ------------------------------------------------------------ what ships

def test_header_and_pxd_ship_with_the_installed_package():
    pkg = installed_package_dir()
    assert Path(mamba_ext.get_include()).resolve() == pkg / "include"
    assert installed_header().is_file()
    for pxd in ("cpu/types.pxd", "cpu/block.pxd", "cpu/model.pxd", "cpu/adamw.pxd"):
        assert (pkg / pxd).is_file(), f"{pxd} missing from the installed package {pkg}"


# ------------------------------------------------------------ ABI snapshot

def _prototype_types(field: str) -> str:
    """``int (*f)(float *y, const float *const *p, Py_ssize_t B)`` ->
    ``int (*f)(float *, const float *const *, Py_ssize_t)``: parameter names are not
    part of the ABI (renaming one needs no version bump); types and order are."""
    m = re.fullmatch(r"(.*?)\(\*(\w+)\)\((.*)\)", field)
    assert m, f"not a function-pointer field: {field}"
    params = []
    for p in m.group(3).split(","):
        p = " ".join(p.split())
        if re.search(r"[\w*]\s*\b[A-Za-z_]\w*$", p) and p != "void":
            p = re.sub(r"\s*\b[A-Za-z_]\w*$", "", p)     # drop the parameter name
        params.append(p)
    return f"{m.group(1).strip()} (*{m.group(2)})({', '.join(params)})"


def header_entry_names(header: Path) -> list:
    """Names of the function-pointer entries of struct mamba_ext_api, in order."""
    body = re.search(r"typedef struct mamba_ext_api \{(.*?)\} mamba_ext_api;",
                     header.read_text(), re.S)
    assert body, "struct mamba_ext_api not found in the header"
    return re.findall(r"\(\*(\w+)\)", body.group(1))


def header_abi_text(header: Path) -> str:
    """Canonical text of everything in the header that is part of the ABI:
    the version macros, the enums, and the fields of every struct in order
    (function-pointer entries by their types, without parameter names)."""
    raw = header.read_text()
    api_body = re.search(r"typedef struct mamba_ext_api \{(.*?)\} mamba_ext_api;", raw, re.S)
    assert api_body, "struct mamba_ext_api not found in the header"
    numbers = [int(n) for n in re.findall(r"/\*\s*(\d+)\s*\*/", api_body.group(1))]
    assert numbers == list(range(len(numbers))), f"entry comments out of order: {numbers}"

    text = re.sub(r"/\*.*?\*/", " ", raw, flags=re.S)
    lines = []
    for name, value in re.findall(r"^#define[ \t]+(MAMBA_EXT_\w+)[ \t]+(\S.*?)\s*$", text, re.M):
        lines.append(f"define {name} {value}")
    for body in re.findall(r"\benum\s*\{(.*?)\}", text, re.S):
        for member in body.split(","):
            if member.strip():
                lines.append("enum " + " ".join(member.split()))
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", text, re.S):
        entry = 0
        for field in body.split(";"):
            field = " ".join(field.split())
            if not field:
                continue
            fn = re.search(r"\(\*(\w+)\)", field)
            if fn:
                lines.append(f"{name} entry {entry} {fn.group(1)}: {_prototype_types(field)}")
                entry += 1
            else:
                lines.append(f"{name} field: {field}")
    return "\n".join(lines) + "\n"


def _macro(abi_text: str, name: str) -> str:
    m = re.search(rf"^define {name} (.*)$", abi_text, re.M)
    assert m, f"{name} not defined in the header"
    return m.group(1)


def test_abi_matches_snapshot():
    current = header_abi_text(installed_header())
    snapshot = ABI_SNAPSHOT.read_text()
    snap_lines = [ln for ln in snapshot.splitlines() if ln and not ln.startswith("#")]
    cur_lines = current.splitlines()
    if snap_lines != cur_lines:
        same_version = (_macro(current, "MAMBA_EXT_ABI_VERSION")
                        == _macro("\n".join(snap_lines), "MAMBA_EXT_ABI_VERSION"))
        old_entries = [ln for ln in snap_lines if " entry " in ln]
        new_entries = [ln for ln in cur_lines if " entry " in ln]
        appended = new_entries[:len(old_entries)] == old_entries
        hint = ("entries were only appended: update tests/capi/capi_abi.txt (and "
                "MAMBA_EXT_API_COUNT)" if same_version and appended else
                "an existing entry, struct or constant changed: that breaks every "
                "compiled client; revert it, or bump MAMBA_EXT_ABI_VERSION on purpose")
        pytest.fail(f"C API differs from the snapshot tests/capi/capi_abi.txt ({hint}).\n"
                    f"Header now:\n{current}")
    n_entries = sum(1 for ln in cur_lines if ln.startswith("mamba_ext_api entry "))
    assert int(_macro(current, "MAMBA_EXT_API_COUNT")) == n_entries


def test_installed_header_is_the_source_header():
    assert installed_header().read_text() == SOURCE_HEADER.read_text(), (
        "the installed mamba_ext.h differs from mamba_ext/include/mamba_ext/mamba_ext.h: "
        "rebuild / reinstall the package")


def test_capi_pyx_declares_and_fills_every_header_entry_in_order():
    """capi.pyx restates the table struct for Cython (the C compiler checks each
    assignment's type against the header: -Werror=incompatible-pointer-types); this
    checks that it names the same entries in the same order and assigns every one."""
    entries = header_entry_names(SOURCE_HEADER)
    src = CAPI_PYX.read_text()
    decl = re.search(r"ctypedef struct mamba_ext_api:\n(.*?)\n\n", src, re.S)
    assert decl, "capi.pyx: no `ctypedef struct mamba_ext_api:` block"
    assert re.findall(r"\(\*(\w+)\)", decl.group(1)) == entries
    assigned = [n for n in re.findall(r"^_table\.(\w+) = ", src, re.M)
                if n not in ("abi_version", "count")]
    assert assigned == entries, f"capi.pyx assigns {assigned}, header has {entries}"


def test_runtime_table_matches_header():
    from mamba_ext.cpu import capi as _capi

    abi = header_abi_text(installed_header())
    assert _capi.abi_version() == int(_macro(abi, "MAMBA_EXT_ABI_VERSION"))
    assert _capi.api_count() == int(_macro(abi, "MAMBA_EXT_API_COUNT"))
    name = _macro(abi, "MAMBA_EXT_CAPSULE_NAME").strip('"')
    assert name == "mamba_ext.cpu.capi._C_API"
    assert type(_capi._C_API).__name__ == "PyCapsule"
    assert f'"{name}"' in repr(_capi._C_API)


# ------------------------------------------------------------ the C client

@needs_compiler
def test_every_table_entry_is_set(c_client):
    entries = c_client.table_entries()
    assert len(entries) == len(header_entry_names(installed_header()))
    unset = [n for n, ok in zip(header_entry_names(installed_header()), entries) if not ok]
    assert not unset, f"NULL entries in the exported table: {unset}"


@needs_compiler
def test_c_client_sees_the_table(c_client):
    from mamba_ext.cpu import capi as _capi
    abi, count, header_abi, header_count = c_client.api_info()
    assert (abi, count) == (_capi.abi_version(), _capi.api_count())
    assert (header_abi, header_count) == (abi, count)


@needs_compiler
@pytest.mark.parametrize("case", BLOCK_GOLDEN)
def test_c_api_block_float32_golden(c_client, case):
    data = load_golden(case)
    out, dx, grads, n_cache = run_c_block(c_client, data, np.float32)
    check_block_result(case, data, out, dx, grads)
    assert n_cache > 0


@needs_compiler
@pytest.mark.parametrize("case", ["block_basic", "block_odd_sizes"])
def test_c_api_block_float64_golden(c_client, case):
    # The float64 entries evaluate the same maths more exactly: they must meet
    # the same golden tolerance.
    data = load_golden(case)
    out, dx, grads, _ = run_c_block(c_client, data, np.float64)
    assert out.dtype == np.float64
    check_block_result(case, data, out, dx, grads)


@needs_compiler
@pytest.mark.parametrize("case", MODEL_GOLDEN)
def test_c_api_model_loss_and_grads_golden(c_client, case):
    data = load_golden(case)
    V, Dm, N, K, D, R, n_layers, B, L = (int(v) for v in data["dims"])
    top = ["embedding", "final_norm", "lm_head_bias"]
    layer_keys = [f"layer{i}.{n}" for i in range(n_layers) for n in BLOCK_PARAM_NAMES]
    weights = [data["w_" + k] for k in top]
    layer_params = [data["w_" + k] for k in layer_keys]
    grads = [np.zeros_like(w) for w in weights]
    g_layers = [np.zeros_like(w) for w in layer_params]
    loss = c_client.model_loss_and_grads(V, n_layers, (B, L, Dm, D, N, K, R),
                                         data["tokens"], data["targets"], weights,
                                         layer_params, grads, g_layers)
    assert_golden_close("loss", loss, data["loss"], case)
    for k, g in zip(top + layer_keys, grads + g_layers):
        assert_golden_close("g_" + k, g, data["g_" + k], case)


def adamw_reference(w, m, v, g, lr, b1, b2, eps, wd, step):
    """torch.optim.AdamW, in float64."""
    w, m, v, g = (a.astype(np.float64) for a in (w, m, v, g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    delta = lr * wd * w + lr / (1 - b1 ** step) * m / (np.sqrt(v / (1 - b2 ** step)) + eps)
    return w - delta, m, v


@needs_compiler
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-6), (np.float64, 1e-13)])
def test_c_api_adamw_step(c_client, dtype, rtol):
    rng = np.random.default_rng(5)
    n = 257
    w, m, g = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    v = (rng.random(n) + 0.1).astype(dtype)
    g[7] = np.nan                              # must be skipped, w/m/v kept
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, step=3)
    w_ref, m_ref, v_ref = adamw_reference(w, m, v, g, **hp)
    w0, m0, v0 = w.copy(), m.copy(), v.copy()
    skipped = c_client.adamw_step(w, m, v, g, hp["lr"], hp["b1"], hp["b2"], hp["eps"],
                                  hp["wd"], hp["step"])
    assert skipped == 1
    assert (w[7], m[7], v[7]) == (w0[7], m0[7], v0[7])
    keep = np.arange(n) != 7
    for ours, ref in ((w, w_ref), (m, m_ref), (v, v_ref)):
        np.testing.assert_allclose(ours[keep], ref[keep], rtol=rtol, atol=rtol)


def scan_reference(u, Delta, Bs, Cs, A_log, D_vec, discretization):
    """Sequential selective scan in float64 (docs/semantics.md steps 7-10)."""
    A = -np.exp(np.clip(A_log, -10.0, 5.0))                # (D, N)
    Bsz, L, D = u.shape
    h = np.zeros((Bsz, D, A.shape[1]))
    y = np.empty((Bsz, L, D))
    for t in range(L):
        dA = Delta[:, t, :, None] * A                        # (B, D, N)
        if discretization == 0:
            b_bar = np.expm1(dA) / A * Bs[:, t, None, :]
        else:
            b_bar = Delta[:, t, :, None] * Bs[:, t, None, :]
        h = np.exp(dA) * h + b_bar * u[:, t, :, None]
        y[:, t] = (h * Cs[:, t, None, :]).sum(-1) + D_vec * u[:, t]
    return y


def scan_case(dtype, seed=3, B=2, L=70, D=3, N=2, extra=3):
    """Inputs of one scan; L = 70 spans several SCAN_CHUNK time chunks (chunked backward).
    Bs and Cs are columns [0, N) and [N, 2N) of BC (B, L, 2N + extra)."""
    rng = np.random.default_rng(seed)
    return dict(
        u=rng.standard_normal((B, L, D)), Delta=rng.uniform(0.05, 1.0, (B, L, D)),
        BC=rng.standard_normal((B, L, 2 * N + extra)), A_log=rng.uniform(-2, 2, (D, N)),
        D_vec=rng.normal(1.0, 0.5, D), dy=rng.standard_normal((B, L, D)),
    ), (B, L, D, N), 2 * N + extra


def run_c_scan(c_client, inputs, sizes, ld_bc, disc, dtype):
    arrs = {k: np.ascontiguousarray(v, dtype) for k, v in inputs.items()}
    grads = [np.zeros_like(arrs[k]) for k in ("u", "Delta", "BC", "A_log", "D_vec")]
    y = np.full_like(arrs["u"], np.nan)
    c_client.scan_forward_backward(sizes, ld_bc, disc, arrs["u"], arrs["Delta"], arrs["BC"],
                                   arrs["A_log"], arrs["D_vec"], arrs["dy"], y, grads)
    return y, grads


@needs_compiler
@pytest.mark.parametrize("disc", [0, 1])
def test_c_api_scan_forward_and_gradients(c_client, disc):
    inputs, sizes, ld_bc = scan_case(np.float64)
    N = sizes[3]
    Bs, Cs = inputs["BC"][..., :N], inputs["BC"][..., N:2 * N]
    y_ref = scan_reference(inputs["u"], inputs["Delta"], Bs, Cs, inputs["A_log"],
                           inputs["D_vec"], disc)
    y, grads = run_c_scan(c_client, inputs, sizes, ld_bc, disc, np.float64)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    y32, grads32 = run_c_scan(c_client, inputs, sizes, ld_bc, disc, np.float32)
    np.testing.assert_allclose(y32, y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
    # The columns of BC that are neither Bs nor Cs get no gradient.
    assert not np.any(grads[2][..., 2 * N:])

    # float64 gradients against central finite differences of sum(y * dy),
    # one random direction per input.
    rng = np.random.default_rng(11)
    eps = 1e-6
    for name, g, g32 in zip(("u", "Delta", "BC", "A_log", "D_vec"), grads, grads32):
        v = rng.standard_normal(inputs[name].shape)
        if name == "BC":
            v[..., 2 * N:] = 0.0
        loss = []
        for sign in (1.0, -1.0):
            moved = dict(inputs, **{name: inputs[name] + sign * eps * v})
            y_m, _ = run_c_scan(c_client, moved, sizes, ld_bc, disc, np.float64)
            loss.append(np.sum(y_m * inputs["dy"]))
        fd = (loss[0] - loss[1]) / (2 * eps)
        an = float(np.sum(g * v))
        assert abs(an - fd) <= 1e-6 * max(1.0, abs(fd)), (name, an, fd)
        # float32 entries: the same gradient to single precision
        np.testing.assert_allclose(g32, g, rtol=1e-3, atol=1e-4 * np.abs(g).max(),
                                   err_msg=name)


@needs_compiler
def test_c_api_rejects_bad_arguments(c_client):
    res = c_client.bad_calls()
    for key in ("cache_len_null", "cache_len_zero", "cache_len_bad_disc", "hstates_len_zero"):
        assert res.pop(key) == 0, key
    for key in ("adamw_null", "adamw_step0"):
        assert res.pop(key) == -4, key       # -MAMBA_EXT_ERR_ARG
    assert res and all(code == 4 for code in res.values()), res   # MAMBA_EXT_ERR_ARG


@needs_compiler
def test_import_with_wrong_abi_version_raises_clearly(c_client):
    from mamba_ext.cpu import capi as _capi
    abi, count = _capi.abi_version(), _capi.api_count()
    c_client.load_api(abi, count)                    # what import_mamba_ext() does
    with pytest.raises(ImportError, match=rf"version mismatch.*ABI version {abi + 1}.*"
                                          rf"provides ABI version {abi}"):
        c_client.load_api(abi + 1, count)
    with pytest.raises(ImportError, match=rf"too old.*needs {count + 1} table entries"):
        c_client.load_api(abi, count + 1)


# ------------------------------------------------------------ the Cython client

@needs_compiler
@pytest.mark.parametrize("case", ["block_basic", "block_odd_sizes", "block_alog_clamp"])
def test_cython_cimport_block_golden(cy_client, c_client, case):
    data = load_golden(case)
    params = [data["w_" + n] for n in BLOCK_PARAM_NAMES]
    grads = [np.zeros_like(p) for p in params]
    out, dx, n_cache = cy_client.forward_backward(block_dims(data), data["x"], data["dout"],
                                                  params, grads)
    check_block_result(case, data, out, dx, grads)
    # Both routes size the caller-owned cache the same way.
    assert n_cache == run_c_block(c_client, data, np.float32)[3]
