"""``use_in_transformers(model)``: a transformers Mamba-1 model on mamba_ext's CPU kernels.

transformers routes ``MambaMixer.forward`` through five module-level functions
(``mamba_inner_fn``, ``mamba_selective_scan``, ``mamba_selective_state_update``,
``causal_conv1d_fn``, ``causal_conv1d_update`` in ``models/mamba/modeling_mamba.py``).
Its kernel mechanism (``use_kernel_func_from_hub_with_fallback``) chooses among Hub kernels
(the ``kernels`` package, CUDA builds), an installed mamba_ssm / causal-conv1d, and that
module's torch code, once, when the module is imported; it has no place for a CPU kernel
given at run time, and replacing the module's functions would change every model of the
process. So the patch is scoped to the model: each ``MambaMixer`` of it gets an instance
``forward`` (:func:`_mixer_forward`) with the same steps as transformers' own, calling our
functions. The class, the module and other models are untouched; :func:`restore` undoes it.
"""
from __future__ import annotations

import types

import torch

from mamba_ext.cpu.recurrent import mixer_step_arrays
from mamba_ext.torch import functions as _f

__all__ = ["use_in_transformers", "restore"]


def _mask(hidden_states, attention_mask):
    # transformers' apply_mask_to_padding_states: zero the padding positions
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _A(mixer):
    """A = -exp(A_log) in float32, as transformers computes it; without autograd, kept
    between calls while A_log is unchanged (a decode step would otherwise spend ~1 ms per
    token of a 24-layer model on it)."""
    if torch.is_grad_enabled():
        return -torch.exp(mixer.A_log.float())
    key = (mixer.A_log.data_ptr(), mixer.A_log._version, mixer.A_log.dtype)
    kept = mixer.__dict__.get("_mamba_ext_A")
    if kept is None or kept[0] != key:
        kept = (key, -torch.exp(mixer.A_log.detach().float()))
        mixer.__dict__["_mamba_ext_A"] = kept
    return kept[1]


def _decode_layer(mixer):
    """The mixer's weights as mamba_ext.cpu.recurrent's LAYER_ARRAYS (NumPy views of the
    parameters where the layout is the same; the conv taps reversed to lag order, zeros for
    absent biases, A = -exp(A_log) in float32 as transformers computes it, 1/A), kept while
    no parameter changes; None when a parameter is not C-contiguous float32/float64 of
    one dtype."""
    m = mixer
    params = [p for p in (m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias,
                          m.x_proj.weight, m.x_proj.bias, m.dt_proj.weight, m.dt_proj.bias,
                          m.A_log, m.D, m.out_proj.weight, m.out_proj.bias) if p is not None]
    key = tuple([(id(p), p.data_ptr(), p._version) for p in params])
    kept = mixer.__dict__.get("_mamba_ext_layer")
    if kept is not None and kept[0] == key:
        return kept[1]
    dt = mixer.in_proj.weight.dtype
    if dt not in (torch.float32, torch.float64) or any(p.dtype != dt for p in params):
        return None

    def a(t):
        return t.detach().contiguous().numpy()

    D, Dm = mixer.intermediate_size, mixer.hidden_size
    P = mixer.time_step_rank + 2 * mixer.ssm_state_size
    zeros = lambda n: torch.zeros(n, dtype=dt).numpy()    # noqa: E731
    bias = lambda lin, n: a(lin.bias) if lin.bias is not None else zeros(n)    # noqa: E731
    A = (-torch.exp(mixer.A_log.detach().float())).to(dt)
    layer = (a(mixer.in_proj.weight), bias(mixer.in_proj, 2 * D), a(mixer.conv1d.weight[:, 0].flip(-1)),
             a(mixer.conv1d.bias) if mixer.use_conv_bias else zeros(D), a(mixer.x_proj.weight),
             bias(mixer.x_proj, P), a(mixer.dt_proj.weight), bias(mixer.dt_proj, D), a(A), a(1 / A),
             a(mixer.D), a(mixer.out_proj.weight), bias(mixer.out_proj, Dm), zeros(Dm))
    mixer.__dict__["_mamba_ext_layer"] = (key, layer, params)   # params: kept alive with their ids
    return layer


def _decode_step(mixer, hidden_states, conv_state, recurrent_state):
    """One generated token through the mixer as one compiled call (mamba_ext.cpu.recurrent's
    per-layer step: in_proj, conv step, x_proj, dt_proj, scan step, gate, out_proj), when
    autograd is off and the states are C-contiguous of the weights' dtype; else None (the
    caller takes the general path). conv_state (B, D, K) and recurrent_state (B, D, N) are
    advanced in place as transformers' own step advances them."""
    if torch.is_grad_enabled() or mixer.conv_kernel_size < 2:
        return None
    layer = _decode_layer(mixer)
    if layer is None:
        return None
    dt = mixer.in_proj.weight.dtype
    if (recurrent_state.dtype != dt or conv_state.dtype != dt or not recurrent_state.is_contiguous()
            or not conv_state.is_contiguous() or hidden_states.dtype != dt):
        return None
    xn = hidden_states[:, 0].contiguous()                                 # (B, Dm)
    out = torch.empty_like(xn)
    # conv_state (B, D, K), the last K inputs oldest first, is the step's tail as it is
    mixer_step_arrays(out.numpy(), xn.numpy(), layer, recurrent_state.numpy(), conv_state.numpy(),
                      False, torch.get_num_threads())
    return out[:, None]


