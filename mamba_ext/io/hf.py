"""Convert between Hugging Face ``transformers`` Mamba checkpoints and our params.

A Hugging Face Mamba checkpoint (``MambaForCausalLM.save_pretrained``) is a folder
with ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Keys, per layer ``i``::

    backbone.embeddings.weight          (V, Dm)     -> embedding (tied with the head)
    backbone.layers.{i}.norm.weight     (Dm,)       -> layer{i}.normWeight
    ...mixer.in_proj.weight             (2D, Dm)    -> wInProj      (x half first, then z)
    ...mixer.in_proj.bias  [use_bias]   (2D,)       -> bInProj      (else zeros)
    ...mixer.conv1d.weight              (D, 1, K)   -> wConv (D, K) taps REVERSED
    ...mixer.conv1d.bias   [conv bias]  (D,)        -> bConv        (else zeros)
    ...mixer.x_proj.weight              (P, D)      -> wXProj       (bXProj = 0: no bias there)
    ...mixer.dt_proj.weight / .bias     (D, R) (D,) -> wDtProj / bDtProj
    ...mixer.A_log                      (D, N)      -> A_log
    ...mixer.D                          (D,)        -> D_vec
    ...mixer.out_proj.weight            (Dm, D)     -> wOutProj
    ...mixer.out_proj.bias [use_bias]   (Dm,)       -> bOutProj     (else zeros)
    backbone.norm_f.weight              (Dm,)       -> final_norm
    lm_head.weight (optional, tied)     (V, Dm)     must equal the embedding; lm_head_bias = 0

Weights may be stored in float32, float64, float16 or bfloat16 (``load_hf`` up-casts the half
formats exactly); ``save_hf`` writes float32, float16 or bfloat16, in one file or in shards,
and can copy the ``tokenizer.json`` of the folder a model came from.

Why the conv taps flip: transformers runs ``nn.Conv1d(padding=K-1)`` (cross-correlation),
whose tap ``K-1`` multiplies the current step; our tap 0 does (docs/semantics.md).

Two semantic differences are carried in the returned config rather than in weights:
the RMSNorm epsilon (``layer_norm_epsilon``, 1e-5 there; our default is
``mamba_ext.constants.DEFAULT_EPS``, 1e-6) and the
discretisation: transformers and the CUDA kernels use Euler ``b_bar = Delta*B``, so a
converted model matches them only when run with ``discretization="euler"``. Pass the
returned ``config["eps"]`` and ``config["discretization"]`` to ``model_forward`` /
``model_loss_and_grads`` / ``mamba_ext.recurrent.init_state``.

Anything we cannot represent exactly is refused with a ValueError that says why:
another activation, an untied or biased head, a non-zero x_proj bias, A_log outside the
clamp range [A_LOG_MIN, A_LOG_MAX] = [-10, 5] our forward applies (``mamba_ext.constants``),
non-finite weights, unknown tensors.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .._validate import as_float_array, check_eps, check_size
from ..constants import A_LOG_MAX, A_LOG_MIN
from ..model import check_model_params
from . import checkpoint
from .checkpoint import StrPath
from .files import read_regular

_MIXER = {  # our block name -> HF mixer tensor name (the ones without a layout change)
    "wInProj": "in_proj.weight", "bInProj": "in_proj.bias", "bConv": "conv1d.bias",
    "wXProj": "x_proj.weight", "wDtProj": "dt_proj.weight", "bDtProj": "dt_proj.bias",
    "A_log": "A_log", "D_vec": "D", "wOutProj": "out_proj.weight", "bOutProj": "out_proj.bias",
}
_OPTIONAL_HF = {"bInProj", "bOutProj", "bConv"}   # absent in HF when use_bias / use_conv_bias is off


def hf_dims(hf_config: Mapping) -> dict:
    """Our model config from an HF MambaConfig dict, refusing what we cannot run."""
    cfg = dict(hf_config)
    model_type = cfg.get("model_type", "mamba")
    if model_type != "mamba":
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; only Mamba-1 "
                         f"('mamba') checkpoints can be converted")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} cannot be represented; mamba_ext uses 'silu'")
    if not cfg.get("tie_word_embeddings", True):
        raise ValueError("config.json: tie_word_embeddings is false; mamba_ext ties the output head to "
                         "the embedding (an untied head is accepted only if lm_head.weight equals it)")
    def size(key, default=None, lo=1):
        if key not in cfg and default is None:
            raise ValueError(f"config.json: missing required field {key!r}")
        v = cfg.get(key, default)
        if type(v) is not int:      # JSON integers only: no "64", 64.5 or true
            raise ValueError(f"config.json: field {key!r}: expected an integer, got {v!r}")
        try:
            return check_size(key, v, lo=lo)
        except ValueError as e:
            raise ValueError(f"config.json: field {e}") from None

    Dm = size("hidden_size")
    V = size("vocab_size")
    n_layers = size("num_hidden_layers", lo=0)
    N = size("state_size", 16)
    K = size("conv_kernel", 4)
    D = check_size("config.json: expand * hidden_size", size("expand", 2) * Dm)  # as transformers
    R = math.ceil(Dm / 16) if cfg.get("time_step_rank", "auto") == "auto" else size("time_step_rank")
    try:
        eps = check_eps(cfg.get("layer_norm_epsilon", 1e-5))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json: field 'layer_norm_epsilon': {e}") from None
    return {"vocab_size": V, "d_model": Dm, "n_layers": n_layers, "d_state": N, "d_conv": K,
            "d_inner": D, "dt_rank": R, "eps": eps, "discretization": "euler"}


def params_from_hf(tensors: Mapping[str, ArrayLike], hf_config: Mapping[str, Any],
                   dtype: DTypeLike = np.float32) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """HF state dict (name -> array, torch tensors need ``.numpy()`` first) -> ``(params, config)``.

    ``params`` is our model dict (``embedding``, ``final_norm``, ``lm_head_bias``,
    ``layer{i}.<block name>``) of C-contiguous ``dtype`` arrays; ``config`` holds the sizes,
    ``eps`` (from ``layer_norm_epsilon``) and ``discretization="euler"``.
    """
    cfg = hf_dims(hf_config)
    # Old checkpoints say "backbone.embedding."; transformers renames it on load, so do we.
    t = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in tensors.items()}
    used = set()

    def take(key, shape, required=True):
        if key not in t:
            if required:
                raise ValueError(f"checkpoint: missing tensor {key!r} (expected shape {shape})")
            return np.zeros(shape, dtype)
        used.add(key)
        src = np.asarray(t[key])
        if src.dtype.kind != "f":     # never reinterpret integers (or bools) as weights
            raise ValueError(f"checkpoint: {key}: dtype {src.dtype} is not a float dtype; "
                             f"a Mamba weight is float16, float32 or float64")
        arr = as_float_array(key, src.astype(np.float64)).astype(dtype)
        if arr.shape != tuple(shape):
            raise ValueError(f"checkpoint: {key}: expected shape {tuple(shape)} (from config.json: "
                             f"{_describe(cfg)}), got {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"checkpoint: {key} contains non-finite values (NaN or Inf)")
        return arr

    V, Dm, D, N, K, R = (cfg[k] for k in ("vocab_size", "d_model", "d_inner", "d_state", "d_conv",
                                          "dt_rank"))
    shapes = {"wInProj": (2 * D, Dm), "bInProj": (2 * D,), "bConv": (D,), "wXProj": (R + 2 * N, D),
              "wDtProj": (D, R), "bDtProj": (D,), "A_log": (D, N), "D_vec": (D,),
              "wOutProj": (Dm, D), "bOutProj": (Dm,)}
    params = {"embedding": take("backbone.embeddings.weight", (V, Dm)),
              "final_norm": take("backbone.norm_f.weight", (Dm,)),
              "lm_head_bias": np.zeros(V, dtype)}
    if "lm_head.weight" in t:   # written by some savers even when tied; it must be the same table
        head = take("lm_head.weight", (V, Dm))
        if not np.array_equal(head, params["embedding"]):
            raise ValueError("checkpoint: lm_head.weight differs from backbone.embeddings.weight; "
                             "mamba_ext supports only a head tied to the embedding")
    if "lm_head.bias" in t:
        raise ValueError("checkpoint: lm_head.bias present; the Hugging Face Mamba head has no bias "
                         "and this layout is not supported")
    for i in range(cfg["n_layers"]):
        pre, mix = f"layer{i}.", f"backbone.layers.{i}.mixer."
        params[pre + "normWeight"] = take(f"backbone.layers.{i}.norm.weight", (Dm,))
        conv = take(mix + "conv1d.weight", (D, 1, K))
        params[pre + "wConv"] = np.ascontiguousarray(conv[:, 0, ::-1])   # flip the taps
        for ours, theirs in _MIXER.items():
            params[pre + ours] = take(mix + theirs, shapes[ours], required=ours not in _OPTIONAL_HF)
        params[pre + "bXProj"] = np.zeros(R + 2 * N, dtype)
        a_log = params[pre + "A_log"]
        if a_log.size and (a_log.min() < A_LOG_MIN or a_log.max() > A_LOG_MAX):
            raise ValueError(f"checkpoint: {mix}A_log has values in [{a_log.min():.4g}, "
                             f"{a_log.max():.4g}], outside [{A_LOG_MIN:g}, {A_LOG_MAX:g}]; mamba_ext "
                             f"clamps A_log to that range, so it would not compute the same model")
    unknown = sorted(set(t) - used)
    if unknown:
        raise ValueError(f"checkpoint: unexpected tensor(s) {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}; "
                         f"not a Mamba-1 layout mamba_ext can represent")
    return params, cfg


def _describe(cfg):
    return ", ".join(f"{k}={cfg[k]}" for k in ("vocab_size", "d_model", "d_inner", "d_state",
                                               "d_conv", "dt_rank", "n_layers"))


def params_to_hf(params: Mapping[str, ArrayLike], config: Mapping[str, Any],
                 approximate_discretization: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Our params + config -> ``(tensors, hf_config)`` for ``MambaForCausalLM``.

    ``config`` needs ``eps`` and ``discretization``. A model run with ``"zoh"`` computes a
    (slightly) different function than transformers' Euler scan: refused unless
    ``approximate_discretization=True``. A_log is written clipped to [A_LOG_MIN, A_LOG_MAX], which is
    what our forward uses. Refused: no layers, a non-zero ``lm_head_bias`` or ``bXProj``,
    ``d_inner`` not a multiple of ``d_model`` (transformers only has an integer ``expand``).
    """
    arrays, mdims = check_model_params(params)
    n_layers, dims, V = mdims.n_layers, mdims.block, mdims.V
    if n_layers == 0:
        raise ValueError("params: no layers (layer0.wInProj missing); nothing to export")
    disc = config.get("discretization", "zoh")
    if disc not in ("zoh", "euler"):
        raise ValueError(f"config['discretization']: expected 'zoh' or 'euler', got {disc!r}")
    if disc != "euler" and not approximate_discretization:
        raise ValueError("config['discretization'] is 'zoh', but transformers' Mamba uses the Euler "
                         "b_bar = Delta*B; the exported model would compute different outputs. Train/run "
                         "with discretization='euler', or pass approximate_discretization=True")
    if "eps" not in config:
        raise ValueError("config: missing 'eps' (the RMSNorm epsilon the model is run with)")
    eps = check_eps(config["eps"])
    if np.any(arrays["lm_head_bias"] != 0):
        raise ValueError("lm_head_bias: non-zero; the Hugging Face Mamba head has no bias, so this "
                         "model cannot be represented there")
    Dm, D = dims.Dm, dims.D
    if D % Dm:
        raise ValueError(f"params: dInner {D} is not a multiple of dModel {Dm}; transformers' "
                         f"MambaConfig derives intermediate_size = expand * hidden_size (integer expand)")
    use_bias = any(np.any(arrays[f"layer{i}.{n}"] != 0)
                   for i in range(n_layers) for n in ("bInProj", "bOutProj"))
    tensors = {"backbone.embeddings.weight": arrays["embedding"],
               "backbone.norm_f.weight": arrays["final_norm"]}
    for i in range(n_layers):
        pre, mix = f"layer{i}.", f"backbone.layers.{i}.mixer."
        if np.any(arrays[pre + "bXProj"] != 0):
            raise ValueError(f"{pre}bXProj: non-zero; the Hugging Face x_proj has no bias, so this "
                             f"model cannot be represented there")
        tensors[f"backbone.layers.{i}.norm.weight"] = arrays[pre + "normWeight"]
        tensors[mix + "conv1d.weight"] = np.ascontiguousarray(arrays[pre + "wConv"][:, None, ::-1])
        for ours, theirs in _MIXER.items():
            if ours in ("bInProj", "bOutProj") and not use_bias:
                continue
            tensors[mix + theirs] = arrays[pre + ours]
        tensors[mix + "A_log"] = np.clip(arrays[pre + "A_log"], A_LOG_MIN, A_LOG_MAX)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    hf_config = {
        "architectures": ["MambaForCausalLM"], "model_type": "mamba",
        "vocab_size": V, "hidden_size": Dm, "state_size": dims.N, "num_hidden_layers": n_layers,
        "expand": D // Dm, "intermediate_size": D, "conv_kernel": dims.K, "time_step_rank": dims.R,
        "layer_norm_epsilon": eps, "use_bias": bool(use_bias), "use_conv_bias": True,
        "hidden_act": "silu", "tie_word_embeddings": True, "residual_in_fp32": True,
    }
    return tensors, hf_config


