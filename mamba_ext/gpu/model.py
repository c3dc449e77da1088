"""The small Mamba-1 language model on the GPU, the mirror of mamba_ext/cpu/model.pyx
and of mamba_ext/model.py: logits, and the loss with its gradients.

embedding -> n_layers blocks -> final RMSNorm -> tied LM head (+ lm_head_bias)
-> mean cross-entropy (docs/semantics.md). Parameters and gradients each live in
ONE flat GPU buffer (an "arena"), so the resident trainer's grad norm and AdamW
are single dispatches over it. A step is one command buffer with one compute pass.

Size letters: B batch, L seqLen, Dm dModel, V vocab, M = B*L.
"""
from __future__ import annotations

import numpy as np

from .._validate import BLOCK_PARAM_NAMES, check_discretization, check_eps, check_tokens
from ..constants import DEFAULT_EPS
from . import scan as _scan
from .block import F16_TRANSPOSED, F16_WEIGHTS, NARROW_F16_WEIGHTS, BlockLayer, BlockScratch, require_float32
from . import linear_f16 as lf
from .device import arena_layout, elementwise, gpu, slices
from .linear import Mat, gemm, linear_backward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward


def check_model(params):
    """Validated float32 model parameters: (arrays, ModelDims)."""
    from ..model import check_model_params
    if isinstance(params, dict):
        for k, v in params.items():
            require_float32(k, v)
    return check_model_params(params, np.float32)


def check_batch(tokens, targets, V):
    tok = check_tokens("tokens", tokens, V)
    tgt = check_tokens("targets", targets, V, shape=tok.shape)
    if tok.size == 0:
        raise ValueError(f"tokens: shape {tok.shape} has no positions; the mean cross-entropy "
                         f"needs batch >= 1 and seqLen >= 1")
    return tok, tgt


def embedding_forward(g, M, Dm, tok, w, o, h):
    """Op: h (M, Dm) = embedding rows of the token ids ``tok`` (M,) u32."""
    return elementwise(g, "embedding", "embedding_forward", M * Dm, [M * Dm, Dm, o["embedding"]],
                       [tok, w, h])


