"""The house rules of the package, checked: constants defined once, one eps rule, no
environment change at import, one version string, the library never imports the CLI,
and the two PyTorch baselines (sequential and chunked scan) agree with the reference."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import optional

import mamba_ext
from mamba_ext import constants
from mamba_ext._validate import check_eps

PKG = Path(mamba_ext.__file__).resolve().parent      # the imported package (installed or not)
REPO = Path(__file__).resolve().parents[2]            # the source checkout holding these tests


def _sources(exclude=()):
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not any(rel.startswith(e) for e in exclude):
            yield rel, ast.parse(path.read_text(encoding="utf-8"), rel)


# ---- constants defined once ---------------------------------------------------------------

def test_constant_values():
    assert (constants.A_LOG_MIN, constants.A_LOG_MAX, constants.DEFAULT_EPS) == (-10.0, 5.0, 1e-6)
    assert constants.DEFAULT_NO_DECAY == {"A_log", "D_vec", "bInProj", "bConv", "bXProj", "bDtProj",
                                          "bOutProj", "lm_head_bias", "normWeight", "final_norm"}
    from mamba_ext import optim
    from mamba_ext.testing import gradcheck, reference
    assert optim.DEFAULT_NO_DECAY is constants.DEFAULT_NO_DECAY
    assert reference.A_LOG_MIN is constants.A_LOG_MIN and gradcheck.A_LOG_MAX is constants.A_LOG_MAX


def test_no_second_definition_of_a_constant():
    """No module but constants.py assigns the names; no function has a literal 1e-6 default
    for an ``eps``."""
    names = {"A_LOG_MIN", "A_LOG_MAX", "DEFAULT_EPS", "DEFAULT_NO_DECAY"}
    found = []
    for rel, tree in _sources():
        if rel == "constants.py":
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name) and leaf.id in names:
                        found.append(f"{rel}:{node.lineno} assigns {leaf.id}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = ([None] * (len(node.args.args) - len(node.args.defaults))
                            + list(node.args.defaults) + list(node.args.kw_defaults))
                for a, d in zip(args, defaults):
                    if "eps" in a.arg and isinstance(d, ast.Constant) and d.value == 1e-6:
                        found.append(f"{rel}:{node.lineno} {node.name}({a.arg}=1e-6)")
    assert not found, found


def test_library_never_imports_the_cli():
    bad = []
    for rel, tree in _sources(exclude=("cli/", "__main__.py")):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                absolute = mod if node.level == 0 else "." * node.level + mod
                if mod.startswith("mamba_ext.cli") or absolute.lstrip(".").startswith("cli") \
                        or (node.level and any(a.name == "cli" for a in node.names)):
                    bad.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Import):
                bad += [f"{rel}:{node.lineno}" for a in node.names if a.name.startswith("mamba_ext.cli")]
    assert not bad, f"library modules importing mamba_ext.cli: {bad}"


# ---- one eps rule -------------------------------------------------------------------------

@pytest.mark.parametrize("good", [1e-6, 1e-5, 1, np.float32(1e-3), np.int64(2), 1e300])
def test_check_eps_accepts_finite_positive_reals(good):
    assert check_eps(good) == float(good) and type(check_eps(good)) is float


@pytest.mark.parametrize("bad, error", [
    ("1e-6", TypeError), (b"1", TypeError), (True, TypeError), (np.bool_(True), TypeError),
    (None, TypeError), ([1e-6], TypeError), (np.array([1e-6]), TypeError),
    (0, ValueError), (0.0, ValueError), (-1e-6, ValueError), (math.nan, ValueError),
    (math.inf, ValueError), (-math.inf, ValueError), (np.float32("nan"), ValueError),
])
def test_check_eps_refuses(bad, error):
    with pytest.raises(error, match="eps"):
        check_eps(bad)


def _tiny_model():
    return mamba_ext.init_model_params(7, 4, 1, d_state=2, seed=0, dtype=np.float64)


@pytest.mark.parametrize("bad, error", [("1e-6", TypeError), (True, TypeError),
                                        (0.0, ValueError), (math.nan, ValueError)])
def test_every_entry_point_uses_the_eps_rule(bad, error):
    from mamba_ext import recurrent
    from mamba_ext.io.hf import params_to_hf
    p = _tiny_model()
    tok = np.zeros((1, 3), np.int64)
    block = {k[len("layer0."):]: v for k, v in p.items() if k.startswith("layer0.")}
    calls = {
        "mamba1_forward": lambda: mamba_ext.mamba1_forward(np.zeros((1, 2, 4)), block, eps=bad),
        "model_forward": lambda: mamba_ext.model_forward(tok, p, eps=bad),
        "model_loss_and_grads": lambda: mamba_ext.model_loss_and_grads(tok, tok, p, eps=bad),
        "init_state": lambda: recurrent.init_state(p, 1, eps=bad),
        "generate": lambda: recurrent.generate(p, tok, 1, eps=bad),
        "params_to_hf": lambda: params_to_hf(p, {"eps": bad, "discretization": "euler"}),
    }
    for name, call in calls.items():
        with pytest.raises(error, match="eps"):
            call()
            pytest.fail(f"{name} accepted eps={bad!r}")


def test_train_refuses_a_bad_eps(tmp_path):
    from mamba_ext.training.loop import TrainConfig, train
    data = tmp_path / "d.txt"
    data.write_bytes(b"abcdefgh" * 64)
    with pytest.raises(TypeError, match="eps"):
        train(TrainConfig(data=str(data), eps="1e-6", steps=1, seq_len=8, batch=2, d_model=4,
                          n_layers=1, d_state=2), tmp_path / "run", progress=None, log=lambda s: None)


# ---- no environment change at import; configure_threads ------------------------------------

def _python(code: str, env_extra=None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tempfile.gettempdir(), timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_and_use_change_no_environment_variable():
    out = _python(
        "import os, json\n"
        "before = dict(os.environ)\n"
        "import numpy as np, mamba_ext\n"
        "p = mamba_ext.init_model_params(7, 4, 1, d_state=2)\n"
        "mamba_ext.model_loss_and_grads(np.zeros((1, 3), int), np.zeros((1, 3), int), p)\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({'changed': sorted(k for k in set(before) | set(after)"
        " if before.get(k) != after.get(k))}))\n")
    assert out["changed"] == []


def test_configure_threads_before_and_after_the_kernels_load():
    out = _python(
        "import os, json, mamba_ext\n"
        "first = mamba_ext.configure_threads()\n"
        "env = {k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT',"
        " 'OPENBLAS_THREAD_TIMEOUT')}\n"
        "import mamba_ext.block\n"
        "again = mamba_ext.configure_threads()\n"
        "print(json.dumps({'first': first, 'env': env, 'again': again}))\n")
    assert out["first"] == {"OMP_WAIT_POLICY": True, "GOMP_SPINCOUNT": True,
                            "OPENBLAS_THREAD_TIMEOUT": True}
    assert out["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000",
                          "OPENBLAS_THREAD_TIMEOUT": "4"}
    # both libraries are loaded now: too late for either setting
    assert out["again"]["OPENBLAS_THREAD_TIMEOUT"] is False
    if sys.platform.startswith("linux"):
        assert out["again"]["OMP_WAIT_POLICY"] is out["again"]["GOMP_SPINCOUNT"] is False


def test_configure_threads_keeps_the_users_setting():
    out = _python("import os, json, mamba_ext\nmamba_ext.configure_threads()\n"
                  "print(json.dumps([os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT']]))\n",
                  {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"})
    assert out == ["ACTIVE", "0"]


# ---- one version string ---------------------------------------------------------------------

def test_one_version_string():
    assert mamba_ext.__version__ == importlib.metadata.version("mamba_ext")
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert "\nversion" not in project and 'dynamic = ["version"]' in project
    assert 'version = {attr = "mamba_ext.__version__"}' in pyproject


# ---- the PyTorch baselines --------------------------------------------------------------------

@pytest.mark.parametrize("L, chunk", [(1, 4), (7, 4), (16, 4), (9, 16)])
def test_torch_baselines_match_the_reference(L, chunk):
    optional("torch", "pip install torch to check the benchmark baselines")
    import torch

    from mamba_ext.testing import reference
    from mamba_ext.testing import torch_block as tb
    from mamba_ext.testing.gradcheck import random_block_params
    rng = np.random.default_rng(L)
    params = random_block_params(rng, 5, 8, 3, 3, 2)
    params["A_log"][0, :2] = [constants.A_LOG_MIN - 1, constants.A_LOG_MAX + 1]   # clamped
    x = rng.standard_normal((2, L, 5))
    dout = rng.standard_normal((2, L, 5))
    ref = reference.block_forward(x, params)
    results = []
    for fwd in (tb.block_forward, lambda a, p: tb.block_forward_chunked(a, p, chunk=chunk)):
        tx, tp = tb.make_inputs(x, params, dtype=torch.float64)
        out, dx, grads = tb.forward_backward(tx, tp, torch.tensor(dout), forward=fwd)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)
        assert grads["A_log"][0, 0].item() == 0.0 and grads["A_log"][0, 1].item() == 0.0
        results.append((dx.numpy(), {k: v.numpy() for k, v in grads.items()}))
    (dx_a, g_a), (dx_b, g_b) = results
    np.testing.assert_allclose(dx_a, dx_b, rtol=1e-9, atol=1e-11)
    for k in g_a:
        np.testing.assert_allclose(g_a[k], g_b[k], rtol=1e-9, atol=1e-11, err_msg=k)


# ---- type annotations on the public API (py.typed) ----------------------------------------------

PUBLIC_MODULES = ("block", "model", "recurrent", "optim", "amp", "constants", "io.checkpoint", "io.hf",
                  "_validate")


def _public_callables(module):
    import inspect
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj) and not issubclass(obj, tuple):
            for mname, meth in vars(obj).items():
                if inspect.isfunction(meth) and (not mname.startswith("_") or mname == "__init__"):
                    yield f"{name}.{mname}", meth


@pytest.mark.parametrize("modname", PUBLIC_MODULES)
def test_public_api_is_annotated(modname):
    import importlib
    import inspect
    module = importlib.import_module(f"mamba_ext.{modname}")
    missing = []
    for name, fn in _public_callables(module):
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                missing.append(f"{name}({p.name})")
        if sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{name} -> ?")
    assert not missing, f"mamba_ext.{modname}: unannotated {missing}"
    assert (PKG / "py.typed").is_file()
