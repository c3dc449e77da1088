"""Whole Mamba-1 language model on the CPU: forward, mean cross-entropy, exact gradients.

token embedding -> ``n_layers`` Mamba-1 blocks -> final RMSNorm -> LM head tied to
the embedding (+ ``lm_head_bias``) -> mean cross-entropy over all B*L positions.
The maths is that of ``docs/semantics.md``; the compiled core is
``mamba_ext/cpu/model.pyx`` (C contract in ``_model.pxd``).

Parameters are a flat dict (see :func:`model_param_names`)::

    embedding      (V, Dm)   token table, also the output head (tied)
    final_norm     (Dm,)     final RMSNorm gain
    lm_head_bias   (V,)      output-head bias
    layer{i}.{name}          the 13 block parameters of layer i (BLOCK_PARAM_NAMES)

All sizes (V, Dm, n_layers, dInner, dState, dConv, dtRank) are inferred from
the shapes; every layer must have the same sizes.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._validate import (
    MAX_ELEMENTS,
    BLOCK_PARAM_NAMES,
    BlockDims,
    as_float_array,
    block_param_shapes,
    check_block_params,
    check_n_threads,
    check_state,
    check_count,
    check_discretization,
    check_eps,
    check_size,
    check_tokens,
)
from .constants import DEFAULT_EPS

# layer{i}.{name}: i in canonical ASCII decimal (no sign, no leading zero, no other digits:
# "layer00.X" or "layer\u0660.X" would otherwise be read as layer 0 and replace layer0.X)
_LAYER_KEY = re.compile(r"layer(0|[1-9][0-9]{0,8})\.(.+)\Z", re.ASCII)
_TOP_NAMES = ("embedding", "final_norm", "lm_head_bias")
MAX_LAYERS = 10 ** 9 - 1     # the largest index _LAYER_KEY reads has 9 digits


def model_param_names(n_layers: int) -> tuple[str, ...]:
    """Names of the model parameters, in a fixed order:
    ``embedding``, ``final_norm``, ``lm_head_bias``, then ``layer{i}.{name}`` for
    ``i`` in ``range(n_layers)`` and ``name`` in ``BLOCK_PARAM_NAMES``."""
    n = int(n_layers)
    if n < 0:
        raise ValueError(f"n_layers: expected >= 0, got {n_layers}")
    return _TOP_NAMES + tuple(f"layer{i}.{name}" for i in range(n) for name in BLOCK_PARAM_NAMES)


# the earlier spelling of model_param_names (a function named like a constant), kept so
# that code written against it runs on
MODEL_PARAM_NAMES = model_param_names


class ModelDims(NamedTuple):
    """Sizes of the model, inferred from the parameter shapes."""
    V: int              # vocab size
    n_layers: int
    block: BlockDims    # Dm, D, N, K, R shared by every layer (all 1 when n_layers == 0)

    @property
    def Dm(self) -> int:
        return self.block.Dm


def check_model_params(params: Mapping[str, ArrayLike],
                       dtype: DTypeLike | None = None) -> tuple[dict[str, np.ndarray], ModelDims]:
    """Validate a model parameter dict.

    Returns ``(arrays, dims)``: ``arrays`` a dict in :func:`model_param_names`
    order of C-contiguous arrays of one float dtype (``dtype``, or that of
    ``embedding``), ``dims`` a :class:`ModelDims`.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping of model parameter names to arrays, "
                        f"got {type(params).__name__}")
    missing_top = [n for n in _TOP_NAMES if n not in params]
    if missing_top:
        raise ValueError(f"params: missing parameter(s) {missing_top}")
    layers: dict[int, dict] = {}
    unknown = []
    for key in params:
        if key in _TOP_NAMES:
            continue
        m = _LAYER_KEY.match(key) if isinstance(key, str) else None
        if m is None:
            unknown.append(str(key))
            continue
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = params[key]
    if unknown:
        raise ValueError(f"params: unknown parameter(s) {sorted(unknown)}; expected "
                         f"'embedding', 'final_norm', 'lm_head_bias' and 'layer{{i}}.{{name}}'")
    n_layers = len(layers)
    if sorted(layers) != list(range(n_layers)):
        raise ValueError(f"params: layer indices must be 0..n_layers-1 without gaps, got "
                         f"{sorted(layers)}")

    emb = as_float_array("embedding", params["embedding"], dtype)
    dtype = emb.dtype
    if emb.ndim != 2 or emb.shape[0] < 1 or emb.shape[1] < 1:
        raise ValueError(f"embedding: expected a 2-D array (vocab_size, dModel) with both "
                         f"sizes >= 1, got shape {emb.shape}")
    check_count("embedding", emb.shape)
    V, Dm = emb.shape
    arrays = {"embedding": emb}
    for name, shape in (("final_norm", (Dm,)), ("lm_head_bias", (V,))):
        a = as_float_array(name, params[name], dtype)
        if a.shape != shape:
            raise ValueError(f"{name}: expected shape {shape} (vocab_size={V}, dModel={Dm} from "
                             f"embedding), got {a.shape}")
        arrays[name] = a

    block = BlockDims(Dm=Dm, D=1, N=1, K=1, R=1)
    for i in range(n_layers):
        prefix = f"layer{i}."
        blk, dims = check_block_params(layers[i], dtype=dtype, d_model=Dm, prefix=prefix)
        if i == 0:
            block = dims
        elif dims != block:
            raise ValueError(f"layer{i}: sizes {dims._asdict()} differ from layer0's "
                             f"{block._asdict()}; every layer must have the same sizes")
        for name in BLOCK_PARAM_NAMES:
            arrays[prefix + name] = blk[name]
    return arrays, ModelDims(V=V, n_layers=n_layers, block=block)