# ---- files (mamba_ext.io.checkpoint reads and writes safetensors, verified, atomically) ----

def load_hf(path: StrPath, dtype: DTypeLike = np.float32) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Load a ``save_pretrained`` folder -> ``(params, config)`` (see :func:`params_from_hf`).

    Reads ``model.safetensors`` or the shards of ``model.safetensors.index.json``.
    Tensors may be float32, float64, float16 or bfloat16 (the dtypes checkpoints are
    published in); float16 and bfloat16 weights are up-cast exactly (every value of those
    formats is a float32 value) and the model runs in ``dtype`` (float32 or float64).
    ``config["source_dtype"]`` names the stored dtype(s), e.g. ``"bfloat16"``.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face save_pretrained folder")
    hf_config = read_json(cfg_path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(s, str) and s == os.path.basename(s) and s not in ("", ".", "..")
                for s in weight_map.values()):
            raise ValueError(f"{index}: field 'weight_map': expected a non-empty mapping of tensor "
                             f"names to shard file names in the same folder")
        files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    else:
        other = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
        raise FileNotFoundError(f"{path}: no model.safetensors (or index); "
                                + (f"found {other}: re-save with safe_serialization=True" if other else
                                   "expected the safetensors layout of save_pretrained"))
    tensors: dict[str, np.ndarray] = {}
    stored = set()
    for fname in files:
        part, _ = checkpoint.load(fname, require_checksum=False)
        stored |= set(_stored_dtypes(fname))
        for key, a in part.items():
            if a.dtype.kind != "f":
                raise ValueError(f"{fname}: tensor {key!r}: field 'dtype': {a.dtype} is not a float "
                                 f"dtype (F16, BF16, F32 or F64); mamba_ext never converts integers "
                                 f"to weights")
            if key in tensors:
                raise ValueError(f"{fname}: tensor {key!r} is also in another shard")
            tensors[key] = a
    params, cfg = params_from_hf(tensors, hf_config, dtype=dtype)
    cfg["source_dtype"] = ",".join(sorted(stored))
    return params, cfg


