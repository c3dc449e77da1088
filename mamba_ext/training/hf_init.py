"""Fine-tuning a Hugging Face Mamba checkpoint: ``train --init-from PATH``.

``PATH`` is a ``save_pretrained`` folder (config.json, model.safetensors or shards,
tokenizer.json). The run takes from it:

* the model: every size (vocab, d_model, n_layers, d_state, d_conv, expand, dt_rank), the
  RMSNorm eps, Euler discretization (what transformers computes) and the weights
  (``mamba_ext.io.hf.load_hf``; float16/bfloat16 up-cast to float32);
* the tokenizer: the corpus file (``--data``, UTF-8 text) becomes the token ids of the
  checkpoint's ``tokenizer.json`` (``tokenizers`` package), so batches are windows of ids.

Two parameters of our model have no Hugging Face counterpart, ``lm_head_bias`` and every
``layer{i}.bXProj``; they stay frozen at 0 (their gradients are zeroed before the optimizer
step) so that the result can be exported. At the end the run writes ``OUT/hf/``: a folder
that ``MambaForCausalLM.from_pretrained`` loads, with the tokenizer copied along.
"""
from __future__ import annotations

import os

import numpy as np

from ..io.files import read_regular
from ..io.hf import load_hf, load_tokenizer, save_hf

HF_DIR = "hf"          # OUT/hf: the exported folder of a run started with --init-from


def config_from_hf(cfg):
    """``cfg`` (a TrainConfig with ``init_from``) with the model fields of the checkpoint."""
    from ..io.hf import hf_dims, read_json      # the sizes only: config.json, no weights
    fname = os.path.join(cfg.init_from, "config.json")
    if not os.path.isfile(fname):
        raise FileNotFoundError(f"{cfg.init_from}: no config.json; expected a Hugging Face "
                                f"save_pretrained folder")
    hc = hf_dims(read_json(fname))
    if hc["d_inner"] % hc["d_model"]:
        raise ValueError(f"{cfg.init_from}: d_inner {hc['d_inner']} is not a multiple of d_model "
                         f"{hc['d_model']}")
    cfg.vocab_size, cfg.d_model, cfg.n_layers = hc["vocab_size"], hc["d_model"], hc["n_layers"]
    cfg.d_state, cfg.d_conv, cfg.expand = hc["d_state"], hc["d_conv"], hc["d_inner"] // hc["d_model"]
    cfg.dt_rank, cfg.eps, cfg.discretization = hc["dt_rank"], hc["eps"], hc["discretization"]
    return cfg


def initial_params(cfg) -> dict[str, np.ndarray]:
    """The checkpoint's weights as float32 params."""
    params, _ = load_hf(cfg.init_from)
    return params


def corpus_tokens(cfg, max_bytes: int) -> np.ndarray:
    """The token ids (int64) of the corpus file under the checkpoint's tokenizer."""
    if cfg.data is None:
        raise ValueError("--init-from needs --data PATH: a text file to fine-tune on")
    text = read_regular(cfg.data, "the corpus (--data)", max_bytes=max_bytes).decode(
        "utf-8", errors="replace")
    ids = np.asarray(load_tokenizer(cfg.init_from).encode(text).ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise ValueError(f"{cfg.init_from}: the tokenizer gives ids up to {int(ids.max())}, outside "
                         f"the checkpoint's vocab_size {cfg.vocab_size}")
    return ids


def frozen_names(params) -> list[str]:
    """Parameters without a Hugging Face counterpart: kept at 0 while fine-tuning."""
    return [k for k in params if k == "lm_head_bias" or k.endswith(".bXProj")]


def write_hf(out_dir, cfg, params) -> str:
    """Export the fine-tuned model (with the checkpoint's tokenizer) to ``out_dir/hf``."""
    path = os.path.join(out_dir, HF_DIR)
    save_hf(path, params, {"eps": cfg.eps, "discretization": cfg.discretization},
            tokenizer=cfg.init_from)
    return path
