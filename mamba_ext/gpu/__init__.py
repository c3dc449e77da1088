"""mamba_ext.gpu — the Mamba-1 block and model on any GPU, through WGSL kernels
run by wgpu (Vulkan, Metal, DirectX 12; lavapipe in CI).

Public API (float32 NumPy arrays in and out, validated like the CPU API):

- ``mamba1_forward(x, params, *, eps=1e-6, discretization="zoh")`` -> ``(out, cache)``
- ``mamba1_backward(dout, params, cache)`` -> ``(dx, grads)``
- ``model_forward(tokens, params, *, eps=1e-6, discretization="zoh")`` -> logits (B, L, V)
- ``model_loss_and_grads(tokens, targets, params, *, eps=1e-6, discretization="zoh",
  checkpointing=False)`` -> ``(loss, grads)``
- ``ResidentTrainer(params, lr=1e-3, ..., model_eps=1e-6, discretization="zoh",
  checkpointing=False, scaler=None)``: weights and AdamW state resident on the GPU
  (``scaler``: a ``mamba_ext.amp.DynamicLossScaler`` for mixed precision);
  ``.step(tokens, targets) -> float``, ``.step_async(tokens, targets) -> PendingStep``
  (``.result() -> float``; the next step may be submitted before it is read back),
  ``.params() -> dict``
- ``available()`` -> bool: wgpu is installed and finds an adapter.

Modules mirror ``mamba_ext/cpu/`` (one per step, each dispatching
``kernels/<same name>.wgsl``): ``rmsnorm``, ``linear``, ``conv1d``, ``scan``,
``activations``, ``block``, ``model``, ``adamw``, ``amp``, ``recurrent``; plus ``device`` (adapter,
pipeline cache, buffers) and ``trainer`` (``ResidentTrainer``).

Nothing touches wgpu until first use; a missing adapter raises RuntimeError
saying how to get one.
"""
import importlib

_EXPORTS = {
    "mamba1_forward": "block", "mamba1_backward": "block", "GpuBlockCache": "block",
    "model_loss_and_grads": "model", "model_forward": "model", "ResidentTrainer": "trainer",
    "available": "device",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'mamba_ext.gpu' has no attribute {name!r}")
    value = getattr(importlib.import_module("." + mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
