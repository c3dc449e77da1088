"""Input validation shared by the CPU API, the model API and the GPU executor.

Every public entry point turns user input into C-contiguous arrays of one float
dtype and checks every shape here, so the compiled kernels never see a bad
pointer or size. Errors name the parameter, the expected and the actual value.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv,
R dtRank, P = R + 2N.
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

# The public contract: names and order of docs/semantics.md.
BLOCK_PARAM_NAMES = (
    "wInProj", "bInProj", "wConv", "bConv", "wXProj", "bXProj",
    "wDtProj", "bDtProj", "A_log", "D_vec", "wOutProj", "bOutProj", "normWeight",
)

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Largest element count any buffer may have: the kernels index with a signed
# 64-bit Py_ssize_t and allocate bytes, so stay well inside both.
_MAX_ELEMENTS = np.iinfo(np.intp).max // 16
# Largest single size (dModel, dInner, ...): BLAS takes 32-bit int dimensions.
_MAX_DIM = 2 ** 31 - 1
MAX_DIM = _MAX_DIM
MAX_ELEMENTS = _MAX_ELEMENTS

# Most threads a kernel may be asked for: far more than any machine runs usefully, far
# fewer than those that make libgomp fail to create its team (1000 ended the process,
# 65536 segfaulted). Oversubscription beyond 8 threads per core only costs.
MAX_THREADS_CAP = 1024


@functools.lru_cache(maxsize=None)
def max_threads() -> int:
    """Largest accepted ``n_threads``: min(1024, max(64, 8 * os.cpu_count())) (read once:
    os.cpu_count() costs ~15 us, and every kernel call checks its n_threads)."""
    import os
    return min(MAX_THREADS_CAP, max(64, 8 * (os.cpu_count() or 1)))


def check_n_threads(n_threads: Any) -> int:
    """None -> 0 (OpenMP's default team); otherwise an integer in [1, max_threads()]."""
    if n_threads is None:
        return 0
    limit = max_threads()
    if isinstance(n_threads, (bool, np.bool_)) or not isinstance(n_threads, (int, np.integer)):
        raise TypeError(f"n_threads: expected None or an integer in [1, {limit}], "
                        f"got {type(n_threads).__name__} {n_threads!r}")
    if not 1 <= n_threads <= limit:
        raise ValueError(f"n_threads: expected None or an integer in [1, {limit}] (the limit is "
                         f"min({MAX_THREADS_CAP}, max(64, 8 x {__import__('os').cpu_count()} cores))), "
                         f"got {n_threads}")
    return int(n_threads)


def check_size(name: str, value: Any, lo: int = 1, hi: int = _MAX_DIM) -> int:
    """A size-like integer argument (batch, a length, a model size) in ``[lo, hi]``.

    ``bool``, floats and non-numbers raise TypeError; an integer outside the range raises
    ValueError naming the limit. Returns a Python int.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an integer in [{lo}, {hi}], got {value}")
    return int(value)


class BlockDims(NamedTuple):
    """Sizes of one Mamba-1 block, all inferred from parameter shapes."""
    Dm: int   # dModel
    D: int    # dInner
    N: int    # dState
    K: int    # dConv
    R: int    # dtRank

    @property
    def P(self) -> int:
        return self.R + 2 * self.N


def block_param_shapes(d: BlockDims) -> dict[str, tuple[int, ...]]:
    """The shape of every block parameter, keyed by name (golden layout)."""
    return {
        "wInProj": (2 * d.D, d.Dm), "bInProj": (2 * d.D,),
        "wConv": (d.D, d.K), "bConv": (d.D,),
        "wXProj": (d.P, d.D), "bXProj": (d.P,),
        "wDtProj": (d.D, d.R), "bDtProj": (d.D,),
        "A_log": (d.D, d.N), "D_vec": (d.D,),
        "wOutProj": (d.Dm, d.D), "bOutProj": (d.Dm,),
        "normWeight": (d.Dm,),
    }


# the number of dimensions of each block parameter
_BLOCK_PARAM_RANKS = {n: len(s) for n, s in block_param_shapes(BlockDims(1, 1, 1, 1, 1)).items()}


def check_count(name: str, shape: Sequence[int]) -> None:
    """Refuse shapes whose element count would overflow the kernels' indexing."""
    n = 1
    for s in shape:
        n *= int(s)
    if n > _MAX_ELEMENTS:
        raise ValueError(f"{name}: shape {tuple(shape)} has {n} elements, more than the "
                         f"{_MAX_ELEMENTS} that mamba_ext can index")


def memory_limit() -> int | None:
    """Bytes this process may allocate at most: the machine's physical memory, or the
    address-space limit (RLIMIT_AS) when that is lower; None where neither is known."""
    import os
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_memory(name: str, nbytes: int) -> None:
    """Refuse, before allocating, work whose arrays alone need more bytes than this
    process may ever have (:func:`memory_limit`): a clear ValueError instead of a
    MemoryError (or the system's out-of-memory killer) partway through."""
    limit = memory_limit()
    if limit is not None and nbytes > limit:
        raise ValueError(f"{name}: needs {nbytes / 2 ** 30:,.2f} GiB, more than the "
                         f"{limit / 2 ** 30:,.2f} GiB this process may use (physical memory or "
                         f"its address-space limit); use a smaller batch or model")


def as_float_array(name: str, value: ArrayLike, dtype: DTypeLike | None = None,
                   contiguous: bool = True) -> np.ndarray:
    """Convert an array-like to a C-contiguous float32/float64 array.

    ``dtype`` None accepts float32 or float64 as given; otherwise the array must
    already have that dtype (mixing dtypes is a TypeError, never a silent cast).
    ``contiguous=False`` skips the final copy (the caller checks sizes first).
    """
    if isinstance(value, np.ndarray):
        arr = value
        if (arr.dtype in FLOAT_DTYPES and (dtype is None or arr.dtype == dtype)
                and arr.flags.c_contiguous):
            # the common case (a parameter as the library made it): no conversion, no copy;
            # a C-contiguous array's element count is its memory, so within the limit
            return arr
    else:
        try:
            arr = np.asarray(value)
        except Exception as e:  # ragged lists and the like
            raise TypeError(f"{name}: cannot convert {type(value).__name__} to an array: {e}") from None
        if arr.dtype.kind in "iub" and dtype is not None:
            # Plain Python number lists become float64 arrays; accept them when
            # a dtype is required by converting (ints are exact in both floats).
            arr = arr.astype(dtype)
        elif arr.dtype.kind == "f" and arr.dtype not in FLOAT_DTYPES:
            arr = arr.astype(np.float64)
        elif arr.dtype == np.float64 and dtype is not None and not isinstance(value, np.generic):
            # A list of Python floats is float64 by default; follow the target dtype.
            arr = arr.astype(dtype)
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {arr.dtype} is not supported; expected float32 or float64")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {arr.dtype} does not match the other arrays' dtype "
                        f"{np.dtype(dtype)}; convert all inputs to one float dtype")
    check_count(name, arr.shape)   # before any copy: a broadcast view may be huge
    # np.asarray(order="C"), not ascontiguousarray: that makes a 0-d array 1-d, and the
    # shape checks would then report (1,) for a scalar given
    return np.asarray(arr, order="C") if contiguous else arr