def _mixer_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None,
                   **kwargs):
    """MambaMixer.forward (transformers 5.x) on mamba_ext's kernels: hidden_states
    (B, L, Dm) -> (B, L, Dm); the cache's conv (B, D, K) and recurrent (B, D, N) states are
    read and written as transformers does."""
    cache = cache if cache is not None else cache_params
    seq_len, dtype = hidden_states.shape[1], hidden_states.dtype
    conv_state = recurrent_state = None
    if cache is not None:
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    hidden_states = _mask(hidden_states, attention_mask)
    act = self.activation if self.activation in ("silu", "swish") else None
    if (conv_state is not None and recurrent_state is not None and seq_len == 1
            and act is not None and not cache.is_recording_past(self.layer_idx)):
        out = _decode_step(self, hidden_states, conv_state, recurrent_state)
        if out is not None:
            return out
    xz = self.in_proj(hidden_states).transpose(1, 2)                      # (B, 2D, L)
    A = _A(self)
    fused = (self.training and cache is None and act is not None
             and (attention_mask is None or bool(attention_mask.all())))
    if fused:
        return _f.mamba_inner_fn(
            xz, self.conv1d.weight, self.conv1d.bias if self.use_conv_bias else None,
            self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight,
            self.out_proj.bias.float() if self.use_bias else None, A, None, None, self.D.float(),
            delta_bias=self.dt_proj.bias.float(), delta_softplus=True).to(dtype)
    x, gate = xz.chunk(2, dim=1)                                          # (B, D, L) each
    weight = self.conv1d.weight.squeeze(1)
    bias = self.conv1d.bias if self.use_conv_bias else None
    if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
        x = _f.causal_conv1d_update(x, conv_state, weight, bias, activation=act)
    else:
        if cache is not None:
            x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        x = _f.causal_conv1d_fn(x, weight, bias, activation=act)
        if cache is not None:
            x = x[:, :, -seq_len:]
    if act is None:
        x = self.act(x)
    x = _mask(x.transpose(1, 2), attention_mask)                          # (B, L, D)
    dt, B, C = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size,
                                            self.ssm_state_size], dim=-1)
    dt = self.dt_proj.weight @ dt.transpose(1, 2)                         # (B, D, L)
    dt_bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None
    if recurrent_state is not None and seq_len == 1:
        y = _f.selective_state_update(recurrent_state, x[:, 0], dt[..., 0], A, B[:, 0], C[:, 0],
                                      self.D, z=gate[..., 0], dt_bias=dt_bias,
                                      dt_softplus=True)[..., None]
    else:
        y = _f.selective_scan_fn(x.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2),
                                 D=self.D.float(), z=gate, delta_bias=dt_bias, delta_softplus=True,
                                 return_last_state=cache is not None)
        if cache is not None:
            y, last = y
            cache.update_recurrent_state(last.to(recurrent_state.dtype if recurrent_state is not None
                                                 else last.dtype), self.layer_idx)
    return self.out_proj(y.transpose(1, 2).to(dtype))


def _mixers(model):
    try:
        from transformers.models.mamba.modeling_mamba import MambaMixer
    except ImportError as e:    # pragma: no cover - transformers is what this is for
        raise ImportError("use_in_transformers needs transformers (pip install transformers)") from e
    return [m for m in model.modules() if isinstance(m, MambaMixer)]


def use_in_transformers(model):
    """Make a transformers ``MambaForCausalLM`` / ``MambaModel`` on the CPU run its mixers
    on mamba_ext's kernels, for training (forward + backward) and ``generate`` (prefill and
    per-token step). Scoped to this model (see the module's note). Returns the model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a transformers Mamba model, got {type(model).__name__}")
    mixers = _mixers(model)
    if not mixers:
        raise ValueError(f"model: no MambaMixer found in this {type(model).__name__} "
                         "(expected a transformers MambaForCausalLM or MambaModel)")
    for p in model.parameters():
        if p.device.type != "cpu":
            raise ValueError(f"model: mamba_ext's kernels run on the CPU; a parameter is on "
                             f"{p.device} (use mamba_ssm's CUDA kernels there, or model.cpu())")
        if p.dtype not in _f._FLOATS:
            raise TypeError(f"model: expected floating parameters (float32, float64, float16 "
                            f"or bfloat16), got {p.dtype}")
    for m in mixers:
        m.forward = types.MethodType(_mixer_forward, m)
    model._mamba_ext_patched = True
    return model


def restore(model):
    """Undo :func:`use_in_transformers`: the mixers use transformers' own forward again."""
    for m in _mixers(model):
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_mamba_ext_A", None)
        m.__dict__.pop("_mamba_ext_layer", None)
    model.__dict__.pop("_mamba_ext_patched", None)
    return model
