"""Stateful (recurrent) inference: one token at a time, constant cost per token.

    state = init_state(params, batch, eps=DEFAULT_EPS, discretization="zoh")
    logits, state = step(token_ids, params, state)     # token_ids (B,) -> logits (B, V)
    out = generate(params, prompt, n_tokens, temperature=0.8, top_k=40, top_p=0.95, rng=rng)

After feeding tokens ``t_0 .. t_j`` one by one, ``logits`` equals row ``j`` of
``model_forward`` on the whole sequence (same eps, same discretization). Per layer the
state is the scan state ``h`` (B, D, N) and the conv tail (B, D, K-1): the in_proj x-half
of the last K-1 steps, oldest first (zeros = the zero history of the full forward). Each
step costs O(layers * B * (Dm*D + D*N + V*Dm)), independent of the position.

The step is compiled (``mamba_ext.cpu.recurrent.Stepper``: BLAS projections over the
batch, the conv/scan step in C, the state updated in place); :func:`generate` feeds a
prompt through the chunked block forward (``h0``/``conv_state`` in, ``h_last``/
``conv_tail`` out: the prefill), then steps. The float64 NumPy reference of the same maths
is ``mamba_ext.testing.reference`` (the tests compare against it at every position).

Maths per step (docs/semantics.md, one time step; row = one batch element):
RMSNorm -> in_proj -> causal conv over [tail, x] -> SiLU -> x_proj -> dt_proj + softplus ->
a_bar = exp(delta*A), b_bar = (a_bar-1)/A * B (zoh, via expm1) or delta*B (euler) ->
h = a_bar*h + b_bar*u -> y = C.h + D*u -> y*SiLU(z) -> out_proj + residual; final RMSNorm,
tied head. Everything runs in the params' dtype (float32 state for float32 params);
``weights_dtype="float16"`` stores the projection matrices and the embedding as float16
(converted once; float32 activations, state and accumulation), halving the bytes read
per token.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._validate import (
    BLOCK_PARAM_NAMES,
    MAX_ELEMENTS,
    check_count,
    check_discretization,
    check_eps,
    check_memory,
    check_n_threads,
    check_size,
    check_tokens,
)
from .constants import A_LOG_MAX, A_LOG_MIN, DEFAULT_EPS
from .cpu import block as _block
from .cpu.recurrent import HALF_ARRAYS, LAYER_ARRAYS, Stepper
from .model import check_model_params
from .testing import reference as ref

__all__ = ["RecurrentState", "init_state", "step", "generate", "sample_logits", "filter_logits", "STOPPED"]

# generate(..., stop=...): positions of a sequence after its stop sequence hold this
STOPPED = -1


class RecurrentState:
    """Per-layer scan state and conv tail of a batch of sequences, plus the model settings.

    ``h[i]`` (B, D, N), ``conv[i]`` (B, D, K-1) for layer ``i``; ``position`` counts the
    tokens consumed. ``eps`` and ``discretization`` are set at :func:`init_state`; assigning
    them is checked like the arguments of init_state, and the next step uses them.
    ``batch`` is fixed. An array of ``h`` or ``conv`` may be replaced (or edited in place)
    between steps: every step checks each one (a C-contiguous, aligned, writeable ndarray
    of the state's dtype and shape) and steps on the arrays the lists hold then.
    """

    def __init__(self, batch: int, eps: float, discretization: str) -> None:
        self._batch = batch
        self.eps = eps
        self.discretization = discretization
        self.h: list[np.ndarray] = []
        self.conv: list[np.ndarray] = []
        self.position = 0
        # (the caller's arrays, per-layer validated dicts, all arrays, prepared weights
        # per weights_dtype): see validated_layers
        self._seen = None
        self._stepper = None  # (key, compiled Stepper over these very h / conv arrays)

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def eps(self) -> float:
        return self._eps

    @eps.setter
    def eps(self, value) -> None:
        self._eps = check_eps(value)

    @property
    def discretization(self) -> str:
        return self._discretization

    @discretization.setter
    def discretization(self, value) -> None:
        check_discretization(value)
        self._discretization = value

    def copy(self) -> "RecurrentState":
        s = RecurrentState(self.batch, self.eps, self.discretization)
        s.h = [a.copy() for a in self.h]
        s.conv = [a.copy() for a in self.conv]
        s.position = self.position
        s._seen = self._seen
        return s


def _check_state_arrays(state: RecurrentState, layers: list, dtype) -> None:
    """Each array of ``state.h`` / ``state.conv`` as the compiled step reads and writes it
    through raw pointers: an ndarray of the params' dtype and the layer's shape,
    C-contiguous, aligned and writeable (checked before every step: a replaced or foreign
    array must not be read out of bounds, reinterpreted or written behind a read-only view)."""
    for name, arrays in (("h", state.h), ("conv", state.conv)):
        if not isinstance(arrays, list) or len(arrays) != len(layers):
            n = len(arrays) if hasattr(arrays, "__len__") else "?"
            raise ValueError(f"state.{name}: expected a list of {len(layers)} arrays (one per "
                             f"layer), got {type(arrays).__name__} of {n}")
        for i, (a, p) in enumerate(zip(arrays, layers)):
            D, K = p["wConv"].shape
            shape = (state.batch, D, p["A_log"].shape[1]) if name == "h" else (state.batch, D, K - 1)
            if not isinstance(a, np.ndarray):
                raise TypeError(f"state.{name}[{i}]: expected a numpy array, got {type(a).__name__}")
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(f"state.{name}[{i}]: expected shape {shape} and dtype {dtype}, "
                                 f"got {a.shape} {a.dtype}")
            if not (a.flags.c_contiguous and a.flags.aligned and a.flags.writeable):
                raise ValueError(f"state.{name}[{i}]: expected a C-contiguous, aligned, writeable "
                                 f"array (it is updated in place); pass np.ascontiguousarray(...) "
                                 f"or a copy")


def validated_layers(params: Mapping[str, ArrayLike], state: RecurrentState) -> tuple[list, dict]:
    """``(layers, arrays)`` for ``params``: a validated dict per layer and the whole dict.

    Validation runs once; later calls only check that the caller still passes the same
    array objects (in-place updates keep shapes and dtypes, so they stay valid).
    """
    seen = state._seen
    if seen is not None and len(params) == len(seen[0]) and all(
            params.get(k) is v for k, v in seen[0].items()):
        return seen[1], seen[2]
    arrays, mdims = check_model_params(params)
    n_layers, dims = mdims.n_layers, mdims.block
    dt = arrays["embedding"].dtype
    want = [((state.batch, dims.D, dims.N), (state.batch, dims.D, dims.K - 1))] * n_layers
    if state.h and [(h.shape, c.shape) for h, c in zip(state.h, state.conv)] != want \
            or any(h.dtype != dt for h in state.h):
        raise ValueError(f"state: built for {len(state.h)} layer(s) with h {state.h[0].shape} "
                         f"{state.h[0].dtype}, but params have {n_layers} layer(s) with {dims}, {dt}; "
                         f"call init_state with these params")
    layers = [{k[len(f"layer{i}."):]: v for k, v in arrays.items() if k.startswith(f"layer{i}.")}
              for i in range(n_layers)]
    # hold the caller's objects, so the identity test above cannot be fooled by id reuse
    state._seen = (dict(params), layers, arrays, {})
    state._stepper = None
    return layers, arrays


def _check_weights_dtype(weights_dtype, dtype: np.dtype) -> bool:
    """True for float16 weight storage; False for the params' own dtype (None or its name)."""
    if weights_dtype is None:
        return False
    try:
        wd = np.dtype(weights_dtype)
    except TypeError:
        wd = None
    if wd == np.float16:
        if dtype != np.float32:
            raise ValueError(f"weights_dtype: float16 weights need float32 params, got {dtype}")
        return True
    if wd == dtype:
        return False
    raise ValueError(f"weights_dtype: expected None, 'float16' or the params' dtype {dtype}, "
                     f"got {weights_dtype!r}")


def _prepared(layers: list, arrays: dict, half: bool) -> tuple:
    """The arrays of the compiled step: ``(embedding, final_norm, lm_head_bias, per-layer
    tuples in LAYER_ARRAYS order)``, with A and 1/A computed once (as the chunked scan
    does: in double, rounded to the params' dtype) and, when ``half``, the projection
    matrices and the embedding as float16 bits (uint16), converted once."""
    dt = arrays["embedding"].dtype

    def store(name, a):
        if not half:
            return a
        with np.errstate(over="ignore"):
            a16 = a.astype(np.float16)
        if not np.isfinite(a16).all():
            raise ValueError(f"weights_dtype: {name} has values beyond the float16 range "
                             f"(|x| > 65504); use float32 weights")
        return a16.view(np.uint16)

    out = []
    for i, p in enumerate(layers):
        A = (-np.exp(np.clip(p["A_log"].astype(np.float64), A_LOG_MIN, A_LOG_MAX))).astype(dt)
        named = dict(p, A=A, A_inv=np.ascontiguousarray(dt.type(1) / A))
        out.append(tuple(store(f"layer{i}.{n}", named[n]) if n in HALF_ARRAYS else named[n]
                         for n in LAYER_ARRAYS))
    return (store("embedding", arrays["embedding"]), arrays["final_norm"],
            arrays["lm_head_bias"], out)


def stepper(params: Mapping[str, ArrayLike], state: RecurrentState, weights_dtype: DTypeLike,
            n_threads: int | None) -> tuple[Stepper, dict]:
    """The compiled stepper of ``params`` over ``state``'s arrays (built once, reused while
    the params, the weights dtype and the thread count stay the same); and ``arrays``."""
    layers, arrays = validated_layers(params, state)
    half = _check_weights_dtype(weights_dtype, arrays["embedding"].dtype)
    nt = check_n_threads(n_threads)
    _check_state_arrays(state, layers, arrays["embedding"].dtype)
    # the stepper holds raw pointers to these very arrays (and references to them, so
    # their ids stay unique): a replaced array or a changed setting builds a new one
    key = (half, nt, state.eps, state.discretization,
           tuple(id(a) for a in state.h), tuple(id(a) for a in state.conv))
    if state._stepper is not None and state._stepper[0] == key:
        return state._stepper[1], arrays
    cache = state._seen[3]
    if half not in cache:
        cache[half] = _prepared(layers, arrays, half)
    emb, final_norm, bias, layer_arrays = cache[half]
    st = Stepper(state.batch, emb, final_norm, bias, layer_arrays, state.h, state.conv,
                 state.eps, state.discretization == "zoh", half, nt)
    state._stepper = (key, st)
    return st, arrays


def init_state(params: Mapping[str, ArrayLike], batch: int, *, eps: float = DEFAULT_EPS,
               discretization: str = "zoh") -> RecurrentState:
    """Zero state for ``batch`` sequences of the model ``params`` (validated here)."""
    batch = check_size("batch", batch, hi=MAX_ELEMENTS)
    check_discretization(discretization)
    eps = check_eps(eps)
    state = RecurrentState(batch, eps, discretization)
    layers, arrays = validated_layers(params, state)
    # the state, and what each step allocates: the logits (B, V) and the stepper's scratch
    V, Dm = arrays["embedding"].shape
    per_seq = V + 3 * Dm + 1 + sum(p["wConv"].shape[0] * (p["A_log"].shape[1] + p["wConv"].shape[1] + 6)
                                   + p["wXProj"].shape[0] for p in layers)
    check_memory(f"init_state(batch={batch})", batch * per_seq * arrays["embedding"].itemsize)
    for p in layers:
        D, K = p["wConv"].shape
        N = p["A_log"].shape[1]
        check_count("state h (batch, dInner, dState)", (batch, D, N))
        state.h.append(np.zeros((batch, D, N), p["wConv"].dtype))          # h (B, D, N)
        state.conv.append(np.zeros((batch, D, K - 1), p["wConv"].dtype))   # tail (B, D, K-1), oldest first
    return state


def step(token_ids: ArrayLike, params: Mapping[str, ArrayLike], state: RecurrentState, *,
         weights_dtype: DTypeLike | None = None,
         n_threads: int | None = None) -> tuple[np.ndarray, RecurrentState]:
    """Feed one token per sequence: ``token_ids`` (B,) ints -> ``(logits (B, V), state)``.

    ``state`` is updated in place and returned (use ``state.copy()`` to branch).
    ``weights_dtype``: None (the params' dtype) or ``"float16"`` (float32 params only:
    float16 projection and embedding weights, float32 accumulation; converted once per
    state and params). ``n_threads``: None (OpenMP default) or the thread count of the
    step's kernels, its products included (one thread pool: docs/api.md, Threads).
    """
    st, arrays = stepper(params, state, weights_dtype, n_threads)
    V = arrays["embedding"].shape[0]
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.shape[0] != state.batch:
        raise ValueError(f"token_ids: expected shape ({state.batch},) (one id per sequence of the "
                         f"state), got {ids.shape}")
    ids = check_tokens("token_ids", ids[:, None], vocab_size=V)[:, 0].copy()
    logits = np.empty((state.batch, V), arrays["final_norm"].dtype)     # logits (B, V)
    st.step(ids, logits)
    state.position += 1
    return logits, state


def prefill_state(tokens: np.ndarray, hs: list, convs: list, layers: list, arrays: dict,
                  eps: float, discretization: str, n_threads: int) -> np.ndarray:
    """Feed ``tokens`` (B, L) through the chunked block forward, from and to the state
    ``hs`` (B, D, N) / ``convs`` (B, D, K-1) per layer (updated in place); returns the
    logits (B, V) of the last position. One GEMM per projection over all B*L rows, so
    a prompt costs far less than L steps."""
    B, L = tokens.shape
    emb = arrays["embedding"]
    Dm = emb.shape[1]
    disc = check_discretization(discretization)
    x = emb[tokens]                                                   # x (B, L, Dm)
    for i, p in enumerate(layers):
        D, K = p["wConv"].shape
        sizes = (B, L, Dm, D, p["A_log"].shape[1], K, p["wDtProj"].shape[1])
        out = np.empty_like(x)                                        # out (B, L, Dm)
        cache = np.empty(_block.cache_len(sizes), x.dtype)
        h_last, tail = np.empty_like(hs[i]), np.empty_like(convs[i])  # (B, D, N), (B, D, K-1)
        _block.forward(x, [p[n] for n in BLOCK_PARAM_NAMES], out, cache, sizes, eps, disc,
                       n_threads, h0=hs[i], conv_state=convs[i], h_last=h_last, conv_tail=tail)
        hs[i][...] = h_last
        convs[i][...] = tail
        x = out
    return ref.rmsnorm(x[:, -1], arrays["final_norm"], eps) @ emb.T + arrays["lm_head_bias"]


def check_sampling(temperature: float, top_k: int, top_p: float) -> tuple[float, int, float]:
    """The sampling settings of :func:`generate` validated (TypeError / ValueError naming
    the argument): temperature >= 0, top_k >= 0 (0: off), top_p in (0, 1]."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a finite number >= 0, got {type(temperature).__name__} "
                        f"{temperature!r}")
    temperature = float(temperature)
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k: expected an integer >= 0 (0: off), got {type(top_k).__name__} {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {top_k}")
    if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p: expected a number in (0, 1], got {type(top_p).__name__} {top_p!r}")
    top_p = float(top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1] (1: off), got {top_p}")
    return temperature, int(top_k), top_p


def _is_ragged(prompt) -> bool:
    """A sequence of 1-D prompts (rather than one (B, L) array-like)."""
    return not isinstance(prompt, np.ndarray) and isinstance(prompt, Sequence) \
        and len(prompt) > 0 and np.ndim(prompt[0]) == 1


def _check_prompts(prompt) -> list[np.ndarray]:
    """A (B, L) int array, or a sequence of B 1-D int sequences of any lengths (>= 1)."""
    if not _is_ragged(prompt):
        arr = check_tokens("prompt", prompt)
        if arr.shape[1] < 1:
            raise ValueError(f"prompt: expected at least one token per sequence, got shape {arr.shape}")
        return list(arr)
    return _id_sequences("prompt", prompt)


def _id_sequences(name, seqs) -> list[np.ndarray]:
    """Each of ``seqs`` as a checked 1-D int array of at least one token (``name[j]`` in errors)."""
    out = []
    for j, s in enumerate(seqs):
        a = np.asarray(s)
        if a.size < 1:          # before the dtype check: an empty list is float64 to NumPy
            raise ValueError(f"{name}[{j}]: expected at least one token")
        out.append(check_tokens(f"{name}[{j}]", a[None])[0])
    return out


def _check_stop(stop) -> list[np.ndarray]:
    if stop is None:
        return []
    if isinstance(stop, np.ndarray) or not isinstance(stop, Sequence):
        raise TypeError(f"stop: expected a sequence of token-id sequences, got {type(stop).__name__}")
    return _id_sequences("stop", stop)


def filter_logits(logits: np.ndarray, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> np.ndarray:
    """Scores (B, V) float64 of :func:`sample_logits` before the draw: logits (B, V) /
    ``temperature`` (> 0), then top-k (keep the k highest scores, ties with the k-th
    included; 0: off), then top-p (keep the smallest set of highest-probability tokens
    whose softmax mass exceeds top_p, at least one; 1: off); removed tokens get -inf.
    The order and the tie rules are those of Hugging Face's TemperatureLogitsWarper,
    TopKLogitsWarper and TopPLogitsWarper."""
    z = np.asarray(logits, np.float64) / temperature                 # z (B, V)
    V = z.shape[1]
    if 0 < top_k < V:
        kth = np.partition(z, V - top_k, axis=-1)[:, V - top_k:V - top_k + 1]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1:
        order = np.argsort(z, axis=-1, kind="stable")                # ascending, as HF
        zs = np.take_along_axis(z, order, axis=-1)
        ps = np.exp(zs - zs[:, -1:])
        cum = np.cumsum(ps / ps.sum(axis=-1, keepdims=True), axis=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[:, -1] = False                                   # keep at least one
        drop = np.empty_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        z = np.where(drop, -np.inf, z)
    return z


def sample_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                  rng: np.random.Generator | None) -> np.ndarray:
    """Next ids (B,) from logits (B, V) with the Hugging Face ``generate`` meanings:
    temperature 0 is greedy (argmax, top_k/top_p unused); otherwise one draw per row
    from the softmax of :func:`filter_logits` (inverse CDF of ``rng.random``)."""
    if temperature == 0:
        return np.argmax(logits, axis=-1)
    z = filter_logits(logits, temperature, top_k, top_p)
    prob = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(prob, axis=-1)                                   # cdf (B, V)
    r = rng.random(z.shape[0])[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= r).sum(axis=-1), z.shape[1] - 1)


def generate(params: Mapping[str, ArrayLike], prompt: ArrayLike | Sequence[ArrayLike], n_tokens: int, *,
             eps: float = DEFAULT_EPS, discretization: str = "zoh", temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, stop: Sequence[ArrayLike] | None = None,
             rng: np.random.Generator | None = None, weights_dtype: DTypeLike | None = None,
             n_threads: int | None = None, device: str = "cpu") -> np.ndarray:
    """Continue each prompt by ``n_tokens`` tokens -> (B, n_tokens) int64.

    ``prompt``: a (B, L>=1) int array, or a sequence of B 1-D int sequences of any
    lengths >= 1 (all continued together, as one batch). Each prompt is fed through the
    chunked block forward (the prefill), then the sequences step together.
    Sampling (:func:`sample_logits`, Hugging Face ``generate`` meanings): ``temperature``
    0 is greedy (argmax, top_k/top_p unused); otherwise top-k then top-p filtering of
    softmax(logits / temperature), drawn with ``rng`` (a ``numpy.random.Generator``).
    ``stop``: token-id sequences; a sequence stops right after generating one of them
    (matched against the end of prompt + output, as HF's stop strings); the stop tokens
    are kept in the output (as HF does) and the positions after them hold ``STOPPED``
    (-1). ``weights_dtype`` / ``n_threads``: as in :func:`step` (the prefill always uses
    the params' own weights). ``device="gpu"``: the prefill runs on the CPU, then the steps
    on the GPU (``mamba_ext.gpu.recurrent.GpuStepper``; float32 params and weights only),
    equal to the CPU's steps within the GPU tolerance.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
    prompts = _check_prompts(prompt)
    n_tokens = check_size("n_tokens", n_tokens, lo=0, hi=MAX_ELEMENTS)
    B = len(prompts)
    check_count("the output (batch, n_tokens)", (B, n_tokens))
    check_memory("generate: the output (batch, n_tokens)", 8 * B * n_tokens)
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    stops = _check_stop(stop)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected None or a numpy.random.Generator "
                        f"(np.random.default_rng(seed)), got {type(rng).__name__}")
    if temperature > 0 and rng is None:
        rng = np.random.default_rng()
    state = init_state(params, B, eps=eps, discretization=discretization)
    if device == "gpu":            # refused before the prefill; the stepper is built after it
        st, arrays = None, validated_layers(params, state)[1]
        _check_gpu_weights(arrays, weights_dtype)
    else:
        st, arrays = stepper(params, state, weights_dtype, n_threads)
    V = arrays["embedding"].shape[0]
    if len({p.size for p in prompts}) == 1 and not _is_ragged(prompt):
        check_tokens("prompt", np.stack(prompts), vocab_size=V)     # names (batch, time)
    for b, p in enumerate(prompts):
        bad = np.flatnonzero((p < 0) | (p >= V))
        if bad.size:
            raise ValueError(f"prompt[{b}]: token id {int(p[bad[0]])} at position {bad[0]} is out "
                             f"of range [0, {V})")
    for j, s in enumerate(stops):
        check_tokens(f"stop[{j}]", s[None], vocab_size=V)
    out = np.full((B, n_tokens), STOPPED, np.int64)
    if n_tokens == 0:
        return out
    layers, _ = validated_layers(params, state)
    nt = check_n_threads(n_threads)
    with np.errstate(over="ignore", invalid="ignore"):   # overflow is reported below, once
        if len({p.size for p in prompts}) == 1:           # one batched prefill
            logits = prefill_state(np.stack(prompts), state.h, state.conv, layers, arrays,
                                   state.eps, discretization, nt)
        else:                                            # ragged: one prefill per row
            logits = np.concatenate([
                prefill_state(p[None], [h[b:b + 1] for h in state.h],
                              [c[b:b + 1] for c in state.conv], layers, arrays, state.eps,
                              discretization, nt)
                for b, p in enumerate(prompts)])
        logits = np.ascontiguousarray(logits, arrays["final_norm"].dtype)   # (B, V)
        state.position = max(p.size for p in prompts)
        if device == "gpu":
            st = _gpu_stepper(arrays, state)
        if temperature == 0 and not stops:               # the whole loop in C
            bad = st.greedy(logits, out)
            if bad >= 0:
                _not_finite(min(p.size for p in prompts) + bad - 1)
            return out
        return _continue(st, logits, out, prompts, stops, temperature, top_k, top_p, rng)


def _check_gpu_weights(arrays, weights_dtype):
    """device='gpu' runs float32 params with float32 weights only."""
    if arrays["embedding"].dtype != np.float32 or _check_weights_dtype(weights_dtype, np.float32):
        raise ValueError("device='gpu': generation on the GPU runs float32 params with float32 "
                         "weights (weights_dtype None)")


def _gpu_stepper(arrays, state):
    """A GpuStepper over ``state`` (uploaded); ``arrays``: the validated float32 params."""
    from .gpu.model import check_model
    from .gpu.recurrent import GpuStepper
    arrays, dims = check_model(arrays)          # the dims (arrays are valid already)
    st = GpuStepper(arrays, dims, state.batch, state.eps, state.discretization == "zoh")
    st.set_state(state.h, state.conv)
    return st


def _not_finite(position: int):
    raise ValueError(f"params: the logits of position {position} are not finite; "
                     f"the weights cannot be sampled from (a diverged model?)")


def _continue(st, logits, out, prompts, stops, temperature, top_k, top_p, rng):
    """The sampling loop of :func:`generate` after the prefill; ``out`` (B, n) filled."""
    B, n_tokens = out.shape
    live = np.ones(B, bool)
    keep = max((s.size for s in stops), default=1)       # the longest stop sequence
    tails = [list(p[-keep:]) for p in prompts]           # last tokens of prompt + output
    for j in range(n_tokens):
        if not np.isfinite(logits[live]).all():
            _not_finite(min(p.size for p in prompts) + j - 1)
        nxt = sample_logits(logits, temperature, top_k, top_p, rng)
        out[live, j] = nxt[live]
        for b in np.flatnonzero(live) if stops else ():
            tails[b] = tails[b][1 - keep:] + [int(nxt[b])] if keep > 1 else [int(nxt[b])]
            if any(len(tails[b]) >= s.size and tails[b][-s.size:] == list(s) for s in stops):
                live[b] = False
        if not live.any():
            break
        if j + 1 < n_tokens:
            st.step(np.ascontiguousarray(nxt, np.int64), logits)
    return out