def _shape_error(name, expected, actual, why=""):
    return ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(actual)}{why}")


def check_block_params(params: Mapping[str, ArrayLike], dtype: DTypeLike | None = None,
                       d_model: int | None = None,
                       prefix: str = "") -> tuple[dict[str, np.ndarray], BlockDims]:
    """Validate a mapping of the 13 block parameters.

    Returns ``(arrays, dims)``: ``arrays`` a dict name -> C-contiguous array of
    one dtype (``dtype`` or, if None, the dtype of ``wInProj``), ``dims`` the
    inferred :class:`BlockDims`. ``d_model`` (from ``x``) must match if given.
    ``prefix`` is prepended to names in messages (e.g. ``"layer1."``).
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping of the {len(BLOCK_PARAM_NAMES)} block "
                        f"parameter names to arrays, got {type(params).__name__}")
    missing = [prefix + n for n in BLOCK_PARAM_NAMES if n not in params]
    if missing:
        raise ValueError(f"params: missing parameter(s) {missing}")
    unknown = sorted(str(k) for k in params if k not in BLOCK_PARAM_NAMES)
    if unknown:
        raise ValueError(f"params: unknown parameter(s) {[prefix + u for u in unknown]}; "
                         f"expected exactly {list(BLOCK_PARAM_NAMES)}")
    if dtype is None:
        first = params["wInProj"]
        dtype = first.dtype if isinstance(first, np.ndarray) else None
        if dtype is None:
            dtype = as_float_array(prefix + "wInProj", first).dtype
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{prefix}wInProj: dtype {dtype} is not supported; expected float32 or float64")
    arrays = {n: as_float_array(prefix + n, params[n], dtype) for n in BLOCK_PARAM_NAMES}

    # Infer sizes from the matrices that define them, then check every shape.
    for n, a in arrays.items():
        if a.ndim != _BLOCK_PARAM_RANKS[n]:
            raise ValueError(f"{prefix}{n}: expected a {_BLOCK_PARAM_RANKS[n]}-D array, got shape {a.shape}")
    D, K = arrays["wConv"].shape
    N = arrays["A_log"].shape[1]
    R = arrays["wDtProj"].shape[1]
    Dm = arrays["wInProj"].shape[1]
    if d_model is not None and Dm != d_model:
        raise ValueError(f"{prefix}wInProj: expected shape {(2 * D, d_model)} (dModel = {d_model} "
                         f"from x), got {arrays['wInProj'].shape}")
    for name, size in (("dInner (wConv rows)", D), ("dConv (wConv columns)", K),
                       ("dState (A_log columns)", N), ("dtRank (wDtProj columns)", R),
                       ("dModel (wInProj columns)", Dm)):
        if size < 1:
            raise ValueError(f"params: {name} must be >= 1, got {size}")
        if size > _MAX_DIM:
            raise ValueError(f"params: {name} = {size} exceeds {_MAX_DIM}, the largest size "
                             f"the BLAS kernels accept")
    dims = BlockDims(Dm=Dm, D=D, N=N, K=K, R=R)
    for n, shape in block_param_shapes(dims).items():
        if arrays[n].shape != shape:
            raise _shape_error(prefix + n, shape, arrays[n].shape,
                               f" (dModel={Dm}, dInner={D}, dState={N}, dConv={K}, dtRank={R}, "
                               f"inferred from wInProj, wConv, A_log, wDtProj)")
    return arrays, dims


def check_x(name: str, x: ArrayLike, dtype: DTypeLike | None = None,
            contiguous: bool = True) -> np.ndarray:
    """Validate a (B, L, Dm) activation; empty B or L is allowed."""
    arr = as_float_array(name, x, dtype, contiguous)
    if arr.ndim != 3:
        raise ValueError(f"{name}: expected a 3-D array (batch, seqLen, dModel), got shape {arr.shape}")
    check_count(name, arr.shape)
    return arr


def check_tokens(name: str, tokens: ArrayLike, vocab_size: int | None = None,
                 shape: Sequence[int] | None = None) -> np.ndarray:
    """Validate integer token ids (B, L); out-of-range ids name the id and position."""
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array of token ids, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (batch, seqLen), got shape {arr.shape}")
    if shape is not None and arr.shape != tuple(shape):
        raise _shape_error(name, shape, arr.shape)
    check_count(name, arr.shape)
    if vocab_size is not None and arr.size:
        # checked in the given dtype (a uint64 id above 2^63 - 1 would wrap in int64)
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            pos = np.unravel_index(bad[0], arr.shape)
            raise ValueError(f"{name}: token id {int(arr[pos])} at position (batch {pos[0]}, "
                             f"time {pos[1]}) is out of range [0, {vocab_size})")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        pos = np.unravel_index(int(np.argmax(arr)), arr.shape)
        raise ValueError(f"{name}: token id {int(arr[pos])} at position (batch {pos[0]}, "
                         f"time {pos[1]}) does not fit a signed 64-bit integer")
    return np.ascontiguousarray(arr, dtype=np.int64)


# discretization keyword -> the kernels' int code (mamba_dims.discretization)
DISCRETIZATIONS = {"zoh": 0, "euler": 1}


def check_discretization(discretization: Any) -> int:
    """``"zoh"`` (exact zero-order hold) -> 0, ``"euler"`` (b_bar = Delta*B) -> 1."""
    if not isinstance(discretization, str) or discretization not in DISCRETIZATIONS:
        raise ValueError(f"discretization: expected one of {sorted(DISCRETIZATIONS)}, "
                         f"got {discretization!r}")
    return DISCRETIZATIONS[discretization]


def check_eps(eps: Any) -> float:
    """The one rule for an RMSNorm ``eps`` (block, model, recurrent, training, GPU).

    Accepts a finite real number > 0 (Python or NumPy int/float) and returns it as a
    float. ``bool``, ``str`` and other non-numbers raise TypeError; NaN, +-inf and
    values <= 0 raise ValueError. Both messages name ``eps``.
    """
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number > 0, got {type(eps).__name__} {eps!r}")
    value = float(eps)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")
    return value


# float16, float32 or float64: the dtypes mixed-precision helpers take
HALF_AND_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def named_arrays(what: str, arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray] | np.ndarray
                 ) -> list[tuple[str, np.ndarray]]:
    """(label, ndarray) pairs from a mapping or an iterable of float arrays."""
    if isinstance(arrays, Mapping):
        items = [(f"{what}[{k!r}]", v) for k, v in arrays.items()]
    elif isinstance(arrays, np.ndarray):
        items = [(what, arrays)]
    else:
        try:
            items = [(f"{what}[{i}]", v) for i, v in enumerate(arrays)]
        except TypeError:
            raise TypeError(f"{what}: expected a mapping or a sequence of arrays, got "
                            f"{type(arrays).__name__}") from None
    for label, v in items:
        if not isinstance(v, np.ndarray) or v.dtype not in HALF_AND_FLOAT_DTYPES:
            raise TypeError(f"{label}: expected a float numpy array, got "
                            f"{getattr(v, 'dtype', type(v).__name__)}")
    return items


def state_scalar(state: Mapping, key: str, integral: bool = False) -> int | float:
    """Read one scalar of a state dict: a Python number or a 1-element array
    (what a safetensors round trip gives back). Returns int or float."""
    if key not in state:
        raise ValueError(f"state dict: missing key {key!r}")
    value = state[key]
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise ValueError(f"state dict: {key!r}: expected a scalar, got an array of shape {value.shape}")
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"state dict: {key!r}: expected a number, got {type(value).__name__}")
    if integral:
        if not float(value).is_integer():
            raise ValueError(f"state dict: {key!r}: expected an integer, got {value!r}")
        return int(value)
    return float(value)


def check_state(name: str, value: ArrayLike, dtype: DTypeLike, shape: Sequence[int],
                letters: str) -> np.ndarray:
    """A state array (h0, conv_state, dh_last, dconv_tail): x's dtype, exactly ``shape``."""
    arr = as_float_array(name, value, dtype, contiguous=False)
    if arr.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} {letters}, got {arr.shape}")
    return np.ascontiguousarray(arr)
