"""mamba_ext for PyTorch users (extra ``[torch]``): the CPU kernels behind mamba_ssm's API
and transformers' Mamba (docs/torch.md).

    from mamba_ext.torch import selective_scan_fn, mamba_inner_fn, Mamba, use_in_transformers

- ``selective_scan_fn``, ``mamba_inner_fn``, ``selective_state_update`` (mamba_ssm) and
  ``causal_conv1d_fn``, ``causal_conv1d_update`` (causal-conv1d): the same signatures,
  layouts and meanings, differentiable, float32/float64 CPU tensors (functions.py).
- ``Mamba``: mamba_ssm's layer, same constructor and parameter names (module.py).
- ``use_in_transformers(model)``: a transformers ``MambaForCausalLM`` / ``MambaModel`` on
  our kernels for training and ``generate`` (hf.py).

``import mamba_ext`` never imports torch; this subpackage does.
"""
from mamba_ext.torch.functions import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_inner_fn,
    selective_scan_fn,
    selective_state_update,
)
from mamba_ext.torch.hf import restore, use_in_transformers
from mamba_ext.torch.module import Mamba

__all__ = ["selective_scan_fn", "mamba_inner_fn", "selective_state_update", "causal_conv1d_fn",
           "causal_conv1d_update", "Mamba", "use_in_transformers", "restore"]
