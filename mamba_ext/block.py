"""Public CPU API of one Mamba-1 block: forward, backward, default initialisation.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
P = R + 2N, M = B*L, T = SCAN_CHUNK (64), nC = ceil(L / T).

    out, cache = mamba1_forward(x, params)             # x (B, L, Dm)
    dx, grads = mamba1_backward(dout, params, cache)   # grads: dict of the 13 names

State passing (a long sequence in chunks; same outputs and gradients as one piece):

    out, cache, (h, tail) = mamba1_forward(x0, params, return_state=True)
    out1, cache1, state1 = mamba1_forward(x1, params, h0=h, conv_state=tail,
                                          return_state=True)
    dx1, g1 = mamba1_backward(dout1, params, cache1)    # g1["h0"], g1["conv_state"]
    dx0, g0 = mamba1_backward(dout0, params, cache, dh_last=g1["h0"],
                              dconv_tail=g1["conv_state"])

The maths is that of ``docs/semantics.md``; the kernels are the Cython
modules ``mamba_ext.cpu.block`` (composition), ``cpu.linear``, ``cpu.rmsnorm``,
``cpu.conv1d``, ``cpu.activations`` and ``cpu.scan``. The forward cache holds
O(B*L*(Dm + D)) values plus the scan state at chunk boundaries (see
:class:`BlockCache`), never a (B, L, D, N) tensor.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._validate import (
    BLOCK_PARAM_NAMES,
    DISCRETIZATIONS,
    FLOAT_DTYPES,
    BlockDims,
    block_param_shapes,
    check_block_params,
    check_count,
    check_memory,
    check_discretization,
    check_eps,
    check_n_threads,
    check_state,
    check_size,
    check_x,
)
from .constants import DEFAULT_EPS
from .cpu import block as _block

__all__ = ["mamba1_forward", "mamba1_backward", "init_mamba1_params", "BlockCache", "INIT_SCHEMES",
           "inverse_softplus"]


def fingerprint(arrays: Mapping[str, np.ndarray]) -> tuple:
    """Identity of the parameter values: per array, a 64-bit hash of all its bytes in
    order (csrc/mx_hash.h, four-lane xxHash-style rounds at memory speed: ~0.3 ms for the
    16 MB of size-c params, under 0.5% of a step). Any edited value, and any swap of two
    values, changes it. (The 13 parameters are C-contiguous here.)"""
    return tuple(_block.hash_bytes(np.ascontiguousarray(arrays[n])) for n in BLOCK_PARAM_NAMES)


class BlockCache:
    """What :func:`mamba1_forward` saves for :func:`mamba1_backward`.

    ``buffer`` is one 1-D array of the forward's dtype holding, in order
    (M = B*L, P = R + 2N, C = ceil(L / SCAN_CHUNK), SCAN_CHUNK = 64):

    ======== ================ ============================================
    x        (M, Dm)          block input
    rstd     (M,)             RMSNorm 1/sqrt(mean(x^2) + eps)
    xz       (M, 2D)          in_proj output [xc | z]
    xproj    (M, P)           x_proj output [dt_low | Bs | Cs]
    delta    (M, D)           softplus(delta_pre), delta_pre = dt_proj output
    y        (M, D)           scan output incl. D_vec skip, before the gate
    hstate   (B, C, D, N)     scan state entering each chunk of SCAN_CHUNK steps
    ======== ================ ============================================

    ``nbytes = itemsize * (M * (Dm + 1 + 4*D + P) + B * ceil(L/64) * D * N)``,
    e.g. 30.4 MB for float32, Dm 768, D 1536, N 16, R 48, B 1, L 1024. The
    backward recomputes everything else (the scan states inside each chunk
    included) and needs about ``itemsize * M * (7D + P + 2R + 2Dm)`` bytes of
    scratch, which each calling thread keeps for its next call (see _block.pyx).

    The cache also records the sizes, dtype, ``x`` shape, eps, discretization
    and a fingerprint of every value of every parameter (``fingerprint``), so that
    using it with other parameters, other shapes or a ``dout`` of another shape raises
    ValueError. No attribute can be assigned (private ones included), ``buffer`` and
    ``conv_state`` are read-only and cannot be made writeable (their memory belongs to
    an object without a buffer interface), and the backward re-validates the cache's
    state before any kernel reads it (a cache edited by circumventing all that is
    refused, never read out of bounds). Writing into the buffer's memory by other
    means (ctypes) voids the gradients, as editing the parameters would.

    With state passing, ``has_h0`` records whether the forward got ``h0`` (it is the
    hstate of chunk 0, kept in ``buffer``) and ``conv_state`` holds a copy of the
    forward's ``conv_state`` (B, D, K-1) or None; the backward then also returns
    their gradients.
    """

    __slots__ = ("_buffer", "_dims", "_dtype", "_x_shape", "_eps", "_discretization", "_fingerprint",
                 "_has_h0", "_conv_state")

    def __init__(self, buffer: np.ndarray, dims: BlockDims, dtype: DTypeLike, x_shape: tuple,
                 eps: float, discretization: str, fingerprint: tuple, has_h0: bool = False,
                 conv_state: np.ndarray | None = None) -> None:
        init = super().__setattr__
        init("_buffer", buffer)
        init("_dims", dims)
        init("_dtype", np.dtype(dtype))
        init("_x_shape", tuple(x_shape))
        init("_eps", float(eps))
        init("_discretization", discretization)
        init("_fingerprint", fingerprint)
        init("_has_h0", bool(has_h0))
        if conv_state is not None and conv_state.flags.writeable:
            conv_state = conv_state.copy()
            conv_state.flags.writeable = False
        init("_conv_state", conv_state)

    def __setattr__(self, name, value):
        raise AttributeError(f"BlockCache is read-only: {name!r} cannot be set (run "
                             f"mamba1_forward again for another cache)")

    buffer = property(lambda self: _readonly(self._buffer), doc="The cache values (read-only view).")
    dims = property(lambda self: self._dims, doc="BlockDims of the forward.")
    dtype = property(lambda self: self._dtype, doc="dtype of x and of the cache.")
    x_shape = property(lambda self: self._x_shape, doc="(B, L, Dm) of the forward's x.")
    eps = property(lambda self: self._eps, doc="The forward's RMSNorm eps.")
    discretization = property(lambda self: self._discretization, doc='"zoh" or "euler".')
    fingerprint = property(lambda self: self._fingerprint, doc="Fingerprint of the forward's params.")
    has_h0 = property(lambda self: self._has_h0, doc="Whether the forward got h0.")
    conv_state = property(lambda self: self._conv_state, doc="The forward's conv_state (read-only) or None.")

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffer (formula in the class docstring)."""
        return int(self._buffer.nbytes)

    def _checked(self) -> tuple:
        """The state the backward needs, re-validated (the private slots can still be
        reassigned from Python): ``(buffer, sizes, discretization code)``."""
        d, shape = self._dims, self._x_shape
        ok = (isinstance(d, BlockDims) and all(type(v) is int and v >= 1 for v in d)
              and isinstance(shape, tuple) and len(shape) == 3
              and all(type(v) is int and v >= 0 for v in shape) and shape[2] == d.Dm
              and self._dtype in FLOAT_DTYPES and self._discretization in DISCRETIZATIONS
              and isinstance(self._has_h0, bool))
        if ok:
            sizes = _sizes(shape, d)
            try:
                _check_work_size(sizes)
            except ValueError:
                ok = False
        buf = self._buffer
        if ok:
            ok = (isinstance(buf, np.ndarray) and buf.dtype == self._dtype and buf.ndim == 1
                  and buf.flags.c_contiguous and buf.size == _block.cache_len(sizes))
        cs = self._conv_state
        if ok and cs is not None:
            ok = (isinstance(cs, np.ndarray) and cs.dtype == self._dtype and cs.flags.c_contiguous
                  and cs.shape == (shape[0], d.D, d.K - 1))
        if not ok:
            raise ValueError("cache: its state was edited after mamba1_forward made it (sizes, "
                             "buffer or conv_state no longer agree); run the forward again")
        return buf, sizes, DISCRETIZATIONS[self._discretization]

    def __repr__(self) -> str:
        return (f"BlockCache(x_shape={self.x_shape}, dtype={self.dtype.name}, dims={self.dims}, "
                f"discretization={self.discretization!r}, nbytes={self.nbytes})")


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _sizes(x_shape, dims) -> tuple:
    B, L, _ = x_shape
    return (int(B), int(L), dims.Dm, dims.D, dims.N, dims.K, dims.R)


