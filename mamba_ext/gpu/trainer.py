"""AdamW training with weights, gradients and moments resident on the GPU.

One submit per step: the model's forward and backward (:mod:`.model`), the
gradient norm and AdamW (:mod:`.adamw`) in one compute pass.

Size letters: B batch, L seqLen, n elements of the parameter arena.
"""
from __future__ import annotations

import math
import queue
import threading
import time

import numpy as np

from .._validate import check_discretization, check_eps
from ..amp import round_fp16
from ..constants import DEFAULT_EPS, DEFAULT_NO_DECAY
from ..optim import name_matches
from .adamw import COUNT_MOD, AdamWOps, bias_corrections
from .device import arena_layout, gpu
from .model import ModelPlan, check_batch, check_model


class ResidentTrainer:
    """AdamW training with weights, gradients and moments resident on the GPU.

    Same maths as ``mamba_ext.AdamW`` (PyTorch AdamW, trust region
    ``max_delta``, per-element NaN guard); a step whose gradients hold any
    non-finite value is skipped entirely (weights, moments and step count
    untouched; counted in ``skipped``). ``model_eps`` and ``discretization`` are
    those of the model (as ``mamba_ext.model_loss_and_grads``'s ``eps`` and
    ``discretization``). ``clip`` > 0 clips the global gradient
    norm (computed on the GPU, reported as ``last_grad_norm``). One submit per
    step: forward, backward, grad norm and AdamW in one compute pass.
    ``state_dict()`` / ``load_state_dict()`` use ``mamba_ext.AdamW``'s format,
    so a run resumes exactly from a GPU or a CPU optimizer state.
    ``checkpointing``: activation checkpointing (``mamba_ext.gpu.model_loss_and_grads``):
    the same steps, bit for bit, with one forward cache for all layers.
    ``scaler``: a ``mamba_ext.amp.DynamicLossScaler`` turns on mixed precision with the
    semantics of ``mamba_ext.training.loop.amp_step``: the forward/backward runs on the
    fp16-rounded weights (a second arena) with the gradient seed times ``scaler.scale``;
    the gradients are rounded to fp16 and unscaled on the GPU; an overflow (any
    non-finite gradient) skips the step and the scaler backs off (``scaler.update``).
    Where the scaler's arithmetic is exact in float32 (the default's is), the GPU keeps a
    copy of the scale and advances it by the same rule after each step, so that
    ``step_async`` overlaps mixed-precision steps too (:attr:`pipelined_amp`).
    ``f16_products`` (with a scaler): the products of every block's linear layers run on
    tensor cores, f16 operands and f32 accumulation
    (``mamba_ext.gpu.linear_f16``: the Dawn backend on a GPU with f16 subgroup matrices),
    from f16 copies of those weights made each step and with their f16 input activations
    kept in the forward cache; where the device has none or the sizes do not fit the
    kernel (Dm and dInner multiples of 128, batch x seqLen too; x_proj and dt_proj also
    need dt_rank and dt_rank + 2 dState multiples of 16), the products run in f32 on the
    f16-rounded values. ``f16_active`` says which the last step ran, and
    ``f16_reason`` why not.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 max_delta=0.0, no_decay=None, clip=0.0, model_eps=DEFAULT_EPS,
                 discretization="zoh", checkpointing=False, scaler=None, f16_products=True):
        self.arrays, self.dims = check_model(params)
        check_discretization(discretization)
        self.discretization = discretization
        self.checkpointing = bool(checkpointing)
        if scaler is not None and not all(hasattr(scaler, k) for k in ("scale", "update")):
            raise TypeError(f"scaler: expected a mamba_ext.amp.DynamicLossScaler, got "
                            f"{type(scaler).__name__}")
        self.scaler = scaler
        no_decay = DEFAULT_NO_DECAY if no_decay is None else frozenset(no_decay)
        names = list(self.arrays)
        decays = {k: not name_matches(k, no_decay) for k in names}
        self.order = [k for k in names if decays[k]] + [k for k in names if not decays[k]]
        self.n_decay = sum(self.arrays[k].size for k in self.order if decays[k])
        self.lr, self.betas, self.eps = float(lr), tuple(map(float, betas)), float(eps)
        self.weight_decay, self.max_delta, self.clip = float(weight_decay), float(max_delta), float(clip)
        for name, v in (("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay),
                        ("max_delta", self.max_delta), ("clip", self.clip)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {betas}")
        self.model_eps = check_eps(model_eps)
        g = gpu()
        self.offs, self.n = arena_layout([(k, self.arrays[k].shape) for k in self.order])
        self.w = g.buffer(self.n, "params", np.concatenate([self.arrays[k].ravel() for k in self.order]))
        self.gr = g.buffer(self.n, "grads")
        self.m = g.buffer(self.n, "adam_m")
        self.v = g.buffer(self.n, "adam_v")
        self._adamw = AdamWOps(g, self.n, self.w, self.m, self.v, self.gr, self._adam_params(0))
        self._amp = None
        self.f16_products = bool(f16_products)
        self._half = None           # linear_f16.HalfWeights, made with the first plan that fits
        self.f16_active = False
        self.f16_reason = "no scaler: the products run in f32"
        if scaler is not None:      # the fp16-rounded weights the model runs on (n,)
            from .amp import AmpOps
            self.w16 = g.buffer(self.n, "params_fp16")
            self._amp = AmpOps(g, self.n, self.w, self.w16, self.gr, self._adamw.stat)
        # the host scaler's (identity, scale, growth tracker) that the GPU's copy of the
        # scale (AmpOps.state) is known to match once the steps in flight are read back;
        # None: unknown (the next step waits and writes it)
        self._scale_synced = None
        self._plans = {}            # (B, L) -> ModelPlan
        # (B, L) -> the command buffer of the next step of that shape (Gpu.encode), into the
        # staging buffer of the next slot: the host's encoding hidden behind the GPU's work
        # (the 4 x 256 step on an H200: +6% tokens/s);
        # only the last step's shape is kept
        self._next = {}
        self.pre_encode = True
        # ((B, L), slot) -> (MAP_READ staging buffer, what it gets): two per shape, the steps
        # alternate between them (slot = 1 - the last step's), so a step can be submitted
        # before the one before it is read back (step_async)
        self._reads = {}
        self._slot = 1
        self._pending = None        # the PendingStep of step_async not read back yet
        self._parts = {}            # (B, L) -> _stream_parts of that plan (distributed steps)
        self._host = None           # (n,) float32: the reduced arena of distributed steps
        self.t = 0
        self.skipped = 0
        self.nonfinite = 0      # carried in state_dict for AdamW compatibility (see state_dict)
        self.last_grad_norm = float("nan")

    def _adam_params(self, tc):
        """Uniform values of adamw_step for a step submitted while the host knows of ``tc``
        steps taken: the bias corrections of step tc + 1 and of step tc + 2 (the step
        before may be in flight; the kernel takes the pair matching the GPU's count,
        kernels/adamw.wgsl)."""
        b1, b2 = self.betas
        s1, q1 = bias_corrections(self.lr, self.betas, tc + 1)
        s2, q2 = bias_corrections(self.lr, self.betas, tc + 2)
        return [self.n, self.n_decay, 1.0 - b1, b2, 1.0 - b2, self.lr * self.weight_decay,
                s1, q1, self.eps, self.max_delta, self.clip, float(tc % COUNT_MOD), s2, q2]

    def step(self, tokens, targets, reduce=None) -> float:
        """One training step; returns the mean cross-entropy before the update
        (``step_async(tokens, targets).result()`` without ``reduce``).

        ``reduce``: distributed hook (``mamba_ext.training.distributed``), one of
        - an object with ``flat_stream()`` (a ``Distributed``): the gradients are read
          back during the backward, each layer's as soon as its backward is done, and
          each part's all-reduce starts at once while the layers below still run on the
          GPU (``FlatStream``); then written back, and grad norm + AdamW run in a
          second submit. ``last_reduce_s``: the seconds from the start of the step's
          submits to the write-back of the reduced arena; ``last_stream_s``: its phases
          (submit: the feeder thread's submits and maps; wait: until the last range is
          read back and its all-reduce started; finish: the last all-reduces; write:
          the write-back);
        - a function ``reduce(flat, loss, False) -> (flat, loss, _)``: the whole arena
          is read back after the backward and all-reduced in place, then as above.

        With a ``scaler`` each rank's gradients are rounded to fp16 and unscaled (the
        streamed parts on the host, by mamba_ext.amp's round_fp16 and
        DynamicLossScaler.unscale, which kernels/amp.wgsl matches bit for bit; with
        FlatStream's fp16 wire, at 2 or 3 ranks, the scaled fp16 values travel and their
        sum is unscaled), so an overflow on any rank makes the reduced gradients
        non-finite on every rank: all skip the step and back off alike."""
        if reduce is None:
            return self.step_async(tokens, targets).result()
        self.finish()
        plan, ops = self._prepare(tokens, targets)
        g = gpu()
        self._next = {}
        if hasattr(reduce, "flat_stream"):
            loss = self._streamed_reduce(plan, ops, reduce.flat_stream())
        else:
            g.submit(ops, plan.clears)
            flat = g.read(self.gr, self.n)
            flat, loss, _ = reduce(flat, plan.loss(), not np.isfinite(flat).all())
            g.write(self.gr, flat)
        g.submit(self._adamw.ops)
        self._account(g.read(self._adamw.stat, 2))
        return loss

    def step_async(self, tokens, targets) -> "PendingStep":
        """Submit one training step and return at once; ``.result()`` of the returned
        :class:`PendingStep` waits for it and gives its loss (as :meth:`step` returns).

        The step before, if still pending, is read back after this one is submitted, so
        the GPU goes from one step to the next without waiting for the host's read-back,
        validation and uploads in between (the 4 x 256 model on an H200: 9.8 ms per step
        read back one by one, 9.2 ms pipelined). A loop that
        calls ``step_async`` for each batch and reads each step's ``result()`` after
        submitting the next runs the same steps, bit for bit, as :meth:`step`: the step
        count that the bias corrections need is kept on the GPU (a step may be skipped),
        buffer writes are queued behind the steps already submitted, and each step's
        losses and statistics go to one of two staging buffers. The attributes ``t``,
        ``skipped``, ``last_grad_norm`` describe the steps read back so far; anything
        that reads the state (:meth:`params`, :meth:`state_dict`, another :meth:`step`)
        first reads back the pending step (:meth:`finish`). With a ``scaler`` the next
        step's loss scale depends on this one's overflow: it overlaps only where the GPU
        keeps the scale (:attr:`pipelined_amp`), else the step before is read back first."""
        if self._amp is not None and not (self.pipelined_amp
                                          and self._scale_synced == self._scaler_key()):
            self.finish()       # the scale comes from the host: wait for the step before
        plan, ops = self._prepare(tokens, targets)
        g = gpu()
        shape = (plan.B, plan.L)
        slot = 1 - self._slot
        reads = self._readback(plan, slot)
        ops = ops + self._adamw.ops + ([self._amp.update_op] if self._amp is not None else [])
        # the command buffer encoded during the previous step, if it was of this shape (it
        # reads back into this slot: only this method changes the slot, by one each step)
        cb = self._next.pop(shape, None)
        index = g.submit_encoded(cb if cb is not None else g.encode(ops, plan.clears, reads))
        self._slot = slot
        self._next = {}
        if self.pre_encode:   # the next step of this shape, into the other staging buffer
            self._next = {shape: g.encode(ops, plan.clears, self._readback(plan, 1 - slot))}
        prev, self._pending = self._pending, None
        if prev is not None:
            self._resolve(prev)
        self._pending = PendingStep(self, plan, reads, index)
        return self._pending

    def _readback(self, plan, slot):
        """(MAP_READ staging buffer, parts) of ``slot`` for steps of ``plan``'s shape: the
        per-row losses (M,) and AdamW's (grad norm^2, skip); made once."""
        key = ((plan.B, plan.L), slot)
        if key not in self._reads:
            parts = [(plan.losses, plan.M), (self._adamw.stat, 2)]
            if self._amp is not None:       # the GPU's scale after the step (scale, -, tracker)
                parts.append((self._amp.state, 3))
            self._reads[key] = (gpu().staging(sum(n for _, n in parts), "step_readback"),
                                parts)
        return self._reads[key]

    def finish(self) -> None:
        """Read back the step that :meth:`step_async` left pending, if any."""
        if self._pending is not None:
            self._resolve(self._pending)

    def _prepare(self, tokens, targets):
        """Validate and upload the batch, write the step's uniform values; returns (plan,
        the step's model ops, with the AMP passes around them)."""
        tok, tgt = check_batch(tokens, targets, self.arrays["embedding"].shape[0])
        plan = self._plans.get(tok.shape)
        if plan is None:
            plan = self._plans[tok.shape] = ModelPlan(
                self.arrays, self.dims, *tok.shape, self.order,
                w=self.w if self._amp is None else self.w16, gr=self.gr,
                eps=self.model_eps, discretization=self.discretization,
                checkpointing=self.checkpointing, f16=self._half_weights(tok.size),
                loss_scale=None if self._amp is None else self._amp.state)
        self.f16_active = plan.f16 is not None
        g = gpu()
        ops = plan.train_ops()
        plan.upload_batch(tok, tgt)
        g.write_params(self._adamw.step_op, self._adam_params(self.t))
        if self._amp is not None:
            # the scale on the GPU: written from the host's scaler when no step is in flight
            # (else the GPU's copy, advanced by the step before, is the one to use)
            on_gpu = self.pipelined_amp
            if self._pending is None:
                plan.set_loss_scale(None if on_gpu else self.scaler.scale)
                self._amp.set_scale(self.scaler, on_gpu)
                self._scale_synced = self._scaler_key() if on_gpu else None
            ops = [self._amp.weights_op, *ops, self._amp.grads_op]
        return plan, ops

    @property
    def pipelined_amp(self) -> bool:
        """Whether mixed-precision steps overlap (``step_async``): where the scaler's
        update is exact in float32 (mamba_ext.gpu.amp.scale_on_gpu; the default
        DynamicLossScaler's is) the GPU keeps the loss scale and advances it after each
        step by the scaler's own rule, so the next step need not wait for this one's
        read-back; the host's scaler is updated as each step is read back and checked
        against the GPU's. Otherwise each step waits for the one before."""
        from .amp import scale_on_gpu
        return self._amp is not None and scale_on_gpu(self.scaler)

    def _scaler_key(self):
        s = self.scaler
        return (id(s), s.scale, s.growth_tracker, s.growth_factor, s.backoff_factor,
                s.growth_interval, s.min_scale, s.max_scale)

    def products(self, B, L) -> str:
        """What a step of batch B x seqLen L multiplies the blocks' linear layers with, in
        words (the run's log says it)."""
        half = self._half_weights(B * L)
        if half is not None:
            narrow = any(k.endswith(".wXProj") for k in half.offs)
            which = "in_proj/out_proj/x_proj/dt_proj" if narrow else "in_proj/out_proj"
            head = " and the tied head" if "embedding" in half.offs else ""
            return f"{which}{head} on tensor cores (f16 operands, f32 accumulation)"
        return self.f16_reason

    def _half_weights(self, M):
        """The f16 weight copies for a plan of M rows, or None (``f16_reason`` says why)."""
        from . import linear_f16 as lf
        from .block import F16_TRANSPOSED, F16_WEIGHTS, f16_unsupported, half_weights
        if self._amp is None:
            return None
        g = gpu()
        why = None
        if not self.f16_products:
            why = "f16_products=False"
        elif not lf.available(g):
            why = ("this device offers no f16 subgroup matrices (they need "
                   "MAMBA_EXT_GPU_BACKEND=dawn on a GPU that has them)")
        else:
            for i in range(self.dims.n_layers):
                lo = {k: self.offs[f"layer{i}.{k}"] for k in F16_WEIGHTS}
                # (HalfWeights puts every copy at a multiple of 8, as the kernel needs)
                why = f16_unsupported(self.dims.block, M, lo, dict.fromkeys(F16_WEIGHTS + F16_TRANSPOSED, 0))
                if why:
                    why = f"layer {i}: {why}"
                    break
        if why:
            self.f16_reason = f"f32 products on f16-rounded values: {why}"
            return None
        if self._half is None:
            self._half = half_weights(g, self.w, self.offs,
                                      {k: a.shape for k, a in self.arrays.items()})
        self.f16_reason = ""
        return self._half

    def _resolve(self, pending):
        """Read back ``pending`` (the trainer's one pending step): its loss, and the step
        count, skip count and gradient norm it leaves."""
        if pending is not self._pending and self._pending is not None:
            raise AssertionError("ResidentTrainer: steps are read back in order")
        self._pending = None
        staging, parts = pending.reads            # (_readback: losses, stats[, scale])
        losses, st, *scale = gpu().read_staged(staging, [n for _, n in parts], pending.index)
        self._account(st, pending.scaler)
        if scale and self._scale_synced is not None:
            # the GPU advanced its scale by the same rule: it must hold the host's values
            # (unless the trainer's scaler was replaced since: then it is written anew)
            sc = pending.scaler
            same = (sc is self.scaler and float(scale[0][0]) == sc.scale
                    and int(scale[0][2]) == sc.growth_tracker)
            self._scale_synced = self._scaler_key() if same else None
        pending._loss = pending.plan.loss(losses)

    def _account(self, st, scaler=None):
        """Host counters after a step whose AdamW statistics are ``st`` (grad norm^2,
        non-finite count); ``scaler``: the one the step ran with (default the trainer's)."""
        self.last_grad_norm = float(np.sqrt(np.float64(st[0])))
        if st[1] > 0:
            self.skipped += 1
            self.last_grad_norm = float("nan")
        else:
            self.t += 1
        scaler = self.scaler if scaler is None else scaler
        if scaler is not None:
            scaler.update(bool(st[1] > 0))

    def _stream_parts(self, plan):
        """Per segment of ``plan.train_ops()``: (ops done, arena ranges (lo, hi) whose
        gradients are then complete, one MAP_READ staging buffer per range); cached."""
        parts = self._parts.get((plan.B, plan.L))
        if parts is None:
            g, parts = gpu(), []
            for end, names in plan.segments:
                ranges = []
                for k in sorted(names, key=lambda k: self.offs[k]):
                    lo, hi = self.offs[k], self.offs[k] + self.arrays[k].size
                    if ranges and ranges[-1][1] == lo:
                        ranges[-1] = (ranges[-1][0], hi)      # adjacent: one range
                    else:
                        ranges.append((lo, hi))
                parts.append((end, ranges, [g.staging(hi - lo, "grad_readback")
                                            for lo, hi in ranges]))
            self._parts[(plan.B, plan.L)] = parts
        return parts

    def _streamed_reduce(self, plan, ops, stream):
        """The step's ops and gradient read-backs overlapped with the all-reduce.

        A feeder thread submits ``ops`` segment by segment (``plan.segments``), each
        followed by the copies of the gradients it finished into staging buffers,
        and maps those (where wgpu-py's poller makes it wait for the GPU, see
        Gpu.read_start); on a device that is not thread-safe (Gpu.thread_safe: Dawn)
        this thread queues them all first. This thread takes each range as soon as it is mapped,
        scales it and starts its all-reduce (``stream``), letting MPI progress while
        it waits for the next. The ranges are unmapped and the reduced arena written
        back once the GPU is done. Returns the mean loss over ranks."""
        g = gpu()
        if self._host is None:
            self._host = np.empty(self.n, np.float32)
        host, parts = self._host, self._stream_parts(plan)
        amp = self._amp is not None
        if amp:
            # ops = [weights_op, *the model's ops, grads_op] (_prepare): the f16 weights go
            # with the first segment, and grads_op's rounding and unscaling is done to each
            # part on the host as it arrives (mamba_ext.amp's, the same arithmetic bit for bit)
            if ops[0] is not self._amp.weights_op or ops[-1] is not self._amp.grads_op:
                raise AssertionError("ResidentTrainer._prepare: AMP ops not around the model's")
            ops = ops[:-1]
            parts = [(end + 1, ranges, stagings) for end, ranges, stagings in parts]
        overflow = False
        flat = [(lo, hi, st) for _, ranges, stagings in parts
                for (lo, hi), st in zip(ranges, stagings)]
        promises = [None] * len(flat)                 # the map of each staging buffer
        mapped = queue.Queue()                        # indices into flat as maps start, or an error
        times = dict(submit=0.0, wait=0.0, write=0.0, finish=0.0)   # seconds, last_stream_s

        def feeder():
            try:
                t, begin, i = time.perf_counter(), 0, 0
                for end, ranges, stagings in parts:
                    g.submit(ops[begin:end], plan.clears if begin == 0 else ())
                    begin = end
                    g.read_start(self.gr, ranges, stagings)
                    for st in stagings:
                        promises[i] = g.map_read(st)
                        mapped.put(i)
                        i += 1
                times["submit"] = time.perf_counter() - t
            except BaseException as e:             # handed to the main thread
                mapped.put(e)

        if parts[-1][0] != len(ops):
            raise AssertionError("ModelPlan.segments must cover every op")
        t1 = time.perf_counter()
        thread = None
        if g.thread_safe:
            thread = threading.Thread(target=feeder, name="mamba_ext-gpu-feeder", daemon=True)
            thread.start()
        else:       # the same submits and maps, all queued from this thread before it waits
            feeder()
        try:
            for lo, hi, st in flat:
                while True:
                    try:
                        item = mapped.get(timeout=2e-4)
                        break
                    except queue.Empty:
                        stream.progress()
                if isinstance(item, BaseException):
                    raise item
                g.wait_for(promises[item], idle=stream.progress)
                part = host[lo:hi]
                g.copy_mapped(st, part)
                if amp:     # scaled fp16 values: unscaled by the stream (its fp16 wire)
                    round_fp16(part, out=part)
                    overflow = overflow or self.scaler.check([part])
                    stream.add(part, unscale=self.scaler.unscale)
                else:
                    stream.add(part)
        finally:
            # every map started is finished and undone, also after an error above, so
            # that the next step can copy into the staging buffers again
            if thread is not None:
                thread.join()
            for (_, _, st), promise in zip(flat, promises):
                if promise is not None:
                    try:
                        promise.sync_wait()
                    except Exception:                 # a failed map: nothing to undo
                        pass
                    if st.map_state == "mapped":
                        st.unmap()
        t2 = time.perf_counter()
        loss, _ = stream.finish(plan.loss(), overflow)
        t3 = time.perf_counter()
        # one write of the reduced arena once the GPU is done (writing each range back
        # from a third thread as soon as it was reduced measured slower on the two-H200
        # host: 1.20x against 1.42x, docs/distributed.md)
        g.write(self.gr, host)
        t4 = time.perf_counter()
        times.update(wait=t2 - t1, finish=t3 - t2, write=t4 - t3)
        self.last_reduce_s = t4 - t1
        self.last_stream_s = times
        return loss

    def _read(self, buf) -> dict:
        """One arena buffer copied back to the host, split per tensor (keys like the input)."""
        self.finish()
        flat = gpu().read(buf, self.n)
        return {k: flat[self.offs[k]:self.offs[k] + a.size].reshape(a.shape).copy()
                for k, a in self.arrays.items()}

    def params(self) -> dict:
        """The current weights, copied back from the GPU (keys like the input)."""
        return self._read(self.w)

    def state(self) -> dict:
        """AdamW moments ``m.<name>``, ``v.<name>`` and the step count ``t``."""
        self.finish()
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
        self.finish()
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
        self.finish()
        g = gpu()
        for buf, moments in ((self.m, host.exp_avg), (self.v, host.exp_avg_sq)):
            g.write(buf, np.concatenate([moments[k].ravel() for k in self.order]))
        self.t, self.skipped, self.nonfinite = host.step_count, host.skipped, host.nonfinite
        self._adamw.set_count(self.t)
        self.lr, self.betas, self.eps = host.lr, tuple(host.betas), host.eps
        self.weight_decay, self.max_delta = host.weight_decay, host.max_delta


class PendingStep:
    """A training step submitted by :meth:`ResidentTrainer.step_async`. ``result()`` reads
    it back (once; it waits for the GPU) and returns its loss; ``done``: already read back
    (the trainer reads a pending step back when the next one is submitted)."""

    def __init__(self, trainer, plan, reads, index):
        self._trainer, self.plan, self.reads = trainer, plan, reads   # reads: _readback's
        self.index = index          # its submission (Gpu.submit_encoded), for the read-back
        self.scaler = trainer.scaler    # the loss scaler it ran with (updated by its result)
        self._loss = None

    @property
    def done(self) -> bool:
        return self._loss is not None

    def result(self) -> float:
        if self._loss is None:
            self._trainer._resolve(self)
        return self._loss
