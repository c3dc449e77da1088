"""Float64 finite-difference check of the block (``python -m mamba_ext gradcheck``).

For each small configuration below, every element (or a random sample of the
elements, for the long-sequence case) of ``x`` and of the 13 parameters is
perturbed by +-h and +-2h and the 4-point central difference of
``Loss = sum(out * dout)`` is compared with the analytic gradient from ``mamba1_backward``. The error of a
tensor is ``max|fd - analytic| / max|analytic|`` (over the whole tensor), so
tiny gradient entries are judged on the tensor's own scale. Exit status 1 if
any error exceeds the threshold (1e-6), or if the A_log gradient is not exactly
0 at the clamp bounds.

The same configurations and the same checker are used by
``tests/cpu/test_block_gradcheck.py``.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from .._validate import BLOCK_PARAM_NAMES
from ..constants import A_LOG_MAX, A_LOG_MIN

THRESHOLD = 1e-6
STEP = 1e-5           # finite-difference step: rounding ~1e-16/h, truncation ~h^4


class GradCase(NamedTuple):
    x: np.ndarray          # (B, L, Dm)
    params: dict           # the 13 block parameters
    dout: np.ndarray       # (B, L, Dm)
    kwargs: dict           # eps / discretization for mamba1_forward
    max_elems: int | None  # per tensor; None: every element
    skip: dict             # name -> bool mask of elements not to difference


def random_block_params(rng, Dm, D, N, K, R, dtype=np.float64):
    """Random block weights with O(1) gradients (golden README "random-init" law)."""
    P = R + 2 * N
    p = {
        "wInProj": rng.normal(0, Dm ** -0.5, (2 * D, Dm)),
        "bInProj": rng.normal(0, 0.3, 2 * D),
        "wConv": rng.normal(0, (0.81 / K) ** 0.5, (D, K)),
        "bConv": rng.normal(0, 0.3, D),
        "wXProj": rng.normal(0, D ** -0.5, (P, D)),
        "bXProj": rng.normal(0, 0.3, P),
        "wDtProj": rng.normal(0, (0.25 / R) ** 0.5, (D, R)),
        "bDtProj": rng.uniform(-2, 0.5, D),
        "A_log": rng.uniform(-2, 2, (D, N)),
        "D_vec": rng.normal(1, 0.5, D),
        "wOutProj": rng.normal(0, D ** -0.5, (Dm, D)),
        "bOutProj": rng.normal(0, 0.3, Dm),
        "normWeight": rng.normal(1, 0.2, Dm),
    }
    return {n: np.ascontiguousarray(p[n], dtype=dtype) for n in BLOCK_PARAM_NAMES}


def _case(seed, Dm, D, N, K, R, B, L, dtype=np.float64, max_elems=None, **kwargs):
    rng = np.random.default_rng(seed)
    params = random_block_params(rng, Dm, D, N, K, R, dtype)
    x = rng.normal(0, 1, (B, L, Dm)).astype(dtype)
    dout = rng.normal(0, 1, (B, L, Dm)).astype(dtype)
    return GradCase(x, params, dout, kwargs, max_elems, {})


def _softplus_extremes(dtype=np.float64):
    c = _case(5, Dm=4, D=8, N=3, K=3, R=2, B=1, L=10, dtype=dtype)
    p = c.params
    p["bDtProj"][:4] = [30.0, -30.0, 25.0, -20.0]     # Delta ~ 30, ~1e-13, 25, ~2e-9
    p["wDtProj"][4] *= 20.0                           # delta swings through 0 over time
    p["bDtProj"][4] = 0.0
    p["wDtProj"][5] *= 12.0
    p["bDtProj"][5] = 0.0
    return c


def _alog_clamp(dtype=np.float64):
    c = _case(6, Dm=4, D=6, N=4, K=2, R=1, B=2, L=6, dtype=dtype)
    e = 2.0 ** -10          # 1e-3 from the kink: >> 2*STEP, so no difference straddles it
    A = c.params["A_log"]
    A[0] = [5.5, 7.0, 12.0, -11.0]                    # beyond the bounds: gradient 0
    A[1] = [A_LOG_MIN, A_LOG_MAX, A_LOG_MIN - e, A_LOG_MAX + e]  # at / just beyond
    A[2] = [A_LOG_MAX - e, A_LOG_MIN + e, 4.75, -9.5]  # just inside: gradient A*dL/dA
    A[3] = [-25.0, 6.5, A_LOG_MIN + 0.5, A_LOG_MAX - 0.5]
    # The exact bounds sit on the kink: not differentiable there, checked for exact 0 instead.
    return c._replace(skip={"A_log": (A == A_LOG_MIN) | (A == A_LOG_MAX)})


def _tiny_input(dtype=np.float64):
    c = _case(7, Dm=5, D=6, N=3, K=3, R=2, B=2, L=5, dtype=dtype, eps=1e-6)
    c.x[...] *= 2e-3           # mean square ~ eps: the RMSNorm eps matters
    c.x[0, 1] = 0.0            # a zero row
    return c


# name -> builder(dtype) of a GradCase; all small enough for full per-element FD
CONFIGS = {
    "basic": lambda dtype=np.float64: _case(1, Dm=4, D=8, N=3, K=3, R=2, B=2, L=7, dtype=dtype),
    "dstate1_dconv1": lambda dtype=np.float64: _case(2, Dm=3, D=6, N=1, K=1, R=1, B=2, L=5, dtype=dtype),
    "seqlen_lt_dconv": lambda dtype=np.float64: _case(3, Dm=5, D=10, N=4, K=4, R=1, B=3, L=2, dtype=dtype),
    "seqlen1": lambda dtype=np.float64: _case(4, Dm=3, D=4, N=2, K=3, R=2, B=2, L=1, dtype=dtype),
    "softplus_extremes": _softplus_extremes,
    "alog_clamp": _alog_clamp,
    "tiny_input_eps": _tiny_input,
    "euler": lambda dtype=np.float64: _case(8, Dm=4, D=6, N=3, K=3, R=2, B=2, L=6, dtype=dtype,
                                            discretization="euler"),
    # longer than the scan's chunk (states recomputed per chunk in the backward):
    # a random sample of x elements, every parameter element.
    "long_seq": lambda dtype=np.float64: _case(9, Dm=3, D=4, N=2, K=2, R=1, B=2, L=150, dtype=dtype,
                                               max_elems=64),
}


def finite_differences(forward, tensors, dout, *, h=STEP, max_elems=None, skip=None, seed=0):
    """Central differences of ``sum(forward(tensors) * dout)``.

    ``forward(tensors) -> out`` takes a dict of float64 arrays; ``tensors`` is
    not modified. Returns name -> (flat indices checked, fd values there).
    ``max_elems`` samples that many elements per tensor (None: all);
    ``skip`` name -> bool mask of elements to leave out.
    """
    rng = np.random.default_rng(seed)
    work = {n: np.array(a, dtype=np.float64, copy=True) for n, a in tensors.items()}
    dout = np.asarray(dout, dtype=np.float64)
    result = {}
    for name, arr in work.items():
        flat = arr.reshape(-1)          # a view: edits reach work[name]
        idx = np.arange(flat.size)
        if skip and name in skip:
            idx = idx[~np.asarray(skip[name]).reshape(-1)]
        if max_elems is not None and idx.size > max_elems:
            idx = np.sort(rng.choice(idx, max_elems, replace=False))
        fd = np.empty(idx.size)
        for j, i in enumerate(idx):
            orig = flat[i]
            diff = {}
            for s in (1, 2):     # out(+s*h) - out(-s*h)
                flat[i] = orig + s * h
                out_p = forward(work)
                flat[i] = orig - s * h
                diff[s] = out_p - forward(work)
            flat[i] = orig
            # 4-point central stencil, error O(h^4): a step of 1e-5 keeps the rounding
            # noise (~1e-16/h) far below 1e-6 without a visible truncation error.
            # Differences first, then the dot product: less rounding than two sums.
            fd[j] = np.sum((8.0 * diff[1] - diff[2]) * dout) / (12.0 * h)
        result[name] = (idx, fd)
    return result


def relative_errors(analytic, fd):
    """name -> max|fd - analytic| / max|analytic| over the checked elements."""
    errs = {}
    for name, (idx, values) in fd.items():
        an = np.asarray(analytic[name], dtype=np.float64).reshape(-1)
        scale = max(float(np.max(np.abs(an), initial=0.0)), float(np.max(np.abs(values), initial=0.0)))
        diff = float(np.max(np.abs(values - an[idx]), initial=0.0))
        errs[name] = diff / scale if scale > 0 else 0.0
    return errs


def check_case(case: GradCase, n_threads=1, h=STEP, seed=0):
    """Analytic vs FD for one case: returns (errors dict, analytic dict)."""
    from ..block import mamba1_backward, mamba1_forward

    out, cache = mamba1_forward(case.x, case.params, n_threads=n_threads, **case.kwargs)
    dx, grads = mamba1_backward(case.dout, case.params, cache)
    analytic = {"x": dx, **grads}

    def forward(t):
        return mamba1_forward(t["x"], {n: t[n] for n in BLOCK_PARAM_NAMES},
                              n_threads=n_threads, **case.kwargs)[0]

    fd = finite_differences(forward, {"x": case.x, **case.params}, case.dout, h=h,
                            max_elems=case.max_elems, skip=case.skip, seed=seed)
    return relative_errors(analytic, fd), analytic


def clamp_zero_violations(case: GradCase, analytic) -> int:
    """Count A_log entries at/beyond the clamp bounds whose gradient is not exactly 0."""
    A = case.params["A_log"]
    clamped = (A <= A_LOG_MIN) | (A >= A_LOG_MAX)
    return int(np.sum(clamped & (analytic["A_log"] != 0)))


def run(configs=None, *, threshold: float = THRESHOLD, h: float = STEP, n_threads: int = 1) -> int:
    """Check the configurations ``configs`` (names of :data:`CONFIGS`; None: all), print the
    table of errors; returns 0 if every error is <= ``threshold`` and the A_log gradient is
    exactly 0 at the clamp bounds, else 1."""
    names = list(configs) if configs else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"configs: unknown configuration(s) {unknown}; expected some of {sorted(CONFIGS)}")
    t0 = time.perf_counter()
    table, ok = {}, True
    for name in names:
        case = CONFIGS[name]()
        errs, analytic = check_case(case, n_threads=n_threads, h=h)
        bad_zeros = clamp_zero_violations(case, analytic)
        if bad_zeros:
            ok = False
            print(f"FAIL {name}: A_log gradient not exactly 0 at {bad_zeros} clamped entries")
        table[name] = errs

    tensors = ["x"] + list(BLOCK_PARAM_NAMES)
    width = max(11, max(len(n) for n in names) + 1)
    print("max relative error |fd - analytic| / max|analytic|, float64, 4-point central "
          f"differences, h = {h:g}")
    print(f"{'tensor':<11}" + "".join(f"{n:>{width}}" for n in names))
    for t in tensors:
        print(f"{t:<11}" + "".join(f"{table[n][t]:>{width}.2e}" for n in names))
    worst_cfg, worst_t = max(((n, t) for n in names for t in tensors), key=lambda nt: table[nt[0]][nt[1]])
    worst = table[worst_cfg][worst_t]
    ok = ok and worst <= threshold
    print(f"worst: {worst:.2e} ({worst_t} in {worst_cfg}); threshold {threshold:g}; "
          f"{time.perf_counter() - t0:.1f} s")
    print("gradcheck PASSED" if ok else "gradcheck FAILED")
    return 0 if ok else 1
