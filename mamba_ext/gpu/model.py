"""The small Mamba-1 language model on the GPU: loss and gradients, and the
resident AdamW trainer.

embedding -> n_layers blocks -> final RMSNorm -> tied LM head (+ lm_head_bias)
-> mean cross-entropy (docs/semantics.md). Parameters, gradients and
AdamW moments each live in ONE flat GPU buffer (an "arena"; tensors with weight
decay first), so grad-norm and AdamW are single dispatches over the arena. A
training step is one command buffer with one compute pass (forward, backward,
grad norm, AdamW) and two small read-backs (per-row losses, grad stats).

Size letters: B batch, L seqLen, Dm dModel, V vocab, M = B*L.
"""
from __future__ import annotations

import math

import numpy as np

from .._validate import BLOCK_PARAM_NAMES, check_tokens
from .block import require_float32
from .device import gpu
from .layers import BlockLayer, Scratch, arena_layout, elementwise, gemm, reduce_cols

# Weight decay is off for these (after any "layerN." prefix), as mamba_ext.AdamW's default.
DEFAULT_NO_DECAY = frozenset({"A_log", "D_vec", "bInProj", "bConv", "bXProj", "bDtProj",
                              "bOutProj", "lm_head_bias", "normWeight", "final_norm"})


def _decays(name, no_decay):
    """The rule of mamba_ext.AdamW: no decay when ``name`` equals an entry or
    ends with "." + entry."""
    return not any(name == e or name.endswith("." + e) for e in no_decay)


def _check_model(params):
    from ..model import check_model_params
    if isinstance(params, dict):
        for k, v in params.items():
            require_float32(k, v)
    arrays, dims = check_model_params(params, np.float32)
    return arrays, dims