def head_forward(g, M, V, Dm, x, w, o, xn, rstd, logits, eps, f16=None):
    """Ops: xn (M, Dm), rstd (M,) = final RMSNorm of x; logits (M, V) = xn @ embedding^T +
    lm_head_bias (the tied head). ``f16``: (buffer, offset) of the embedding's f16 copy
    (linear_f16.HalfWeights, rows padded to whole tiles): the product on tensor cores, from
    xn rounded to f16 (in the blocks' f16 scratch of their normed input, free here)."""
    norm = rmsnorm_forward(g, M, Dm, x, w, o["final_norm"], xn, rstd, eps)
    if f16 is None:
        return [norm, *gemm(g, "linear_forward", M, V, Dm, Mat(xn, 0, Dm),
                            Mat(w, o["embedding"], 1, Dm), Mat(logits, 0, V), bias=w,
                            bias_off=o["lm_head_bias"])]
    return [norm, *lf.narrow_forward(g, logits, xn, g.scratch("amp_xn_f16", M * Dm // 2),
                                     f16[0], M, Dm, V, w_off=f16[1],
                                     bias=(w, o["lm_head_bias"]))]


class ModelPlan:
    """Buffers and recorded ops of the model for one (layout, B, L, eps, discretization).

    ``forward_ops`` end with the logits; ``train_ops`` (built on first use) add the
    cross-entropy and the whole backward into the gradient arena. ``checkpointing``:
    every layer shares ONE forward cache (the first layer's buffers); before its
    backward, each layer's forward up to the gate runs again from its input (kept in
    ``h``), so activation memory no longer grows with the number of layers (as
    ``mamba_ext.model_loss_and_grads(checkpointing=True)`` on the CPU).
    ``f16``: a ``linear_f16.HalfWeights`` with every layer's ``wInProj`` and ``wOutProj``,
    and ``wXProj``, ``wDtProj`` and the ``embedding`` where they fit (keys as in the arena,
    ``block.half_weights``): the blocks' products and the tied head's run on tensor cores
    (BlockLayer's f16 mode, head_forward's ``f16``); its ops, which make the f16 copies,
    run first.
    """

    def __init__(self, arrays, dims, B, L, order, w=None, gr=None, eps=DEFAULT_EPS,
                 discretization="zoh", chunk=None, checkpointing=False, f16=None,
                 loss_scale=None):
        g = gpu()
        self.loss_scale = loss_scale
        self.f16 = f16
        self.dims, self.order = dims, order
        self.checkpointing = bool(checkpointing)
        self.eps = check_eps(eps)
        self.offs, self.n = arena_layout([(k, arrays[k].shape) for k in order])
        V, Dm = arrays["embedding"].shape
        M = B * L
        self.B, self.L, self.V, self.Dm, self.M = B, L, V, Dm, M
        self.w = w if w is not None else g.buffer(self.n, "params")
        self.gr = gr if gr is not None else g.buffer(self.n, "grads")
        # The batch in one buffer (one write per step): tok (M,) u32 token ids, tgt (M,) u32
        # targets, pos (M,) u32 rows grouped by id, csr (V+1,) u32 offsets of each id's rows
        self.batch, (self.tok, self.tgt, self.pos, self.csr) = slices(g, "batch", (M, M, M, V + 1))
        nl = dims.n_layers
        self.h = [g.buffer(M * Dm, f"h{i}") for i in range(nl + 1)]   # (M, Dm) layer inputs/outputs
        self.fxn, self.frstd = g.buffer(M * Dm, "final_xn"), g.buffer(M, "final_rstd")
        self.logits = g.buffer(M * V, "logits")            # (M, V)
        o, w, gr = self.offs, self.w, self.gr
        ops = [*(f16.ops if f16 is not None else ()),
               embedding_forward(g, M, Dm, self.tok, w, o, self.h[0])]
        self.layers = []
        for i in range(nl):
            lo = {n: o[f"layer{i}.{n}"] for n in BLOCK_PARAM_NAMES}
            shared = self.layers[0] if self.checkpointing and self.layers else None
            half = None if f16 is None else (f16.buf, {
                n: f16.offs[f"layer{i}.{n}"]
                for n in F16_WEIGHTS + F16_TRANSPOSED + NARROW_F16_WEIGHTS
                if f"layer{i}.{n}" in f16.offs})
            lay = BlockLayer(g, dims.block, B, L, w, gr, lo, self.h[i], self.h[i + 1],
                             self.eps, discretization, chunk or _scan.SCAN_CHUNK, cache_of=shared,
                             f16=half)
            self.layers.append(lay)
            ops += lay.forward_ops()
        # the tied head on tensor cores where the f16 weights include the embedding
        self.head16 = (None if f16 is None or "embedding" not in f16.offs
                       else (f16.buf, f16.offs["embedding"]))
        ops += head_forward(g, M, V, Dm, self.h[nl], w, o, self.fxn, self.frstd, self.logits,
                            self.eps, f16=self.head16)
        self.forward_ops = ops
        self._train = None

    def train_ops(self):
        """Forward, cross-entropy and backward ops (gradients into ``gr``, cleared first)."""
        if self._train is not None:
            return self._train
        g, o, M, V, Dm, w, gr = gpu(), self.offs, self.M, self.V, self.Dm, self.w, self.gr
        f16 = self.f16
        nl, E = self.dims.n_layers, self.offs["embedding"]
        self.dlogits = g.buffer(M * V, "dlogits")          # (M, V)
        self.losses = g.buffer(M, "losses")                # (M,)
        self.fdxn, self.fgw = g.buffer(M * Dm, "final_dxn"), g.buffer(M * Dm, "final_gw")
        self.dh = [g.buffer(M * Dm, "dh_a"), g.buffer(M * Dm, "dh_b")]   # (M, Dm) ping-pong
        # dlogits = (softmax - onehot) * loss_scale / M (set_loss_scale; 1 by default)
        self.ce_op = g.op("cross_entropy", "cross_entropy_forward_backward",
                          g.grid1d(M, "cross-entropy rows"), [M, V, 1.0 / M, 0],
                          [self.logits, self.tgt, self.dlogits, self.losses,
                           self.loss_scale if self.loss_scale is not None else g.dummy(2)])
        if self.head16 is None:
            # head backward: dxn = dlogits @ embedding; dE += dlogits^T xn; dbias (split-K
            # partials in fgw, written only by the RMSNorm backward after it)
            head = linear_backward(g, M, Dm, V, self.dlogits, 0, V, self.fxn, 0, Dm, w, E,
                                   o["lm_head_bias"], gr, dx=self.fdxn, dx_rs=Dm, part=self.fgw)
        else:
            # the same on tensor cores (head_forward's f16); dlogits' f16 copy in a scratch
            # of its own, xn's transpose in the blocks' f16 scratch of their normed input
            head = lf.narrow_backward(
                g, self.fdxn, self.dlogits, self.fxn, self.head16[0], gr, M, Dm, V,
                w_off=self.head16[1], dw_off=E, db_off=o["lm_head_bias"],
                dy16=g.scratch("amp_dlogits_f16", M * lf.padded(V) // 2),
                x16_t=g.scratch("amp_xn_f16", M * Dm // 2), accumulate_dx=False)
        ops = list(self.forward_ops) + [
            self.ce_op,
            *head,
            *rmsnorm_backward(g, M, Dm, self.h[nl], w, o["final_norm"], self.fdxn, self.frstd,
                              self.dh[0], self.fgw, gr, self.eps),
        ]
        # segments: (ops done, the parameters whose gradients are then complete), in
        # order, for a caller that reads gradients back during the backward
        self.segments = [(len(ops), [k for k in self.order if not k.startswith("layer")
                                     and k != "embedding"])]
        cur = 0
        if self.layers:
            scratch = BlockScratch(g, self.dims.block, self.layers[0].s, f16=f16 is not None,
                                   narrow16=self.layers[0].narrow16)
            for i in reversed(range(nl)):
                lay = self.layers[i]
                if self.checkpointing and i < nl - 1:   # the last layer's cache is intact
                    ops += lay.cache_ops()
                ops += lay.backward_ops(self.dh[cur], self.dh[1 - cur], scratch)
                cur = 1 - cur
                self.segments.append((len(ops), [k for k in self.order
                                                 if k.startswith(f"layer{i}.")]))
        ops.append(elementwise(g, "embedding", "embedding_backward", V * Dm, [V * Dm, Dm, E],
                               [self.csr, self.pos, self.dh[cur], gr]))
        self.segments.append((len(ops), ["embedding"]))
        self._train = ops
        self.clears = [gr]
        return ops

    def set_loss_scale(self, scale: float | None) -> None:
        """Multiply the gradient seed (and so every gradient) by ``scale`` from the next
        submit of :meth:`train_ops` on (mixed precision; the losses are not scaled); None:
        by the scale the GPU keeps in the buffer ``loss_scale`` given to the plan
        (kernels/amp.wgsl's state: ResidentTrainer's scale on the GPU)."""
        self.train_ops()
        if scale is None:
            if self.loss_scale is None:
                raise ValueError("set_loss_scale: None needs the plan's loss_scale buffer")
            gpu().write_params(self.ce_op, [self.M, self.V, 1.0 / self.M, 1])
        else:
            gpu().write_params(self.ce_op, [self.M, self.V, float(scale) / self.M, 0])

    def upload_tokens(self, tok):
        gpu().write(self.batch, tok.ravel().astype(np.uint32), self.tok.offset)

    def upload_batch(self, tok, tgt):
        """Token ids, targets and the embedding gradient's rows grouped by id (a stable
        sort of the ids) in one write."""
        flat = tok.ravel()
        data = np.zeros(self.batch.size // 4, np.uint32)
        for sl, values in ((self.tok, flat), (self.tgt, tgt.ravel())):
            data[sl.offset // 4:sl.offset // 4 + flat.size] = values
        # stable argsort of 16-bit keys is a radix sort: 0.02 ms against 0.19 for int64
        # at B 16 x L 512 (on the host, before the step's submit)
        keys = flat.astype(np.uint16 if self.V <= 1 << 16 else np.uint32)
        p0, c0 = self.pos.offset // 4, self.csr.offset // 4
        data[p0:p0 + flat.size] = np.argsort(keys, kind="stable")
        data[c0 + 1:c0 + 1 + self.V] = np.cumsum(np.bincount(flat, minlength=self.V))
        gpu().write(self.batch, data)

    def loss(self, values=None):
        """Mean of the per-row losses (``values``: already read back), summed in float64
        on the host."""
        if values is None:
            values = gpu().read(self.losses, self.M)
        return float(np.mean(values.astype(np.float64)))

    def read_tensors(self, buf, arrays):
        flat = gpu().read(buf, self.n)
        return {k: flat[self.offs[k]:self.offs[k] + a.size].reshape(a.shape).copy()
                for k, a in arrays.items()}


_PLANS = {}


def _plan(arrays, dims, shape, eps, discretization, checkpointing=False):
    order = list(arrays)
    key = (tuple((k, arrays[k].shape) for k in order), shape, eps, discretization,
           _scan.layout_key(), bool(checkpointing))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 4:
            _PLANS.clear()
        plan = _PLANS[key] = ModelPlan(arrays, dims, *shape, order, eps=eps,
                                       discretization=discretization,
                                       checkpointing=checkpointing)
    gpu().write(plan.w, np.concatenate([arrays[k].ravel() for k in order]))
    return plan


def model_forward(tokens, params, *, eps=DEFAULT_EPS, discretization="zoh"):
    """Logits ``(B, L, V)`` float32 of the model for integer ``tokens`` ``(B, L)``,
    computed on the GPU (as ``mamba_ext.model_forward``, float32 only)."""
    check_discretization(discretization)
    arrays, dims = check_model(params)
    tok = check_tokens("tokens", tokens, dims.V)
    eps = check_eps(eps)
    B, L = tok.shape
    if B * L == 0:
        return np.empty((B, L, dims.V), np.float32)
    plan = _plan(arrays, dims, tok.shape, eps, discretization)
    g = gpu()
    plan.upload_tokens(tok)
    g.submit(plan.forward_ops)
    return g.read(plan.logits, B * L * dims.V).reshape(B, L, dims.V)


def model_loss_and_grads(tokens, targets, params, *, eps=DEFAULT_EPS, discretization="zoh",
                         checkpointing=False):
    """Mean cross-entropy (float, summed in float64) and float32 gradients of
    every parameter, computed on the GPU; keys and shapes like ``params``.
    ``checkpointing``: one forward cache for all layers, each layer's forward run
    again before its backward (same results, bit for bit; less GPU memory)."""
    check_discretization(discretization)
    arrays, dims = check_model(params)
    tok, tgt = check_batch(tokens, targets, arrays["embedding"].shape[0])
    eps = check_eps(eps)
    plan = _plan(arrays, dims, tok.shape, eps, discretization, checkpointing)
    ops = plan.train_ops()
    plan.upload_batch(tok, tgt)
    gpu().submit(ops, plan.clears)
    return plan.loss(), plan.read_tensors(plan.gr, arrays)
