"""Generation on the GPU: one token per sequence per step (kernels/recurrent.wgsl for the
conv and scan steps; the norms, projections and gate are the chunked path's kernels with
M = B rows), the mirror of mamba_ext/cpu/recurrent.pyx's Stepper.
``mamba_ext.generate(..., device="gpu")`` prefills on the CPU, then steps here.

Size letters: B batch, Dm dModel, D dInner, N dState, K dConv, R dtRank, P = R + 2N, V vocab.
"""
from __future__ import annotations

import numpy as np

from .._validate import BLOCK_PARAM_NAMES
from .activations import gate_forward
from .device import arena_layout, elementwise, gpu
from .linear import linear_forward
from .model import embedding_forward, head_forward
from .rmsnorm import rmsnorm_forward
from .scan import clamp_constants


class GpuStepper:
    """Weights, per-layer states and recorded ops of one step for ``batch`` sequences.

    ``arrays``: validated float32 model parameters; ``dims``: their ModelDims.
    :meth:`set_state` uploads the state (``h[i]`` (B, D, N), ``conv[i]`` (B, D, K-1) per
    layer, as ``mamba_ext.recurrent.RecurrentState``); :meth:`step` and :meth:`greedy`
    have the CPU Stepper's meanings.
    """

    def __init__(self, arrays, dims, batch, eps, zoh):
        g = gpu()
        self.B, self.V, self.nl = int(batch), dims.V, dims.n_layers
        d = dims.block
        B, Dm, D, N, K, R, P = self.B, d.Dm, d.D, d.N, d.K, d.R, d.P
        order = list(arrays)
        self.offs, n = arena_layout([(k, arrays[k].shape) for k in order])
        o = self.offs
        self.w = g.buffer(n, "params", np.concatenate([arrays[k].ravel() for k in order]))
        self.tok = g.buffer(B, "tokens")                                  # (B,) u32
        self.x = [g.buffer(B * Dm, "x_a"), g.buffer(B * Dm, "x_b")]       # (B, Dm) ping-pong
        xn, rstd = g.buffer(B * Dm, "xn"), g.buffer(B, "rstd")           # (B, Dm), (B,)
        Y = g.buffer(B * 2 * D, "Y")                                      # (B, 2D) [xc | z]
        u, y, gated = (g.buffer(B * D, nm) for nm in ("u", "y", "gated"))  # (B, D) each
        xproj, dpre = g.buffer(B * P, "xproj"), g.buffer(B * D, "delta_pre")
        self.h = [g.buffer(B * D * N, f"h{i}") for i in range(self.nl)]           # (B, D, N)
        self.tail = [g.buffer(B * D * (K - 1), f"tail{i}") for i in range(self.nl)]  # (B, D, K-1)
        self.logits = g.buffer(B * self.V, "logits")                     # (B, V)
        consts = clamp_constants()
        ops = [embedding_forward(g, B, Dm, self.tok, self.w, o, self.x[0])]
        cur = 0
        for i in range(self.nl):
            lo = {k: o[f"layer{i}.{k}"] for k in BLOCK_PARAM_NAMES}
            x, out = self.x[cur], self.x[1 - cur]
            ops += [rmsnorm_forward(g, B, Dm, x, self.w, lo["normWeight"], xn, rstd, eps),
                    *linear_forward(g, B, Dm, 2 * D, xn, 0, Dm, self.w, lo["wInProj"], lo["bInProj"],
                                    Y, 0, 2 * D),
                    elementwise(g, "recurrent", "recurrent_conv_step", B * D,
                                [B, D, K, N, R, P, lo["wConv"], lo["bConv"], int(zoh)],
                                [Y, self.w, self.tail[i], u], wg=128, constants=consts),
                    *linear_forward(g, B, D, P, u, 0, D, self.w, lo["wXProj"], lo["bXProj"],
                                    xproj, 0, P),
                    *linear_forward(g, B, R, D, xproj, 0, P, self.w, lo["wDtProj"], lo["bDtProj"],
                                    dpre, 0, D),
                    elementwise(g, "recurrent", "recurrent_scan_step", B * D,
                                [B, D, K, N, R, P, lo["A_log"], lo["D_vec"], int(zoh)],
                                [xproj, self.w, self.h[i], u, dpre, y], wg=128, constants=consts),
                    gate_forward(g, B, D, y, Y, gated),
                    *linear_forward(g, B, D, Dm, gated, 0, D, self.w, lo["wOutProj"],
                                    lo["bOutProj"], out, 0, Dm, res=x)]
            cur = 1 - cur
        ops += head_forward(g, B, self.V, Dm, self.x[cur], self.w, o, xn, rstd, self.logits, eps)
        self.ops = ops
        # the logits (B, V) copied into a kept staging buffer by each step's command buffer;
        # the next step's command buffer, encoded while the GPU runs this one (the same ops:
        # only the token ids change, written before its submit): encoding ~220 dispatches of
        # a 24-layer model costs the host about as long as the GPU takes to run them
        self._reads = (g.staging(B * self.V, "logits_readback"), [(self.logits, B * self.V)])
        self._next = None

    def set_state(self, h, conv):
        """Upload the state: ``h[i]`` (B, D, N) and ``conv[i]`` (B, D, K-1) per layer."""
        g = gpu()
        for i in range(self.nl):
            g.write(self.h[i], np.ascontiguousarray(h[i], np.float32))
            if conv[i].size:
                g.write(self.tail[i], np.ascontiguousarray(conv[i], np.float32))

    def get_state(self, h, conv):
        """Copy the state back into the host arrays ``h[i]``, ``conv[i]`` (in place)."""
        g = gpu()
        for i in range(self.nl):
            h[i][...] = g.read(self.h[i], h[i].size).reshape(h[i].shape)
            if conv[i].size:
                conv[i][...] = g.read(self.tail[i], conv[i].size).reshape(conv[i].shape)

    def step(self, ids, logits):
        """Feed ``ids`` (B,) (checked by the caller), write the next logits into ``logits`` (B, V)."""
        g = gpu()
        g.write(self.tok, np.asarray(ids).astype(np.uint32))
        ready, self._next = self._next, None
        self._next, (out,) = g.run_ahead(self.ops, (), self._reads, ready)
        logits[...] = out.reshape(self.B, self.V)

    def greedy(self, logits, out):
        """Greedy continuation from ``logits`` (B, V): ``out`` (B, n) gets the argmax of each
        step, fed back in. Returns the first step whose logits are not finite, else -1."""
        n = out.shape[1]
        for j in range(n):
            if not np.isfinite(logits).all():
                return j
            out[:, j] = np.argmax(logits, axis=1)
            if j + 1 < n:
                self.step(out[:, j], logits)
        return -1