class _ModelPlan:
    """Buffers and recorded ops of the model for one (layout, B, L)."""

    def __init__(self, arrays, dims, B, L, order, w=None, gr=None, eps=1e-6):
        g = gpu()
        self.order = order
        self.offs, self.n = arena_layout([(k, arrays[k].shape) for k in order])
        V, Dm = arrays["embedding"].shape
        M = B * L
        self.B, self.L, self.V, self.Dm, self.M = B, L, V, Dm, M
        self.w = w if w is not None else g.buffer(self.n, "params")
        self.gr = gr if gr is not None else g.buffer(self.n, "grads")
        u32 = lambda n, name: g.buffer(n, name)
        self.tok, self.tgt, self.pos = u32(M, "tokens"), u32(M, "targets"), u32(M, "positions")
        self.csr = u32(V + 1, "id_offsets")
        nl = dims.n_layers
        self.h = [g.buffer(M * Dm, f"h{i}") for i in range(nl + 1)]
        self.fxn, self.finv = g.buffer(M * Dm, "final_xn"), g.buffer(M, "final_inv")
        self.fdxn, self.fgw = g.buffer(M * Dm, "final_dxn"), g.buffer(M * Dm, "final_gw")
        self.logits, self.dlogits = g.buffer(M * V, "logits"), g.buffer(M * V, "dlogits")
        self.losses = g.buffer(M, "losses")
        self.dh = [g.buffer(M * Dm, "dh_a"), g.buffer(M * Dm, "dh_b")]
        o, w, gr = self.offs, self.w, self.gr
        ops = [elementwise(g, "embedding", "embedding_forward", M * Dm, [M * Dm, Dm, o["embedding"]],
                           [self.tok, w, self.h[0]])]
        self.layers = []
        if nl:
            scratch = Scratch(g, dims.block, B, L, _chunk())
            for i in range(nl):
                lo = {n: o[f"layer{i}.{n}"] for n in BLOCK_PARAM_NAMES}
                lay = BlockLayer(g, dims.block, B, L, w, gr, lo, self.h[i], self.h[i + 1],
                                 scratch, eps)
                self.layers.append(lay)
                ops += lay.forward_ops()
        E = o["embedding"]
        ops += [
            g.op("rmsnorm", "rmsnorm_forward", g.grid1d(M, "rmsnorm rows"),
                 [M, Dm, o["final_norm"], float(eps)], [self.h[nl], w, self.fxn, self.finv]),
            # logits (M, V) = xn @ embedding^T + lm_head_bias (tied head)
            gemm(g, M, V, Dm, self.fxn, 0, Dm, 1, w, E, 1, Dm, self.logits, 0, V,
                 bias=w, bias_off=o["lm_head_bias"]),
            g.op("cross_entropy", "cross_entropy_forward_backward", g.grid1d(M, "cross-entropy rows"),
                 [M, V, 1.0 / M], [self.logits, self.tgt, self.dlogits, self.losses]),
            # head backward: dxn = dlogits @ embedding; dE += dlogits^T xn; dbias
            gemm(g, M, Dm, V, self.dlogits, 0, V, 1, w, E, Dm, 1, self.fdxn, 0, Dm),
            gemm(g, V, Dm, M, self.dlogits, 0, 1, V, self.fxn, 0, Dm, 1, gr, E, Dm, beta=1),
            reduce_cols(g, M, V, self.dlogits, 0, V, gr, o["lm_head_bias"]),
            g.op("rmsnorm", "rmsnorm_backward", g.grid1d(M, "rmsnorm rows"),
                 [M, Dm, o["final_norm"], float(eps)],
                 [self.h[nl], w, self.fdxn, self.finv, self.dh[0], self.fgw]),
            reduce_cols(g, M, Dm, self.fgw, 0, Dm, gr, o["final_norm"]),
        ]
        cur = 0
        for lay in reversed(self.layers):
            ops += lay.backward_ops(self.dh[cur], self.dh[1 - cur])
            cur = 1 - cur
        ops.append(elementwise(g, "embedding", "embedding_backward", V * Dm, [V * Dm, Dm, E],
                               [self.csr, self.pos, self.dh[cur], gr]))
        self.ops = ops
        self.clears = [gr, self.dh[0]]

    def upload_batch(self, tok, tgt):
        g = gpu()
        flat = tok.ravel()
        g.write(self.tok, flat.astype(np.uint32))
        g.write(self.tgt, tgt.ravel().astype(np.uint32))
        order = np.argsort(flat, kind="stable").astype(np.uint32)
        offs = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.V))]).astype(np.uint32)
        g.write(self.pos, order)
        g.write(self.csr, offs)

    def loss(self):
        return float(np.mean(gpu().read(self.losses, self.M).astype(np.float64)))

    def read_tensors(self, buf, arrays):
        flat = gpu().read(buf, self.n)
        return {k: flat[self.offs[k]:self.offs[k] + a.size].reshape(a.shape).copy()
                for k, a in arrays.items()}


def _chunk():
    from . import layers
    return layers.SCAN_CHUNK


def _check_batch(tokens, targets, V):
    tok = check_tokens("tokens", tokens, V)
    tgt = check_tokens("targets", targets, V, shape=tok.shape)
    if tok.size == 0:
        raise ValueError(f"tokens: shape {tok.shape} has no positions; the mean cross-entropy "
                         f"needs batch >= 1 and seqLen >= 1")
    return tok, tgt


_PLANS = {}


def model_loss_and_grads(tokens, targets, params, *, eps=1e-6):
    """Mean cross-entropy (float, summed in float64) and float32 gradients of
    every parameter, computed on the GPU; keys and shapes like ``params``."""
    arrays, dims = _check_model(params)
    tok, tgt = _check_batch(tokens, targets, arrays["embedding"].shape[0])
    order = list(arrays)
    key = (tuple((k, arrays[k].shape) for k in order), tok.shape, float(eps), _chunk())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 4:
            _PLANS.clear()
        plan = _PLANS[key] = _ModelPlan(arrays, dims, *tok.shape, order, eps=eps)
    g = gpu()
    g.write(plan.w, np.concatenate([arrays[k].ravel() for k in order]))
    plan.upload_batch(tok, tgt)
    g.submit(plan.ops, plan.clears)
    return plan.loss(), plan.read_tensors(plan.gr, arrays)