def cache_elements(sizes: tuple) -> int:
    """Elements of the forward cache (the layout of block.pyx, see BlockCache) for sizes
    (B, L, Dm, D, N, K, R), in Python integers, which cannot wrap around."""
    B, L, Dm, D, N, K, R = sizes
    M, P = B * L, R + 2 * N
    C = -(-L // _block.SCAN_CHUNK)
    return M * (Dm + 1 + 4 * D + P) + B * C * D * N


def _check_work_size(sizes) -> None:
    """Refuse sizes whose cache or backward scratch element counts overflow."""
    B, L, Dm, D, N, K, R = sizes
    M, P = B * L, R + 2 * N
    check_count("cache", (cache_elements(sizes),))
    check_count("backward scratch", (M * (7 * D + P + 2 * R + 2 * Dm),))
    # the cache and the block's input and output (the scratch is bounded by a window)
    check_memory("mamba1_forward: the cache, x and out", 4 * (cache_elements(sizes) + 2 * M * Dm))


def mamba1_forward(x: ArrayLike, params: Mapping[str, ArrayLike], *, h0: ArrayLike | None = None,
                   conv_state: ArrayLike | None = None, return_state: bool = False,
                   eps: float = DEFAULT_EPS, discretization: str = "zoh",
                   n_threads: int | None = None) -> tuple[Any, ...]:
    """Forward pass of one Mamba-1 block.

    Parameters
    ----------
    x : array-like (B, L, Dm), float32 or float64
        Block input. B or L may be 0 (empty result).
    params : mapping of the 13 names of ``BLOCK_PARAM_NAMES`` to arrays of the
        golden shapes, all of the dtype of ``x``; sizes are inferred from them.
    eps : float
        RMSNorm epsilon (inside the square root), a finite number > 0; default
        ``mamba_ext.constants.DEFAULT_EPS`` (1e-6).
    discretization : "zoh" (exact zero-order hold, default) or "euler" (b_bar = Delta*B).
    n_threads : None (OpenMP default) or an int in [1, min(1024, max(64, 8 x cores))],
        threads of every kernel, the BLAS products included (docs/api.md, Threads).
    h0 : None or array (B, D, N) of x's dtype
        Scan state before step 0 (default zeros), e.g. the ``h_last`` of the previous chunk.
    conv_state : None or array (B, D, K-1) of x's dtype
        The conv's history: the in_proj x-half (xc, before the conv) of the K-1 steps
        before ``x``, oldest first (``recurrent.RecurrentState.conv``'s layout); default
        zeros.
    return_state : bool
        Also return ``(h_last, conv_tail)``: the scan state after the last step (B, D, N)
        and xc of the last K-1 steps (B, D, K-1), oldest first, taken from ``conv_state``
        where L < K-1; pass them as ``h0`` / ``conv_state`` of the next chunk.

    Returns
    -------
    out : ndarray, shape and dtype of ``x``
    cache : BlockCache for :func:`mamba1_backward`
    state : ``(h_last, conv_tail)``, only with ``return_state=True``
    """
    x = check_x("x", x, _params_dtype(params), contiguous=False)
    arrays, dims = check_block_params(params, dtype=x.dtype, d_model=x.shape[2])
    disc = check_discretization(discretization)
    nt = check_n_threads(n_threads)
    eps = check_eps(eps)
    sizes = _sizes(x.shape, dims)
    _check_work_size(sizes)
    B, L = sizes[:2]
    h_shape, c_shape = (B, dims.D, dims.N), (B, dims.D, dims.K - 1)
    if h0 is not None:
        h0 = check_state("h0", h0, x.dtype, h_shape, "(batch, dInner, dState)")
    if conv_state is not None:
        conv_state = check_state("conv_state", conv_state, x.dtype, c_shape,
                                  "(batch, dInner, dConv-1)")
        conv_state = _block.sealed(conv_state)       # a copy kept for the backward
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    # sealed: read-only, and no view or base of it can be made writeable again
    buffer = _block.sealed_empty(_block.cache_len(sizes), x.dtype)
    h_last = conv_tail = None
    if return_state:
        h_last = np.zeros(h_shape, x.dtype) if h0 is None else h0.copy()
        conv_tail = np.zeros(c_shape, x.dtype) if conv_state is None else conv_state.copy()
    if x.size:
        _block.forward(x, [arrays[n] for n in BLOCK_PARAM_NAMES], out, buffer, sizes,
                       eps, disc, nt, h0=h0, conv_state=conv_state, h_last=h_last,
                       conv_tail=conv_tail)
    cache = BlockCache(buffer, dims, x.dtype, x.shape, eps, discretization, fingerprint(arrays),
                       has_h0=h0 is not None, conv_state=conv_state)
    if return_state:
        return out, cache, (h_last, conv_tail)
    return out, cache


def _params_dtype(params):
    """dtype that x must match: that of params['wInProj'] when it is a float ndarray."""
    try:
        w = params["wInProj"]
    except Exception:
        return None
    if isinstance(w, np.ndarray) and w.dtype in FLOAT_DTYPES:
        return w.dtype
    return None


def mamba1_backward(dout: ArrayLike, params: Mapping[str, ArrayLike], cache: BlockCache, *,
                    dh_last: ArrayLike | None = None, dconv_tail: ArrayLike | None = None,
                    n_threads: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Backward pass (vector-Jacobian product) of one Mamba-1 block.

    ``dout`` (B, L, Dm) is dLoss/d``out`` of the forward that made ``cache``; ``params``
    must be the same values the forward used. Returns ``(dx, grads)``: ``dx`` of the
    shape of ``x``, ``grads`` a dict with the 13 names, shapes and dtype of ``params``.
    dLoss/dA_log is exactly 0 where A_log <= A_LOG_MIN or A_log >= A_LOG_MAX (the clamp,
    ``mamba_ext.constants``: -10 and 5).

    State passing: ``dh_last`` (B, D, N) and ``dconv_tail`` (B, D, K-1) are dLoss/d of the
    state the forward returned with ``return_state=True`` (default zeros; e.g. the
    ``grads["h0"]`` / ``grads["conv_state"]`` of the next chunk's backward). ``grads``
    also holds ``"h0"`` (B, D, N) when the forward got ``h0``, and ``"conv_state"``
    (B, D, K-1) when it got ``conv_state`` (only those given).
    """
    if not isinstance(cache, BlockCache):
        raise TypeError(f"cache: expected the BlockCache returned by mamba1_forward, "
                        f"got {type(cache).__name__}")
    cache_buffer, _, disc = cache._checked()
    dout = check_x("dout", dout, cache.dtype, contiguous=False)
    if dout.shape != cache.x_shape:
        raise ValueError(f"dout: expected shape {cache.x_shape} (the shape of x in the forward), "
                         f"got {dout.shape}")
    dout = np.ascontiguousarray(dout)
    arrays, dims = check_block_params(params, dtype=cache.dtype, d_model=cache.x_shape[2])
    if dims != cache.dims:
        raise ValueError(f"params: sizes {dims} differ from those of the forward that made "
                         f"the cache {cache.dims}")
    if fingerprint(arrays) != cache.fingerprint:
        changed = [n for n, a, b in zip(BLOCK_PARAM_NAMES, fingerprint(arrays), cache.fingerprint)
                   if a != b]
        raise ValueError(f"params: values of {changed} differ from those the forward used; "
                         f"the cache is only valid with the same params")
    nt = check_n_threads(n_threads)
    B, L = dout.shape[:2]
    h_shape, c_shape = (B, dims.D, dims.N), (B, dims.D, dims.K - 1)
    if dh_last is not None:
        dh_last = check_state("dh_last", dh_last, cache.dtype, h_shape, "(batch, dInner, dState)")
    if dconv_tail is not None:
        dconv_tail = check_state("dconv_tail", dconv_tail, cache.dtype, c_shape,
                                  "(batch, dInner, dConv-1)")
    dx = np.zeros_like(dout)
    grads = {n: np.zeros_like(arrays[n]) for n in BLOCK_PARAM_NAMES}
    dh0 = np.zeros(h_shape, cache.dtype) if cache.has_h0 else None
    dconv_state = np.zeros(c_shape, cache.dtype) if cache.conv_state is not None else None
    if dout.size:
        _block.backward(dx, [grads[n] for n in BLOCK_PARAM_NAMES], dout, cache_buffer,
                        [arrays[n] for n in BLOCK_PARAM_NAMES], _sizes(dout.shape, dims),
                        disc, nt, conv_state=cache.conv_state,
                        dh_last=dh_last, dconv_tail=dconv_tail, dh0=dh0,
                        dconv_state=dconv_state)
    elif L == 0:   # an empty chunk passes its state through unchanged
        if dh0 is not None and dh_last is not None:
            dh0 += dh_last
        if dconv_state is not None and dconv_tail is not None:
            dconv_state += dconv_tail
    if dh0 is not None:
        grads["h0"] = dh0
    if dconv_state is not None:
        grads["conv_state"] = dconv_state
    return dx, grads


INIT_SCHEMES = ("mamba", "legacy")
"""Names of the initialisation schemes of :func:`init_mamba1_params` / ``init_model_params``:
``"mamba"`` (the default, the reference implementations' rules) and ``"legacy"`` (the
scheme of mamba_ext <= 0.2, kept so old runs reproduce)."""

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
"""The ``"mamba"`` scheme draws the initial step size delta log-uniformly in [DT_MIN, DT_MAX]
per channel and clamps it below at DT_FLOOR (the reference's ``dt_min``, ``dt_max``,
``dt_init_floor``)."""


def inverse_softplus(delta: ArrayLike) -> np.ndarray:
    """``y`` with ``softplus(y) = log1p(exp(y)) = delta`` (delta > 0), in float64:
    ``y = delta + log(-expm1(-delta))`` (= log(exp(delta) - 1) without its cancellation
    for small delta)."""
    d = np.asarray(delta, dtype=np.float64)
    return d + np.log(-np.expm1(-d))


def check_init(init: str) -> str:
    """``init`` must be one of :data:`INIT_SCHEMES` (ValueError naming it otherwise)."""
    if not isinstance(init, str) or init not in INIT_SCHEMES:
        raise ValueError(f"init: expected one of {list(INIT_SCHEMES)}, got {init!r}")
    return init


def init_mamba1_params(d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                       dt_rank: int | None = None, seed: int = 0,
                       dtype: DTypeLike = np.float32, *, init: str = "mamba",
                       n_layers: int = 1) -> dict[str, np.ndarray]:
    """Fresh parameters of one Mamba-1 block (dict of the 13 ``BLOCK_PARAM_NAMES``).

    Sizes: dInner D = expand * d_model, dtRank R = ceil(d_model / 16) unless given.
    ``U(±b)`` is the uniform distribution on [-b, b].

    ``init="mamba"`` (default): the rules of the reference implementations (mamba_ssm's
    ``Mamba.__init__`` and the ``_init_weights`` of its language model; Hugging Face's
    ``MambaPreTrainedModel._init_weights`` uses the same dt and A rules):

    * ``normWeight = 1``; ``A_log[d, n] = log(n + 1)`` (A = -(n + 1), S4D-real);
      ``D_vec = 1``.
    * wInProj ~ U(±Dm^-0.5), wXProj ~ U(±D^-0.5) (PyTorch's ``nn.Linear`` default,
      ``kaiming_uniform(a=sqrt 5)``, which the reference keeps); bInProj = bXProj = 0.
    * wConv ~ U(±K^-0.5) and bConv ~ U(±K^-0.5) (``nn.Conv1d``'s default for a
      depthwise conv, fan-in K; transformers zeros bConv instead).
    * wDtProj ~ U(±R^-0.5) (``dt_init="random"``, ``dt_scale=1``); the step size starts
      at ``delta0 = max(exp(U(log DT_MIN, log DT_MAX)), DT_FLOOR)`` per channel, i.e.
      log-uniform in [1e-3, 1e-1], through ``bDtProj = inverse_softplus(delta0)``, so
      ``softplus(bDtProj) = delta0`` (exactly in float64; to float32 rounding of the bias).
    * wOutProj ~ U(±D^-0.5) / sqrt(n_layers) (the GPT-2 depth rescale of the residual
      branch, ``rescale_prenorm_residual`` with one residual per layer; ``n_layers`` is the
      depth of the model this block goes into); bOutProj = 0.

    ``init="legacy"``: the scheme of mamba_ext <= 0.2 (same values for the same seed):
    wInProj, wConv, wXProj, wOutProj ~ N(0, 0.02^2), ``wDtProj ~ U(±R^-0.5)``, every bias
    0 (bDtProj too, so delta starts at softplus(~0) ~ log 2), A_log and D_vec as above;
    ``n_layers`` is not used.

    ``seed`` seeds ``numpy.random.default_rng``; values are drawn in float64 and
    rounded to ``dtype`` (float32 or float64).
    """
    for name, v in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv),
                    ("expand", expand)):
        check_size(name, v)
    if dt_rank is None:
        dt_rank = -(-int(d_model) // 16)
    else:
        check_size("dt_rank", dt_rank)
    check_size("dInner = expand * d_model", int(expand) * int(d_model))
    check_init(init)
    n_layers = check_size("n_layers", n_layers)
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    dims = BlockDims(Dm=int(d_model), D=int(expand) * int(d_model), N=int(d_state),
                     K=int(d_conv), R=int(dt_rank))
    shapes = block_param_shapes(dims)
    for n, s in shapes.items():
        check_count(n, s)
    rng = np.random.default_rng(seed)
    p = {n: np.zeros(s) for n, s in shapes.items()}
    if init == "legacy":
        for n in ("wInProj", "wConv", "wXProj", "wOutProj"):
            p[n] = rng.normal(0.0, 0.02, shapes[n])
        bound = dims.R ** -0.5
        p["wDtProj"] = rng.uniform(-bound, bound, shapes["wDtProj"])
    else:
        def uniform(name, fan_in):
            b = fan_in ** -0.5
            return rng.uniform(-b, b, shapes[name])
        p["wInProj"] = uniform("wInProj", dims.Dm)
        p["wConv"] = uniform("wConv", dims.K)
        p["bConv"] = uniform("bConv", dims.K)
        p["wXProj"] = uniform("wXProj", dims.D)
        p["wDtProj"] = uniform("wDtProj", dims.R)
        lo, hi = np.log(DT_MIN), np.log(DT_MAX)
        delta0 = np.maximum(np.exp(rng.uniform(lo, hi, dims.D)), DT_FLOOR)   # (D,)
        p["bDtProj"] = inverse_softplus(delta0)
        p["wOutProj"] = uniform("wOutProj", dims.D) / np.sqrt(n_layers)
    p["A_log"] = np.broadcast_to(np.log(np.arange(1, dims.N + 1, dtype=np.float64)),
                                 shapes["A_log"]).copy()
    p["D_vec"] = np.ones(dims.D)
    p["normWeight"] = np.ones(dims.Dm)
    return {n: np.ascontiguousarray(p[n], dtype=dtype) for n in BLOCK_PARAM_NAMES}