def _sizes(dims: ModelDims, B: int, L: int) -> tuple:
    b = dims.block
    return (dims.V, dims.n_layers, B, L, b.Dm, b.D, b.N, b.K, b.R)


def _layer_lists(arrays: Mapping, n_layers: int) -> list:
    return [[arrays[f"layer{i}.{n}"] for n in BLOCK_PARAM_NAMES] for i in range(n_layers)]


def _model_state(arrays, dims: ModelDims, B: int, h0, conv_state, return_state: bool):
    """The state arguments of the compiled model (``_state_table`` in model.pyx):
    ``None`` when no state is given or wanted, else ``(h0, conv_state, h_last, conv_tail)``
    with h_last / conv_tail pre-filled with the incoming state (what an empty window
    returns) and overwritten by the kernels."""
    if h0 is None and conv_state is None and not return_state:
        return None
    b, nl, dtype = dims.block, dims.n_layers, arrays["embedding"].dtype
    h_shape, c_shape = (nl, B, b.D, b.N), (nl, B, b.D, b.K - 1)
    if h0 is not None:
        h0 = check_state("h0", h0, dtype, h_shape, "(n_layers, batch, dInner, dState)")
    if conv_state is not None:
        conv_state = check_state("conv_state", conv_state, dtype, c_shape,
                                  "(n_layers, batch, dInner, dConv-1)")
    h_last = np.zeros(h_shape, dtype) if h0 is None else h0.copy()
    conv_tail = np.zeros(c_shape, dtype) if conv_state is None else conv_state.copy()
    return (h0, conv_state, h_last, conv_tail)


