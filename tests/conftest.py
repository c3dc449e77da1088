"""Shared test helpers: the golden files of tests/data/golden and their tolerance rule.

Test modules import these as ``from conftest import load_golden, assert_golden_close``
(pyproject.toml's ``pythonpath`` puts this folder on ``sys.path``, because pytest runs with
``--import-mode=importlib``, which does not do it).

The tolerance rule is the one of ``docs/semantics.md`` ("Recommended
tolerance for a float32 re-implementation"); see :func:`assert_golden_close`.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest

# A_log clamp bounds of the golden semantics (step 7): the gradient is exactly
# zero at and beyond them. Defined once, in mamba_ext.constants; re-exported for tests.
from mamba_ext.constants import A_LOG_MAX, A_LOG_MIN

__all__ = ["A_LOG_MIN", "A_LOG_MAX", "optional", "golden_dir", "load_golden", "golden_block_case",
           "golden_tolerance", "assert_golden_close", "clamped_mask", "assert_clamped_grad_zero",
           "BLOCK_GOLDEN", "MODEL_GOLDEN"]

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh temporary working folder: nothing a test or its
    subprocesses write lands in the checkout, and ``python -m mamba_ext`` in a subprocess
    imports the installed package, never the checkout's unbuilt source folder (``-m``
    puts the working folder first on ``sys.path``)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def optional(module: str, why: str):
    """Import an optional test dependency, or skip the calling test with a reason.

    ``why`` says what the dependency is for and how to get it (``"pip install torch"``).
    Under ``CI=true`` a missing optional dependency FAILS instead: CI installs every one,
    so a test that would vanish there is a broken install, not a skip.
    Usable at module level (skips the whole file) or inside a test or fixture.
    """
    try:
        return importlib.import_module(module)
    except Exception as e:          # ImportError, or a broken install (OSError, ...)
        msg = f"optional dependency {module!r} unavailable ({type(e).__name__}: {e}); {why}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true: " + msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


# The cases documented in docs/semantics.md. Listed explicitly so that a
# missing folder or file FAILS (load_golden raises) instead of parametrizing
# over nothing; files added later are picked up as well.
KNOWN_BLOCK_GOLDEN = (
    "block_basic", "block_seqlen1", "block_short_seq_batch3_odd",
    "block_minimal_rank_state_conv", "block_odd_sizes", "block_alog_clamp",
    "block_softplus_extremes", "block_realistic_init", "block_large",
    "block_tiny_input_eps",
)
KNOWN_MODEL_GOLDEN = ("model_1layer", "model_2layer")



def golden_dir() -> Path:
    """``tests/data/golden`` — the reference vectors, kept inside the repository."""
    return TESTS_DIR / "data" / "golden"


def _listed(prefix: str, known) -> list:
    found = {p.stem for p in golden_dir().glob(prefix + "*.npz")}
    return sorted(set(known) | found)


BLOCK_GOLDEN = _listed("block_", KNOWN_BLOCK_GOLDEN)
MODEL_GOLDEN = _listed("model_", KNOWN_MODEL_GOLDEN)


def load_golden(name: str) -> dict:
    """All arrays of one golden case, e.g. ``load_golden("block_basic")``.

    Verifies what it read: the ``dims`` vector and the float32 dtype of every
    weight/gradient, so a truncated or foreign file fails loudly here.
    """
    path = golden_dir() / (name if name.endswith(".npz") else name + ".npz")
    if not path.is_file():
        raise FileNotFoundError(f"golden case {name!r} not found at {path} "
                                f"(expected in tests/data/golden)")
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    if "dims" not in data or data["dims"].dtype != np.int64:
        raise ValueError(f"{path}: no int64 'dims' vector")
    for k, v in data.items():
        if k.startswith(("w_", "g_")) and v.dtype != np.float32:
            raise ValueError(f"{path}: {k} has dtype {v.dtype}, expected float32")
    return data


def golden_block_case(data: dict):
    """``(x, params, dout)`` of a block case; params keyed by BLOCK_PARAM_NAMES."""
    params = {k[2:]: v for k, v in data.items() if k.startswith("w_")}
    return data["x"], params, data["dout"]


def golden_tolerance(name: str, ref: np.ndarray, case: str):
    """Per-element allowed |ours - ref| for array ``name`` of golden ``case``.

    Default: ``2e-5 * max|ref| + 1e-4 * |ref|``. In ``*clamp*`` cases ``dx`` and
    every gradient except A_log's get ``2e-3 * max|ref|`` (the reference's own
    error, README "Known error of the reference itself").
    """
    ref = np.asarray(ref, dtype=np.float64)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    is_grad = name == "dx" or name.startswith("g_")
    if "clamp" in case and is_grad and not name.endswith("A_log"):
        return np.full(ref.shape, 2e-3 * scale)
    return 2e-5 * scale + 1e-4 * np.abs(ref)


def assert_golden_close(name: str, ours, ref, case: str) -> float:
    """Assert ``ours`` matches golden array ``ref`` under the README rule.

    ``name`` is the golden key (``"out"``, ``"dx"``, ``"g_wInProj"``,
    ``"logits"``, ``"loss"``, ``"g_layer0.A_log"`` ...), ``case`` the file name
    (``"block_alog_clamp"``). ``loss`` needs relative error <= 1e-6. Returns the
    fraction of the budget used (worst element), for reporting.
    """
    ours = np.asarray(ours)
    ref = np.asarray(ref)
    assert ours.shape == ref.shape, f"{case}/{name}: shape {ours.shape}, golden {ref.shape}"
    assert np.all(np.isfinite(ours)), f"{case}/{name}: non-finite values"
    if name == "loss":
        rel = abs(float(ours) - float(ref)) / abs(float(ref))
        assert rel <= 1e-6, f"{case}/loss: {float(ours)!r} vs golden {float(ref)!r}, rel err {rel:.3g} > 1e-6"
        return rel / 1e-6
    if ref.size == 0:
        return 0.0
    err = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    tol = golden_tolerance(name, ref, case)
    ratio = np.where(tol > 0, err / np.where(tol > 0, tol, 1.0), np.where(err > 0, np.inf, 0.0))
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    used = float(ratio[worst])
    assert used <= 1.0, (
        f"{case}/{name}: |ours - ref| exceeds the golden tolerance {used:.3g}x at index {worst}: "
        f"ours {float(ours[worst])!r}, golden {float(ref[worst])!r}, allowed {float(tol[worst]):.3g} "
        f"(max|ref| = {float(np.max(np.abs(ref))):.3g}; {int(np.sum(ratio > 1))} of {ref.size} elements out)")
    return used


def clamped_mask(A_log) -> np.ndarray:
    """Entries of A_log at or beyond the clamp bounds, where its gradient is exactly 0."""
    A_log = np.asarray(A_log)
    return (A_log <= A_LOG_MIN) | (A_log >= A_LOG_MAX)


def assert_clamped_grad_zero(g_A_log, A_log, what: str = "g_A_log") -> int:
    """Assert the A_log gradient is exactly 0.0 at every clamped entry; returns their count."""
    mask = clamped_mask(A_log)
    g = np.asarray(g_A_log)
    bad = np.argwhere(mask & (g != 0))
    assert bad.size == 0, (f"{what}: not exactly 0 at clamped A_log entries, e.g. index "
                           f"{tuple(bad[0])}: A_log = {float(np.asarray(A_log)[tuple(bad[0])])!r}, "
                           f"grad = {float(g[tuple(bad[0])])!r} ({len(bad)} such entries)")
    return int(mask.sum())
