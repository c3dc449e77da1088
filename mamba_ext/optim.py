"""AdamW and global-norm gradient clipping over dicts of NumPy arrays.

The arithmetic runs in the compiled kernel ``mamba_ext.cpu.adamw`` (one fused,
in-place pass over every parameter of a dtype, in one call; exact maths documented in
``mamba_ext/cpu/adamw.pxd``).

AdamW follows ``torch.optim.AdamW`` (amsgrad=False, maximize=False), step t:

    w <- w - lr * weight_decay * w                 (decoupled, pre-update w)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Additions:
  * trust region ``max_delta`` > 0: each element's total change (decay plus
    Adam step) is clamped to [-max_delta, max_delta], so |w_new - w| <=
    max_delta always; 0 disables it (then the update is PyTorch's);
  * NaN guard: if any gradient holds a NaN/Inf, ``step`` skips the whole step
    (weights, moments and step count untouched), counts it in ``skipped`` and
    returns False; inside the kernel, an element whose update is not finite
    (e.g. g^2 overflowing) is left unchanged and counted in ``nonfinite``.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ._validate import check_n_threads, named_arrays, state_scalar
from .constants import DEFAULT_NO_DECAY
from .cpu import adamw as _adamw

__all__ = ["AdamW", "clip_grad_norm", "DEFAULT_NO_DECAY"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_SCALAR_KEYS = ("step", "skipped", "nonfinite", "lr", "beta1", "beta2", "eps",
                "weight_decay", "max_delta")


def name_matches(name: str, entries: Collection[str]) -> bool:
    """``name`` equals an entry or ends with "." + entry ("A_log" matches
    "layer3.A_log"; "layer3.A_log" matches only that name)."""
    return any(name == e or name.endswith("." + e) for e in entries)


def _check_hyper(lr, betas, eps, weight_decay, max_delta):
    """Validated hyper-parameters as floats: (lr, beta1, beta2, eps, wd, max_delta)."""
    def num(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"AdamW: {name}: expected a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"AdamW: {name}: expected a finite number, got {v}")
        return v
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"AdamW: betas: expected a pair (beta1, beta2), got {betas!r}") from None
    lr, beta1, beta2, eps, wd, md = (num(n, v) for n, v in (
        ("lr", lr), ("betas[0]", beta1), ("betas[1]", beta2), ("eps", eps),
        ("weight_decay", weight_decay), ("max_delta", max_delta)))
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", wd), ("max_delta", md)):
        if v < 0:
            raise ValueError(f"AdamW: {name}: expected a value >= 0, got {v}")
    for name, v in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= v < 1.0:
            raise ValueError(f"AdamW: {name}: expected a value in [0, 1), got {v}")
    return lr, beta1, beta2, eps, wd, md


class AdamW:
    """AdamW over a dict of float32/float64 arrays, updated in place.

    ``params``: mapping name -> C-contiguous, writeable float32/float64 numpy
    array; the optimizer keeps references to these very arrays and ``step``
    writes into them. Moments ``exp_avg``/``exp_avg_sq`` have each parameter's
    dtype and shape.

    ``no_decay``: names or suffixes exempt from weight decay. A parameter is
    exempt iff it equals an entry or ends with "." followed by an entry, so
    "A_log" covers "A_log" and "layer0.A_log", "layer0.A_log" covers only that
    name. Default :data:`mamba_ext.constants.DEFAULT_NO_DECAY`; ``()`` decays everything. Entries
    that match no parameter are allowed (one set serves block and model
    dicts); ``decayed`` lists the parameters that do get decay.

    ``lr``, ``betas``, ``eps``, ``weight_decay``, ``max_delta`` are attributes
    that may change between steps (schedules); they are validated at each step.
    ``n_threads``: OpenMP threads for large arrays; None = OpenMP's default.
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, max_delta: float = 0.0,
                 no_decay: Collection[str] = DEFAULT_NO_DECAY, n_threads: int | None = None) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(f"AdamW: params: expected a mapping name -> array, got {type(params).__name__}")
        self.params = {}
        for name, a in params.items():
            if not isinstance(name, str):
                raise TypeError(f"AdamW: params: names must be str, got {name!r}")
            if not isinstance(a, np.ndarray) or a.dtype not in _FLOATS:
                raise TypeError(f"AdamW: params[{name!r}]: expected a float32 or float64 numpy array, "
                                f"got {getattr(a, 'dtype', type(a).__name__)}")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"AdamW: params[{name!r}]: must be a C-contiguous, writeable array "
                                 f"(it is updated in place)")
            self.params[name] = a
        if isinstance(no_decay, str) or not all(isinstance(e, str) for e in no_decay):
            raise TypeError(f"AdamW: no_decay: expected a collection of names (str), got {no_decay!r}")
        self.no_decay = frozenset(no_decay)
        self.decayed = tuple(n for n in self.params if not name_matches(n, self.no_decay))
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_delta = weight_decay, max_delta
        _check_hyper(lr, betas, eps, weight_decay, max_delta)
        self.n_threads = check_n_threads(n_threads)     # 0 means OpenMP's default
        self.exp_avg = {n: np.zeros_like(a) for n, a in self.params.items()}
        self.exp_avg_sq = {n: np.zeros_like(a) for n, a in self.params.items()}
        self.step_count = 0     # steps applied (bias-correction t of the last one)
        self.skipped = 0        # steps skipped because a gradient was not finite
        self.nonfinite = 0      # elements the kernel's per-element guard left unchanged

    def _flat_grads(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validated gradients as flat C-contiguous arrays, keyed like params."""
        if not isinstance(grads, Mapping):
            raise TypeError(f"AdamW.step: grads: expected a mapping name -> array, "
                            f"got {type(grads).__name__}")
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise ValueError(f"AdamW.step: grads: missing gradient(s) for {missing}")
        unknown = sorted(str(n) for n in grads if n not in self.params)
        if unknown:
            raise ValueError(f"AdamW.step: grads: unknown name(s) {unknown}; expected the names of params")
        flat = {}
        for n, w in self.params.items():
            g = grads[n]
            if not isinstance(g, np.ndarray) or g.dtype != w.dtype:
                raise TypeError(f"AdamW.step: grads[{n!r}]: expected a {w.dtype} numpy array (the dtype "
                                f"of the parameter), got {getattr(g, 'dtype', type(g).__name__)}")
            if g.shape != w.shape:
                raise ValueError(f"AdamW.step: grads[{n!r}]: expected shape {w.shape}, got {g.shape}")
            flat[n] = np.ascontiguousarray(g).reshape(-1)
        return flat

    def _check_updatable(self) -> None:
        """Every parameter and moment can still be updated in place: the arrays the
        optimizer holds are public attributes and may have been replaced or made read-only
        since __init__. Raises before anything changes."""
        if self.n_threads != 0:          # 0: OpenMP's default team
            check_n_threads(self.n_threads)
        for n, w in self.params.items():
            for what, a in (("params", w), ("exp_avg", self.exp_avg.get(n)),
                            ("exp_avg_sq", self.exp_avg_sq.get(n))):
                if not isinstance(a, np.ndarray) or a.dtype != w.dtype or a.shape != w.shape:
                    raise TypeError(f"AdamW.step: {what}[{n!r}]: expected a {w.dtype} array of shape "
                                    f"{w.shape}, got {getattr(a, 'dtype', type(a).__name__)} "
                                    f"{getattr(a, 'shape', '')}; nothing was updated")
                if a.dtype not in _FLOATS:
                    raise TypeError(f"AdamW.step: {what}[{n!r}]: dtype {a.dtype} is not float32/float64; "
                                    f"nothing was updated")
                if not (a.flags.c_contiguous and a.flags.writeable):
                    raise ValueError(f"AdamW.step: {what}[{n!r}]: must be a C-contiguous, writeable array "
                                     f"(it is updated in place); nothing was updated")

    def step(self, grads: Mapping[str, np.ndarray], grad_scale: float = 1.0) -> bool:
        """One AdamW step with ``grads * grad_scale`` (grad_scale > 0 fuses an
        unscale or a clip factor into the update). Returns True if applied,
        False if skipped because a gradient held a NaN/Inf."""
        lr, beta1, beta2, eps, wd, md = _check_hyper(self.lr, self.betas, self.eps,
                                                     self.weight_decay, self.max_delta)
        if (isinstance(grad_scale, bool) or not isinstance(grad_scale, numbers.Real)
                or not (math.isfinite(grad_scale) and grad_scale > 0)):
            raise ValueError(f"AdamW.step: grad_scale: expected a finite number > 0, got {grad_scale!r}")
        flat = self._flat_grads(grads)
        self._check_updatable()        # all or nothing: every array is checked before any update
        # one compiled call per dtype (of all its arrays, in one parallel region)
        by_dtype: dict[np.dtype, list[str]] = {}
        for n, w in self.params.items():
            by_dtype.setdefault(w.dtype, []).append(n)
        if any(_adamw.count_nonfinite_arrays([flat[n] for n in names], self.n_threads)
               for names in by_dtype.values()):
            self.skipped += 1
            return False
        t = self.step_count + 1
        decayed = set(self.decayed)
        for names in by_dtype.values():
            self.nonfinite += _adamw.adamw_update_arrays(
                [self.params[n].reshape(-1) for n in names],
                [self.exp_avg[n].reshape(-1) for n in names],
                [self.exp_avg_sq[n].reshape(-1) for n in names], [flat[n] for n in names],
                [wd if n in decayed else 0.0 for n in names], lr, beta1, beta2, eps, md, t,
                float(grad_scale), self.n_threads)
        self.step_count = t
        return True

    def state_dict(self) -> dict[str, object]:
        """Flat dict, ready for safetensors: ``exp_avg.<name>`` and
        ``exp_avg_sq.<name>`` arrays (copies) plus Python scalars ``step``,
        ``skipped``, ``nonfinite``, ``lr``, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``, ``max_delta``. ``no_decay`` is configuration, not
        state: re-create the optimizer with the same one."""
        lr, beta1, beta2, eps, wd, md = _check_hyper(self.lr, self.betas, self.eps,
                                                     self.weight_decay, self.max_delta)
        state = {"step": self.step_count, "skipped": self.skipped, "nonfinite": self.nonfinite,
                 "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                 "weight_decay": wd, "max_delta": md}
        for n in self.params:
            state["exp_avg." + n] = self.exp_avg[n].copy()
            state["exp_avg_sq." + n] = self.exp_avg_sq[n].copy()
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from :meth:`state_dict` output (scalars may also be
        1-element arrays). Everything is validated before anything changes:
        exactly the expected keys, each moment with its parameter's dtype and
        shape, finite, ``exp_avg_sq`` >= 0, counts integral and >= 0."""
        if not isinstance(state, Mapping):
            raise TypeError(f"AdamW.load_state_dict: expected a mapping, got {type(state).__name__}")
        arrays = {}
        for prefix in ("exp_avg.", "exp_avg_sq."):
            for n, w in self.params.items():
                key = prefix + n
                if key not in state:
                    raise ValueError(f"AdamW.load_state_dict: missing key {key!r}")
                a = state[key]
                if not isinstance(a, np.ndarray) or a.dtype != w.dtype:
                    raise TypeError(f"AdamW.load_state_dict: {key!r}: expected a {w.dtype} array, got "
                                    f"{getattr(a, 'dtype', type(a).__name__)}")
                if a.shape != w.shape:
                    raise ValueError(f"AdamW.load_state_dict: {key!r}: expected shape {w.shape}, "
                                     f"got {a.shape}")
                if not np.isfinite(a).all():
                    raise ValueError(f"AdamW.load_state_dict: {key!r}: holds NaN or Inf")
                if prefix == "exp_avg_sq." and (a < 0).any():
                    raise ValueError(f"AdamW.load_state_dict: {key!r}: holds negative values")
                arrays[key] = a
        unknown = sorted(str(k) for k in state if k not in arrays and k not in _SCALAR_KEYS)
        if unknown:
            raise ValueError(f"AdamW.load_state_dict: unknown key(s) {unknown}")
        counts = {k: state_scalar(state, k, integral=True) for k in ("step", "skipped", "nonfinite")}
        for k, v in counts.items():
            if v < 0:
                raise ValueError(f"AdamW.load_state_dict: {k!r} must be >= 0, got {v}")
        hyper = {k: state_scalar(state, k) for k in _SCALAR_KEYS[3:]}
        lr, beta1, beta2, eps, wd, md = _check_hyper(
            hyper["lr"], (hyper["beta1"], hyper["beta2"]), hyper["eps"],
            hyper["weight_decay"], hyper["max_delta"])
        for n in self.params:
            np.copyto(self.exp_avg[n], arrays["exp_avg." + n])
            np.copyto(self.exp_avg_sq[n], arrays["exp_avg_sq." + n])
        self.step_count, self.skipped, self.nonfinite = counts["step"], counts["skipped"], counts["nonfinite"]
        self.lr, self.betas, self.eps, self.weight_decay, self.max_delta = lr, (beta1, beta2), eps, wd, md


def clip_grad_norm(grads: Mapping[str, np.ndarray] | Sequence[np.ndarray], max_norm: float,
                   n_threads: int | None = None) -> float:
    """Clip gradients by their global L2 norm, in place; return the norm before clipping.

    ``grads``: mapping name -> array or a sequence of float32/float64 arrays.
    The norm sqrt(sum of g^2 over all elements) is accumulated in float64
    (rescaled by the largest |g| if the plain sum overflows). If it is finite
    and > ``max_norm`` every gradient is multiplied by
    ``max_norm / (norm + 1e-6)`` (PyTorch's clip_grad_norm_ coefficient). A
    NaN/Inf norm is returned as is and the gradients are left untouched (the
    optimizer's NaN guard then skips the step).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm: expected a number > 0 (inf allowed), got {max_norm!r}")
    n_threads = check_n_threads(n_threads)
    items = named_arrays("grads", grads)
    for label, g in items:
        if g.dtype not in _FLOATS:
            raise TypeError(f"clip_grad_norm: {label}: expected float32 or float64, got {g.dtype}")
    flat = [np.ascontiguousarray(g).reshape(-1) for _, g in items]
    ss = sum(_adamw.sumsq_array(f, 1.0, n_threads) for f in flat)
    if math.isinf(ss) and not any(_adamw.count_nonfinite_array(f, n_threads) for f in flat):
        # finite float64 gradients whose squares overflow: scale by max |g| first
        amax = max(float(np.max(np.abs(f))) for f in flat if f.size)
        norm = amax * math.sqrt(sum(_adamw.sumsq_array(f, 1.0 / amax, n_threads) for f in flat))
    else:
        norm = math.sqrt(ss)
    if not math.isfinite(norm) or not norm > max_norm:
        return norm
    for label, g in items:
        if not g.flags.writeable:
            raise ValueError(f"clip_grad_norm: {label}: array is read-only; clipping works in place")
    coef = max_norm / (norm + 1e-6)
    for _, g in items:
        np.multiply(g, g.dtype.type(coef), out=g)
    return norm