def model_forward(tokens: ArrayLike, params: Mapping[str, ArrayLike], *, h0: ArrayLike | None = None,
                  conv_state: ArrayLike | None = None, return_state: bool = False,
                  eps: float = DEFAULT_EPS, discretization: str = "zoh",
                  n_threads: int | None = None) -> np.ndarray | tuple:
    """Logits ``(B, L, V)`` of the model for integer ``tokens`` ``(B, L)``.

    State passing, per layer (the block API's ``h0`` / ``conv_state`` / ``return_state``,
    stacked over the layers): ``h0`` (n_layers, B, D, N) is each layer's scan state before
    step 0 and ``conv_state`` (n_layers, B, D, K-1) each layer's conv history (xc of the K-1
    steps before ``tokens``, oldest first); default zeros. ``return_state=True`` returns
    ``(logits, (h_last, conv_tail))`` of those shapes, the state after the last step: a long
    sequence run window by window, each window given the previous one's state, gives the
    logits of one run over the whole sequence (to float rounding).

    ``eps`` is the epsilon of every RMSNorm, a finite number > 0 (``DEFAULT_EPS`` = 1e-6
    by default; Hugging Face
    Mamba checkpoints use 1e-5). ``discretization`` is ``"zoh"`` (exact) or
    ``"euler"`` (b_bar = Delta*B, as the CUDA Mamba kernels and Hugging Face
    ``transformers`` compute). Token ids outside ``[0, V)`` raise ValueError
    naming the id and its position.
    """
    from .cpu import model as _model
    disc = check_discretization(discretization)
    arrays, dims = check_model_params(params)
    tok = check_tokens("tokens", tokens, dims.V)
    eps = check_eps(eps)
    B, L = tok.shape
    states = _model_state(arrays, dims, B, h0, conv_state, return_state)
    logits = np.empty((B, L, dims.V), dtype=arrays["embedding"].dtype)
    if B * L:
        _model.forward(logits, tok, arrays["embedding"], arrays["final_norm"],
                       arrays["lm_head_bias"], _layer_lists(arrays, dims.n_layers),
                       _sizes(dims, B, L), eps, disc, check_n_threads(n_threads), states=states)
    if return_state:
        return logits, (states[2], states[3])
    return logits


def model_loss_and_grads(tokens: ArrayLike, targets: ArrayLike, params: Mapping[str, ArrayLike],
                         checkpointing: bool = False, *, h0: ArrayLike | None = None,
                         conv_state: ArrayLike | None = None, return_state: bool = False,
                         eps: float = DEFAULT_EPS, discretization: str = "zoh",
                         loss_scale: float = 1.0,
                         n_threads: int | None = None,
                         grads_ready: Callable | None = None) -> tuple:
    """Mean cross-entropy and its gradient with respect to every parameter.

    Returns ``(loss, grads)``: ``loss`` a Python float (accumulated in double,
    never multiplied by ``loss_scale``), ``grads`` a dict keyed like ``params``
    (in :func:`model_param_names` order) of arrays of the parameters' dtype.
    ``targets`` (B, L) are the ids to predict at every position (no shift
    happens inside). ``checkpointing=True`` keeps only each layer's input and
    recomputes the block caches in the backward pass: bit-identical gradients,
    lower peak memory (see :func:`model_workspace_bytes`). ``loss_scale``
    multiplies the gradient seed dLoss/dlogits (mixed-precision loss scaling):
    every gradient comes out multiplied by it. ``eps`` and ``discretization``
    as in :func:`model_forward`.

    ``h0``, ``conv_state``, ``return_state`` as in :func:`model_forward` (then the result is
    ``(loss, grads, (h_last, conv_tail))``): training on a long sequence window by window,
    each window starting from the state the previous one returned. The gradients are those
    of this window's loss with the carried state held constant: truncated backpropagation
    through time. The loss still depends on everything before (through the state), but
    no gradient flows back into earlier windows, and none is returned for ``h0`` /
    ``conv_state``.

    ``grads_ready(names, grads)``, when given, is called on the calling thread as soon as
    gradients are final, with their names and the dict being filled (the one returned):
    ``final_norm`` and ``lm_head_bias`` after the head's backward, each layer's 13 from the
    last layer to the first, ``embedding`` (the tied head's and the lookup's sum) last; every
    name once. Data parallelism starts each all-reduce there, during the backward
    (mamba_ext.distributed.GradReducer.add). The other entries must not be read or
    written before they are reported; an exception from it is raised once the backward
    has finished.
    """
    from .cpu import model as _model
    disc = check_discretization(discretization)
    arrays, dims = check_model_params(params)
    tok = check_tokens("tokens", tokens, dims.V)
    tgt = check_tokens("targets", targets, dims.V, shape=tok.shape)
    eps = check_eps(eps)
    scale = float(loss_scale)
    if not (np.isfinite(scale) and scale > 0.0):
        raise ValueError(f"loss_scale: expected a finite number > 0, got {loss_scale}")
    B, L = tok.shape
    if B * L == 0:
        raise ValueError(f"tokens: shape {tok.shape} has no positions; the mean cross-entropy "
                         f"needs batch >= 1 and seqLen >= 1")
    states = _model_state(arrays, dims, B, h0, conv_state, return_state)
    if grads_ready is not None and not callable(grads_ready):
        raise TypeError(f"grads_ready: expected a callable or None, got "
                        f"{type(grads_ready).__name__}")
    grads = {k: np.zeros_like(a) for k, a in arrays.items()}
    done = None
    if grads_ready is not None:
        nl = dims.n_layers

        def done(i):        # model.pyx's grads_done index -> the names now final
            names = (["final_norm", "lm_head_bias"] if i == nl
                     else [f"layer{i}.{n}" for n in BLOCK_PARAM_NAMES])
            grads_ready(names, grads)
    loss = _model.loss_and_grads(tok, tgt, arrays["embedding"], arrays["final_norm"],
                                 arrays["lm_head_bias"], _layer_lists(arrays, dims.n_layers),
                                 grads["embedding"], grads["final_norm"], grads["lm_head_bias"],
                                 _layer_lists(grads, dims.n_layers), _sizes(dims, B, L), eps,
                                 disc, scale, bool(checkpointing), check_n_threads(n_threads),
                                 states=states, grads_done=done)
    if grads_ready is not None:
        grads_ready(["embedding"], grads)
    if return_state:
        return float(loss), grads, (states[2], states[3])
    return float(loss), grads


