"""Mixed precision in the fp16 style, simulated over NumPy (Python; the rounding of float32
arrays to float16 values runs compiled, mamba_ext.cpu.half, with NumPy's bits).

The model keeps float32 *master* weights. One AMP training step:

1. ``w16 = fp16_view(params)``: the weights rounded to float16 values (kept in
   float32 arrays, so the float32 kernels run on them unchanged);
2. forward/backward on ``w16`` with the loss multiplied by ``scaler.scale``
   (the model multiplies its output gradient seed, dlogits, by it);
3. ``round_fp16(g, out=g)`` for every gradient: what an fp16 backward would
   hold (small values flush to zero, values past 65504 become inf);
4. ``scaler.unscale(grads)`` (float32) and ``overflow = scaler.check(grads)``;
5. ``if scaler.update(overflow): optimizer.step(grads)``; on overflow the step
   is skipped and the optimizer (weights, moments, step count) is untouched.

Rounding: ``round_fp16`` rounds to the nearest float16 with ties to even
(IEEE 754 default, NumPy's ``astype(float16)``, exact from float32 and from
float64 alike — no double rounding). The reference implementation this
package follows *truncates* the mantissa instead (round toward zero), so
values can differ from it by one fp16 ulp; round-to-nearest-even has half
the error and no bias.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._validate import HALF_AND_FLOAT_DTYPES, named_arrays, state_scalar

__all__ = ["round_fp16", "fp16_view", "DynamicLossScaler"]



def round_fp16(a: ArrayLike, out: np.ndarray | None = None) -> np.ndarray:
    """Round ``a`` to float16 values (nearest, ties to even), returned as float32.

    ``a``: float16/float32/float64 array. Magnitudes >= 65520 become +-inf
    (IEEE overflow), magnitudes below 2**-25 become +-0, NaN stays NaN.
    ``out``: optional float32 array of ``a``'s shape written in place (it may
    be ``a`` itself: ``round_fp16(g, out=g)``); returned.
    """
    arr = np.asarray(a)
    if arr.dtype not in HALF_AND_FLOAT_DTYPES:
        raise TypeError(f"round_fp16: a: expected a float16/float32/float64 array, got dtype {arr.dtype}")
    if out is not None:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError(f"round_fp16: out: expected a float32 numpy array, got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        if out.shape != arr.shape:
            raise ValueError(f"round_fp16: out: expected shape {arr.shape}, got {out.shape}")
    if arr.dtype == np.float32 and arr.flags.c_contiguous and (
            out is None or out.flags.c_contiguous and out.flags.writeable):
        # the compiled loop (NumPy's bits; its float16 casts go one element at a time), on
        # the calling thread (a caller's thread budget, e.g. a rank's, is not ours to widen)
        from .cpu.half import round_fp16_array
        dst = np.empty(arr.shape, np.float32) if out is None else out
        round_fp16_array(arr.reshape(-1), dst.reshape(-1), n_threads=1)
        return dst
    with np.errstate(over="ignore"):       # overflow to inf is the intended IEEE result
        half = arr.astype(np.float16)
    if out is None:
        return half.astype(np.float32)
    np.copyto(out, half)                   # float16 -> float32 is exact
    return out


def fp16_view(params: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    """Dict of fp16-rounded float32 copies of ``params`` (the weights the AMP
    forward/backward runs on); the master arrays are not modified."""
    if not isinstance(params, Mapping):
        raise TypeError(f"fp16_view: params: expected a mapping name -> array, got {type(params).__name__}")
    out = {}
    for name, value in params.items():
        arr = np.asarray(value)
        if arr.dtype not in HALF_AND_FLOAT_DTYPES:
            raise TypeError(f"fp16_view: params[{name!r}]: expected a float array, got dtype {arr.dtype}")
        out[name] = round_fp16(arr)
    return out


def _f32(x: float) -> float:
    """x rounded to float32, as a Python float (the scale lives in float32)."""
    return float(np.float32(x))


class DynamicLossScaler:
    """Dynamic loss scaling with the update rule of ``torch.amp.GradScaler``.

    Per step, ``update(overflow)``:
      * overflow: ``scale *= backoff_factor``, growth tracker reset to 0;
      * otherwise the tracker counts up; when it reaches ``growth_interval``,
        ``scale *= growth_factor`` (only if the result is finite) and the
        tracker resets.
    Products are rounded to float32 as GradScaler's float32 scale tensor does,
    so for the same overflow sequence the trajectory equals GradScaler's
    exactly. Then the scale is clamped to ``[min_scale, max_scale]``
    (GradScaler has no bounds: trajectories are equal until a bound is hit;
    the clamp does not touch the growth tracker).

    Attributes: ``scale`` (float), ``growth_tracker``, ``overflows`` (updates
    that saw an overflow) and ``skipped`` (optimizer steps skipped). Every
    overflow skips its step, so the two counts are equal; ``overflows`` is the
    scaler's event count, ``skipped`` the training loop's.
    """

    def __init__(self, init_scale: float = 2.0 ** 14, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 200, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24) -> None:
        self._set_config(init_scale, growth_factor, backoff_factor, growth_interval,
                         min_scale, max_scale)
        self.growth_tracker = 0
        self.overflows = 0
        self.skipped = 0

    def _set_config(self, scale, growth_factor, backoff_factor, growth_interval,
                    min_scale, max_scale):
        def num(name, v):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"DynamicLossScaler: {name}: expected a number, got {v!r}")
            if math.isnan(v):
                raise ValueError(f"DynamicLossScaler: {name}: got NaN")
            return float(v)
        scale, growth_factor, backoff_factor, min_scale, max_scale = (
            num(n, v) for n, v in (("init_scale", scale), ("growth_factor", growth_factor),
                                   ("backoff_factor", backoff_factor), ("min_scale", min_scale),
                                   ("max_scale", max_scale)))
        if not (isinstance(growth_interval, numbers.Integral) and not isinstance(growth_interval, bool)
                and growth_interval >= 1):
            raise ValueError(f"DynamicLossScaler: growth_interval: expected an integer >= 1, "
                             f"got {growth_interval!r}")
        if not growth_factor > 1.0 or math.isinf(growth_factor):
            raise ValueError(f"DynamicLossScaler: growth_factor: expected a finite value > 1, "
                             f"got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor: expected a value in (0, 1), "
                             f"got {backoff_factor}")
        min_scale, max_scale = _f32(min_scale), _f32(max_scale)
        if not 0.0 < min_scale <= max_scale:
            raise ValueError(f"DynamicLossScaler: expected 0 < min_scale <= max_scale, got "
                             f"min_scale={min_scale}, max_scale={max_scale}")
        scale = _f32(scale)
        if not min_scale <= scale <= max_scale or math.isinf(scale):
            raise ValueError(f"DynamicLossScaler: init_scale: expected a finite value in "
                             f"[min_scale, max_scale] = [{min_scale}, {max_scale}], got {scale}")
        self.scale = scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = int(growth_interval)
        self.min_scale = min_scale
        self.max_scale = max_scale

    def check(self, grads: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> bool:
        """True if any gradient holds a NaN or +-Inf (a mapping or a sequence of arrays)."""
        return any(not np.isfinite(g).all() for _, g in named_arrays("grads", grads))

    def unscale(self, grads: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> None:
        """Multiply every gradient in place by 1/scale (float64 reciprocal
        rounded to the gradient's dtype, as GradScaler does for float32)."""
        items = named_arrays("grads", grads)
        for label, g in items:
            if not g.flags.writeable:
                raise ValueError(f"{label}: array is read-only; unscale works in place")
        inv = 1.0 / self.scale
        for _, g in items:
            np.multiply(g, g.dtype.type(inv), out=g)

    def update(self, overflow: bool) -> bool:
        """Advance the scale for one step; returns True if the step should be
        applied (no overflow), False if it must be skipped."""
        if not isinstance(overflow, (bool, np.bool_)):
            raise TypeError(f"DynamicLossScaler.update: overflow: expected a bool, "
                            f"got {type(overflow).__name__}")
        if overflow:
            self.scale = _f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            self.overflows += 1
            self.skipped += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = _f32(self.scale * self.growth_factor)
                if math.isfinite(grown):
                    self.scale = grown
                self.growth_tracker = 0
        self.scale = min(max(self.scale, self.min_scale), self.max_scale)
        return not overflow

    def state_dict(self) -> dict[str, float | int]:
        """Plain dict of Python scalars (settings and progress)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "min_scale": self.min_scale, "max_scale": self.max_scale,
                "growth_tracker": self.growth_tracker, "overflows": self.overflows,
                "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from :meth:`state_dict` (scalars may be 1-element arrays).
        Everything is validated before anything changes."""
        if not isinstance(state, Mapping):
            raise TypeError(f"DynamicLossScaler.load_state_dict: expected a mapping, "
                            f"got {type(state).__name__}")
        known = set(self.state_dict())
        unknown = sorted(str(k) for k in state if k not in known)
        if unknown:
            raise ValueError(f"DynamicLossScaler.load_state_dict: unknown key(s) {unknown}")
        counts = {k: state_scalar(state, k, integral=True)
                  for k in ("growth_interval", "growth_tracker", "overflows", "skipped")}
        for k, v in counts.items():
            if v < 0:
                raise ValueError(f"DynamicLossScaler.load_state_dict: {k!r} must be >= 0, got {v}")
        if counts["growth_tracker"] >= max(counts["growth_interval"], 1):
            raise ValueError(f"DynamicLossScaler.load_state_dict: growth_tracker {counts['growth_tracker']} "
                             f"must be < growth_interval {counts['growth_interval']}")
        probe = DynamicLossScaler.__new__(DynamicLossScaler)
        probe._set_config(*(state_scalar(state, k) for k in ("scale", "growth_factor", "backoff_factor")),
                          counts["growth_interval"],
                          *(state_scalar(state, k) for k in ("min_scale", "max_scale")))
        self.__dict__.update(probe.__dict__)
        self.growth_tracker = counts["growth_tracker"]
        self.overflows = counts["overflows"]
        self.skipped = counts["skipped"]

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, "
                f"overflows={self.overflows}, skipped={self.skipped})")