class ResidentTrainer:
    """AdamW training with weights, gradients and moments resident on the GPU.

    Same maths as ``mamba_ext.AdamW`` (PyTorch AdamW, trust region
    ``max_delta``, per-element NaN guard); a step whose gradients hold any
    non-finite value is skipped entirely (weights, moments and step count
    untouched; counted in ``skipped``). ``clip`` > 0 clips the global gradient
    norm (computed on the GPU, reported as ``last_grad_norm``). One submit per
    step: forward, backward, grad norm and AdamW in one compute pass.
    ``state_dict()`` / ``load_state_dict()`` use ``mamba_ext.AdamW``'s format,
    so a run resumes exactly from a GPU or a CPU optimizer state.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 max_delta=0.0, no_decay=None, clip=0.0, model_eps=1e-6):
        self.arrays, self.dims = _check_model(params)
        no_decay = DEFAULT_NO_DECAY if no_decay is None else frozenset(no_decay)
        names = list(self.arrays)
        self.order = ([k for k in names if _decays(k, no_decay)]
                      + [k for k in names if not _decays(k, no_decay)])
        self.n_decay = sum(self.arrays[k].size for k in self.order if _decays(k, no_decay))
        self.lr, self.betas, self.eps = float(lr), tuple(map(float, betas)), float(eps)
        self.weight_decay, self.max_delta, self.clip = float(weight_decay), float(max_delta), float(clip)
        for name, v in (("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay),
                        ("max_delta", self.max_delta), ("clip", self.clip)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {betas}")
        self.model_eps = float(model_eps)
        g = gpu()
        self.offs, self.n = arena_layout([(k, self.arrays[k].shape) for k in self.order])
        self.w = g.buffer(self.n, "params", np.concatenate([self.arrays[k].ravel() for k in self.order]))
        self.gr = g.buffer(self.n, "grads")
        self.m = g.buffer(self.n, "adam_m")
        self.v = g.buffer(self.n, "adam_v")
        self.groups = math.ceil(self.n / (256 * 8))
        self.part = g.buffer(2 * self.groups, "sumsq_partials")
        self.stat = g.buffer(4, "grad_stats")
        self._opt_ops = [
            g.op("reduce", "sumsq_partial", g.grid1d(self.groups, "sumsq_partial"),
                 [self.n, self.groups], [self.gr, self.part]),
            g.op("reduce", "sumsq_final", (1, 1, 1), [self.n, self.groups], [self.part, self.stat]),
            elementwise(g, "adamw", "adamw_step", self.n, self._adam_params(1),
                        [self.w, self.m, self.v, self.gr, self.stat]),
        ]
        self._plans = {}
        self.t = 0
        self.skipped = 0
        self.nonfinite = 0      # carried in state_dict for AdamW compatibility (see state_dict)
        self.last_grad_norm = float("nan")

    def _adam_params(self, t):
        b1, b2 = self.betas
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
        return [self.n, self.n_decay, 1.0 - b1, b2, 1.0 - b2, self.lr * self.weight_decay,
                self.lr / bc1, math.sqrt(bc2), self.eps, self.max_delta, self.clip]

    def step(self, tokens, targets, reduce=None) -> float:
        """One training step; returns the mean cross-entropy before the update.

        ``reduce``: distributed hook (``mamba_ext.training.distributed``): the
        gradient arena is read back after the backward, passed as one flat
        float32 array to ``reduce(flat, loss, False) -> (flat, loss, _)``
        (all-reduced in place), written back, and grad norm + AdamW run in a
        second submit."""
        tok, tgt = _check_batch(tokens, targets, self.arrays["embedding"].shape[0])
        plan = self._plans.get(tok.shape)
        if plan is None:
            plan = self._plans[tok.shape] = _ModelPlan(self.arrays, self.dims, *tok.shape, self.order,
                                                       w=self.w, gr=self.gr, eps=self.model_eps)
        g = gpu()
        plan.upload_batch(tok, tgt)
        g.write_params(self._opt_ops[2], self._adam_params(self.t + 1))
        if reduce is None:
            g.submit(plan.ops + self._opt_ops, plan.clears)
            loss = plan.loss()
        else:
            g.submit(plan.ops, plan.clears)
            flat, loss, _ = reduce(g.read(self.gr, self.n), plan.loss(), False)
            g.write(self.gr, flat)
            g.submit(self._opt_ops)
        st = g.read(self.stat, 2)
        self.last_grad_norm = float(np.sqrt(np.float64(st[0])))
        if st[1] > 0:
            self.skipped += 1
            self.last_grad_norm = float("nan")
        else:
            self.t += 1
        return loss

    def _read(self, buf) -> dict:
        """One arena buffer copied back to the host, split per tensor (keys like the input)."""
        flat = gpu().read(buf, self.n)
        return {k: flat[self.offs[k]:self.offs[k] + a.size].reshape(a.shape).copy()
                for k, a in self.arrays.items()}

    def params(self) -> dict:
        """The current weights, copied back from the GPU (keys like the input)."""
        return self._read(self.w)

    def state(self) -> dict:
        """AdamW moments ``m.<name>``, ``v.<name>`` and the step count ``t``."""
        out = {"t": self.t, "skipped": self.skipped}
        for tag, buf in (("m", self.m), ("v", self.v)):
            out.update({f"{tag}.{k}": a for k, a in self._read(buf).items()})
        return out

    def state_dict(self) -> dict:
        """The optimizer state in the flat format of ``mamba_ext.AdamW.state_dict()``
        (so CPU and GPU checkpoints share it): float32 ``exp_avg.<name>`` and
        ``exp_avg_sq.<name>`` plus scalars ``step``, ``skipped``, ``nonfinite``,
        ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``max_delta``.
        The GPU kernel does not count per-element guard hits: ``nonfinite`` is
        the count carried over from a loaded state (0 otherwise)."""
        b1, b2 = self.betas
        out = {"step": self.t, "skipped": self.skipped, "nonfinite": self.nonfinite,
               "lr": self.lr, "beta1": b1, "beta2": b2, "eps": self.eps,
               "weight_decay": self.weight_decay, "max_delta": self.max_delta}
        for tag, buf in (("exp_avg", self.m), ("exp_avg_sq", self.v)):
            out.update({f"{tag}.{k}": a for k, a in self._read(buf).items()})
        return out

    def load_state_dict(self, state) -> None:
        """Restore from :meth:`state_dict` output or a CPU ``AdamW.state_dict()``
        of the same parameters. Everything is validated first, by the very
        rules of ``mamba_ext.AdamW.load_state_dict`` (exact keys; each moment a
        float32 array of its parameter's shape, finite, ``exp_avg_sq`` >= 0;
        counts integral >= 0; valid hyper-parameters): a bad state raises
        ValueError/TypeError naming the key and leaves the trainer unchanged.
        Then the moments are uploaded to the GPU arenas and ``step`` becomes
        the bias-correction count of the next step."""
        from ..optim import AdamW
        # a host AdamW over zero weights of the same names/shapes validates and holds the state
        host = AdamW({k: np.zeros_like(a) for k, a in self.arrays.items()})
        host.load_state_dict(state)
        g = gpu()
        for buf, moments in ((self.m, host.exp_avg), (self.v, host.exp_avg_sq)):
            g.write(buf, np.concatenate([moments[k].ravel() for k in self.order]))
        self.t, self.skipped, self.nonfinite = host.step_count, host.skipped, host.nonfinite
        self.lr, self.betas, self.eps = host.lr, tuple(host.betas), host.eps
        self.weight_decay, self.max_delta = host.weight_decay, host.max_delta