_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def _stored_dtypes(fname: str) -> list[str]:
    """Names of the float dtypes in a safetensors header (already checked by load)."""
    with open(fname, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return [_DTYPE_NAMES[e["dtype"]] for k, e in header.items()
            if k != "__metadata__" and e["dtype"] in _DTYPE_NAMES]


def load_tokenizer(path: StrPath) -> Any:
    """The ``tokenizers.Tokenizer`` of a Hugging Face folder (its ``tokenizer.json``);
    needs the ``tokenizers`` package."""
    fname = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(fname):
        raise FileNotFoundError(f"{path}: no tokenizer.json (the tokenizer of the checkpoint)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("reading tokenizer.json needs the 'tokenizers' package "
                          "(pip install tokenizers)") from None
    text = read_regular(fname, "tokenizer.json", limit=1 << 30)
    try:
        return Tokenizer.from_str(text.decode("utf-8"))
    except Exception as e:       # tokenizers raises its own Exception type
        raise ValueError(f"{fname}: not a tokenizer the 'tokenizers' package reads ({e})") from None


def text_ids(text: bytes | str, tokenizer: Any = None) -> np.ndarray:
    """Token ids (int64) of ``text``: its bytes for a byte-level model (``tokenizer``
    None; an empty text is one newline), else its ids under a ``tokenizers.Tokenizer``.
    Bytes that are not valid UTF-8 become U+FFFD for a tokenizer (it takes text); a text
    the vocabulary cannot encode (a WordLevel model without an unknown token) raises one
    clear ValueError."""
    if tokenizer is None:
        raw = text.encode("utf-8", errors="surrogateescape") if isinstance(text, str) else text
        return np.frombuffer(raw or b"\n", np.uint8).astype(np.int64)
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        return np.asarray(tokenizer.encode(text).ids, np.int64)
    except Exception as e:      # tokenizers raises its own Exception type
        raise ValueError(f"the tokenizer cannot encode {text[:40]!r}: "
                         f"{' '.join(str(e).split()) or type(e).__name__} (a vocabulary "
                         f"without an unknown token such as [UNK]?)") from None


def read_json(fname: str) -> dict[str, Any]:
    """A JSON object from a file: one ValueError naming the file when it is not one."""
    try:
        value = checkpoint.strict_json(read_regular(fname, "a JSON file", limit=1 << 26)
                                       .decode("utf-8"), fname)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{fname}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{fname}: expected a JSON object, got {type(value).__name__}")
    return value


SAVE_DTYPES = {"float32": ("F32", "float32"), "float16": ("F16", "float16"),
               "bfloat16": ("BF16", "bfloat16")}
INDEX_NAME = "model.safetensors.index.json"


def _export(name: str, a: np.ndarray, dtype: str) -> np.ndarray:
    """One tensor in the exported dtype; float16 refuses values it cannot hold."""
    if dtype == "bfloat16":
        return checkpoint.to_bfloat16(a)
    if dtype == "float16":
        big = np.abs(a).max(initial=0.0)
        if big > np.finfo(np.float16).max:
            raise ValueError(f"{name}: |values| up to {big:.4g} exceed float16's largest value "
                             f"{np.finfo(np.float16).max:g}; export as bfloat16 or float32")
        return a.astype(np.float16)
    return a.astype(np.float32)


def save_hf(path: StrPath, params: Mapping[str, ArrayLike], config: Mapping[str, Any],
            approximate_discretization: bool = False, *, dtype: str = "float32",
            max_shard_size: int | None = None, tokenizer: StrPath | None = None) -> dict[str, Any]:
    """Write a folder that ``MambaForCausalLM.from_pretrained`` loads; returns the HF config.

    ``config.json`` and the weights in ``dtype``: ``"float32"`` (default), ``"float16"``
    (refused if a value exceeds its range) or ``"bfloat16"`` (round to nearest even);
    ``config.json`` records it as ``torch_dtype``. ``max_shard_size`` (bytes): when the
    weights are larger, they go to ``model-0000i-of-0000n.safetensors`` shards (whole tensors,
    in key order, each shard at most that size unless one tensor alone is larger) listed in
    ``model.safetensors.index.json`` (the layout of ``save_pretrained``); otherwise to one
    ``model.safetensors``. The files of the other layout left by an earlier save are removed.
    ``tokenizer``: a folder whose ``tokenizer.json`` is copied along (e.g. the checkpoint a
    model was fine-tuned from). Files are written atomically; the folder is created if needed.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    if max_shard_size is not None:
        max_shard_size = check_size("max_shard_size", max_shard_size)
    tok_text = None
    if tokenizer is not None:
        load_tokenizer(tokenizer)            # refuse a missing or unreadable one before writing
        tok_text = read_regular(os.path.join(os.fspath(tokenizer), "tokenizer.json"),
                                "tokenizer.json", limit=1 << 30)
    tensors, hf_config = params_to_hf(params, config, approximate_discretization)
    hf_config["torch_dtype"] = SAVE_DTYPES[dtype][1]
    out = {k: _export(k, np.asarray(v), dtype) for k, v in tensors.items()}
    os.makedirs(path, exist_ok=True)
    total = sum(a.nbytes for a in out.values())
    shards: list[list[str]] = [[]]
    if max_shard_size is not None and total > max_shard_size:
        size = 0
        for k in out:
            if shards[-1] and size + out[k].nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(k)
            size += out[k].nbytes
    else:
        shards[0] = list(out)
    _remove_layout(path)
    if len(shards) == 1:
        checkpoint.save(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
    else:
        weight_map = {}
        for i, keys in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            checkpoint.save(os.path.join(path, name), {k: out[k] for k in keys}, {"format": "pt"})
            weight_map.update({k: name for k in keys})
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        checkpoint.atomic_write(os.path.join(path, INDEX_NAME), lambda f: f.write(index.encode()))
    text = json.dumps(hf_config, indent=2).encode("utf-8")
    checkpoint.atomic_write(os.path.join(path, "config.json"), lambda f: f.write(text))
    if tok_text is not None:
        checkpoint.atomic_write(os.path.join(path, "tokenizer.json"), lambda f: f.write(tok_text))
    return hf_config


def _remove_layout(path) -> None:
    """Remove the weight files of an earlier save_hf into ``path`` (one file or shards), so
    that the folder holds exactly one layout."""
    import re
    shard = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors\Z")
    for name in os.listdir(path):
        if name in ("model.safetensors", INDEX_NAME) or shard.match(name):
            os.unlink(os.path.join(path, name))