def _workspace_bytes_exact(dims: ModelDims, B: int, L: int, checkpointing: bool, itemsize: int) -> int:
    """The formula of ``model_workspace_bytes`` in model.pyx, in Python integers (which
    cannot wrap): per sequence group (model.pyx, "Sequence groups": G groups of k
    sequences; one group of B when the call runs as one pass) the layer inputs
    ((n_layers+1) kL Dm), the block caches (one when checkpointing, else n_layers), xn,
    rstd, logits and 3 kL Dm of scratch; G gradient slots (the head's and one layer's
    gradients) when G > 1; plus M doubles. It guards the compiled formula against
    overflow; tests/api/test_limits.py keeps the two equal."""
    from .cpu import model as _model
    M = B * L
    if M == 0:
        return 0
    one_pass = _region_values(dims, B, L, checkpointing)
    if one_pass >= 2 ** 60:          # the compiled group_seqs would wrap; the caller refuses it
        return one_pass * itemsize + M * 8
    G, k = _model.sequence_groups(_sizes(dims, B, L), checkpointing)
    n = G * _region_values(dims, k, L, checkpointing)
    if G > 1:
        n += G * _slot_values(dims)
    return n * itemsize + M * 8


def _region_values(dims: ModelDims, B: int, L: int, checkpointing: bool) -> int:
    """Elements of the workspace of B sequences (model.pyx's region)."""
    from .block import cache_elements
    rows, Dm = B * L, dims.block.Dm
    cache_len = cache_elements(_sizes(dims, B, L)[2:])
    n_caches = min(dims.n_layers, 1) if checkpointing else dims.n_layers
    return ((dims.n_layers + 1) * rows * Dm + n_caches * cache_len + rows * Dm + rows
            + rows * dims.V + 3 * rows * Dm)


def _slot_values(dims: ModelDims) -> int:
    """Elements of a sequence group's gradient slot (model.pyx's _slot_values): the head's
    gradients (embedding, final norm, head bias) and one layer's."""
    per_layer = sum(math.prod(s) for s in block_param_shapes(dims.block).values())
    return dims.V * dims.block.Dm + dims.block.Dm + dims.V + (per_layer if dims.n_layers else 0)


