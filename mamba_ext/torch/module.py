"""``Mamba``: mamba_ssm's ``Mamba`` layer (constructor arguments, parameter names, forward
and step) on mamba_ext's CPU kernels, so that state dicts move both ways.

Size letters: B batch, L seqLen, Dm d_model, D d_inner = expand * d_model, N d_state,
K d_conv, R dt_rank.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mamba_ext.torch.functions import (
    mamba_inner_with_state,
    causal_conv1d_update,
    mamba_inner_fn,
    selective_state_update,
)

__all__ = ["Mamba"]


class Mamba(nn.Module):
    """A Mamba-1 mixer layer: (B, L, Dm) -> (B, L, Dm).

    Parameters (names and shapes of mamba_ssm's ``Mamba``): in_proj (2D, Dm), conv1d
    (D, 1, K), x_proj (R + 2N, D), dt_proj (D, R) with bias (D,), A_log (D, N), D (D,),
    out_proj (Dm, D). The initialisation follows mamba_ssm (S4D-real A, dt in
    [dt_min, dt_max] through the inverse softplus of dt_proj's bias). ``use_fast_path`` is
    accepted for compatibility; every path here is ours.
    """

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001,
                 dt_max=0.1, dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True,
                 bias=False, use_fast_path=True, layer_idx=None, device=None, dtype=None):
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: mamba_ext.torch.Mamba runs on the CPU, got {device!r}")
        for name, v in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        if dt_init not in ("random", "constant"):
            raise ValueError(f"dt_init: expected 'random' or 'constant', got {dt_init!r}")
        kw = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        D, R, N = self.d_inner, self.dt_rank, d_state
        self.in_proj = nn.Linear(d_model, 2 * D, bias=bias, **kw)
        self.conv1d = nn.Conv1d(D, D, d_conv, groups=D, padding=d_conv - 1, bias=conv_bias, **kw)
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(D, R + 2 * N, bias=False, **kw)
        self.dt_proj = nn.Linear(R, D, bias=True, **kw)
        std = R ** -0.5 * dt_scale
        with torch.no_grad():
            if dt_init == "constant":
                nn.init.constant_(self.dt_proj.weight, std)
            else:
                nn.init.uniform_(self.dt_proj.weight, -std, std)
            dt = torch.exp(torch.rand(D, **kw) * (math.log(dt_max) - math.log(dt_min))
                           + math.log(dt_min)).clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))   # inverse softplus
        self.dt_proj.bias._no_reinit = True
        A = torch.arange(1, N + 1, dtype=torch.float32, device=device).repeat(D, 1)
        self.A_log = nn.Parameter(torch.log(A).to(dtype or torch.get_default_dtype()))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(D, **kw))
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(D, d_model, bias=bias, **kw)

    def forward(self, hidden_states, inference_params=None):
        """hidden_states (B, L, Dm) -> (B, L, Dm). With mamba_ssm's ``inference_params``
        (``key_value_memory_dict``, ``seqlen_offset``), a call with seqlen_offset > 0 is a
        recurrent step and the prefill keeps the conv and scan states for it."""
        if hidden_states.dim() != 3 or hidden_states.shape[2] != self.d_model:
            raise ValueError(f"hidden_states: expected (B, L, {self.d_model}), "
                             f"got {tuple(hidden_states.shape)}")
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._states(inference_params, hidden_states.shape[0])
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(hidden_states, conv_state, ssm_state)
                return out
        xz = self.in_proj(hidden_states).transpose(1, 2)                 # (B, 2D, L)
        A = -torch.exp(self.A_log.float())
        if conv_state is None:
            return mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                                  self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias,
                                  A, None, None, self.D.float(), delta_bias=self.dt_proj.bias.float(),
                                  delta_softplus=True)
        # prefill: the same maths, keeping the last K inputs of the conv and the last state
        K = self.d_conv
        x = xz[:, :self.d_inner]
        with torch.no_grad():
            conv_state.copy_(nn.functional.pad(x, (K - x.shape[2], 0)) if x.shape[2] < K
                             else x[:, :, -K:])
        out, last = mamba_inner_with_state(
            xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
            self.out_proj.weight, self.out_proj.bias, A, None, None, self.D.float(),
            self.dt_proj.bias.float(), None, None, True, True)
        with torch.no_grad():
            ssm_state.copy_(last)
        return out

    def step(self, hidden_states, conv_state, ssm_state):
        """One token: hidden_states (B, 1, Dm); conv_state (B, D, K) and ssm_state (B, D, N)
        updated in place. Returns (out (B, 1, Dm), conv_state, ssm_state)."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"hidden_states: a step takes (B, 1, Dm), got {tuple(hidden_states.shape)}")
        xz = self.in_proj(hidden_states[:, 0])                            # (B, 2D)
        x, z = xz.chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias, "silu")
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = dt @ self.dt_proj.weight.t()
        A = -torch.exp(self.A_log.float())
        y = selective_state_update(ssm_state, x, dt, A, B, C, self.D.float(), z=z,
                                   dt_bias=self.dt_proj.bias.float(), dt_softplus=True)
        return self.out_proj(y)[:, None], conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen=None, dtype=None, **kwargs):
        """(conv_state (B, D, K), ssm_state (B, D, N)), zeros, as mamba_ssm allocates them."""
        dt = dtype or self.out_proj.weight.dtype
        return (torch.zeros(batch_size, self.d_inner, self.d_conv, dtype=dt),
                torch.zeros(batch_size, self.d_inner, self.d_state, dtype=dt))

    def _states(self, inference_params, batch_size):
        if self.layer_idx is None:
            raise ValueError("layer_idx: a Mamba used with inference_params needs a layer_idx")
        states = inference_params.key_value_memory_dict
        if self.layer_idx not in states:
            states[self.layer_idx] = self.allocate_inference_cache(batch_size)
        conv_state, ssm_state = states[self.layer_idx]
        if inference_params.seqlen_offset == 0:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state