def model_workspace_bytes(params: Mapping[str, ArrayLike], batch: int, seq_len: int,
                          checkpointing: bool = False) -> int:
    """Bytes the compiled loss-and-grads allocates internally for these sizes
    (layer inputs, block caches — one instead of n_layers when checkpointing —,
    logits and gradient buffers; when the batch runs as sequence groups, one gradient slot
    per group as well, docs/api.md "Determinism"; a call with state passing runs as one
    pass and needs no more).

    ``batch`` and ``seq_len`` are integers >= 0; sizes whose workspace would not fit
    in memory addressable by the kernels (more than ``2**63 / 16`` bytes) raise
    ValueError instead of wrapping around.
    """
    from .cpu import model as _model
    arrays, dims = check_model_params(params)
    B = check_size("batch", batch, lo=0, hi=MAX_ELEMENTS)
    L = check_size("seq_len", seq_len, lo=0, hi=MAX_ELEMENTS)
    itemsize = arrays["embedding"].itemsize
    exact = _workspace_bytes_exact(dims, B, L, bool(checkpointing), itemsize)
    if exact > MAX_ELEMENTS:
        raise ValueError(f"batch, seq_len: the workspace for batch {B} x seq_len {L} would be "
                         f"{exact} bytes, more than the {MAX_ELEMENTS} that mamba_ext can allocate")
    # sizes this small cannot wrap in the compiled formula (tests/api/test_limits.py
    # checks that it equals the exact one)
    return int(_model.workspace_bytes(_sizes(dims, B, L), bool(checkpointing), itemsize))


def init_model_params(vocab_size: int, d_model: int, n_layers: int, d_state: int = 16,
                      d_conv: int = 4, expand: int = 2, dt_rank: int | None = None, seed: int = 0,
                      dtype: DTypeLike = np.float32, *, init: str = "mamba") -> dict[str, np.ndarray]:
    """Fresh model parameters (dict in :func:`model_param_names` order).

    Each layer comes from :func:`mamba_ext.init_mamba1_params` with the scheme ``init``
    (``"mamba"``, the default: the reference implementations' rules, the output projection
    rescaled by 1/sqrt(n_layers); ``"legacy"``: the scheme of mamba_ext <= 0.2, same values
    for the same seed) and a seed derived from ``(seed, layer index)``;
    ``embedding ~ N(0, 0.02^2)`` in both schemes (so the initial logits are ~0 and the loss
    starts near ln(vocab_size)), ``final_norm = 1``, ``lm_head_bias = 0``.
    """
    from .block import check_init, init_mamba1_params
    check_init(init)
    V = check_size("vocab_size", vocab_size)
    Dm = check_size("d_model", d_model)
    nl = check_size("n_layers", n_layers, lo=0, hi=MAX_LAYERS)
    check_count("embedding", (V, Dm))
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    ss = np.random.SeedSequence(int(seed))
    emb_seq, *layer_seqs = ss.spawn(nl + 1)
    rng = np.random.default_rng(emb_seq)
    params = {
        "embedding": (0.02 * rng.standard_normal((V, Dm))).astype(dtype),
        "final_norm": np.ones(Dm, dtype=dtype),
        "lm_head_bias": np.zeros(V, dtype=dtype),
    }
    for i, sq in enumerate(layer_seqs):
        layer_seed = int(sq.generate_state(1, dtype=np.uint32)[0])
        blk = init_mamba1_params(Dm, d_state=d_state, d_conv=d_conv, expand=expand,
                                 dt_rank=dt_rank, seed=layer_seed, dtype=dtype, init=init,
                                 n_layers=nl)
        for name in BLOCK_PARAM_NAMES:
            params[f"layer{i}.{name}"] = np.ascontiguousarray(blk[name], dtype=dtype)
    return params
