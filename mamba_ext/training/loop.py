"""Training loop of a byte-level Mamba-1 language model (CPU, or the GPU executor).

One step: the batch of step ``k`` (a pure function of seed and ``k``, see
``mamba_ext.training.data``), loss and exact gradients (``model_loss_and_grads``),
global-norm clipping, AdamW with a warmup + cosine learning rate. With
``amp=True`` the forward/backward runs on the fp16-rounded view of the fp32
master weights with a dynamic loss scale; gradients are rounded to fp16,
unscaled, checked, and the step is skipped (optimizer moments untouched) on
overflow. Checkpoints (params, optimizer and scaler state, step, config, loss
history) are safetensors files written atomically; resuming continues exactly
as an uninterrupted run would (same batches, same learning rates, same state).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from .._validate import MAX_DIM, MAX_ELEMENTS, check_eps, check_n_threads, check_size
from ..constants import DEFAULT_EPS
from ..io import checkpoint as ckpt_io
from ..block import check_init
from ..model import MAX_LAYERS, init_model_params, model_forward, model_loss_and_grads
from . import hf_init
from .data import DEFAULT_MAX_BYTES, VOCAB_SIZE, ContiguousBatches, load_corpus, stream_batches
from .metrics import METRICS_NAME, MetricsFile

CHECKPOINT_NAME = "checkpoint.safetensors"
PLOT_NAME = "loss.png"
SUMMARY_NAME = "summary.json"


@dataclass
class TrainConfig:
    """Everything that defines a run (stored in every checkpoint)."""
    data: str | None = None          # None: the Python standard library's .py sources
    max_bytes: int = DEFAULT_MAX_BYTES
    d_model: int = 64
    n_layers: int = 2
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    eps: float = DEFAULT_EPS         # RMSNorm epsilon
    seq_len: int = 128
    batch: int = 16
    steps: int = 1500
    lr: float = 4e-3
    min_lr_frac: float = 0.1         # cosine decay to lr * min_lr_frac
    warmup: int = 30
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.1
    max_delta: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    amp: bool = False
    checkpointing: bool = False
    checkpoint_every: int = 100
    device: str = "cpu"
    threads: int | None = None       # CPU threads of the kernels (None: OpenMP default)
    init: str = "mamba"              # weight initialisation (mamba_ext.block.INIT_SCHEMES)
    init_from: str | None = None     # a Hugging Face folder to fine-tune (training/hf_init.py)
    vocab_size: int = VOCAB_SIZE     # 256 bytes, or the checkpoint's vocabulary (init_from)
    dt_rank: int | None = None       # None: ceil(d_model / 16)
    discretization: str = "zoh"      # "euler" when fine-tuning a Hugging Face checkpoint
    carry_state: bool = False        # contiguous windows, state carried across steps (TBPTT)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config stored in a checkpoint: every field present, no unknown one, and
        every value valid (:meth:`validated`)."""
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        d = _with_absent_fields(d)
        unknown = sorted(set(d) - names)
        missing = sorted(names - set(d))
        if unknown or missing:
            raise ValueError(f"config: unknown key(s) {unknown}, missing key(s) {missing}")
        d = dict(d)
        if isinstance(d["betas"], list):
            d["betas"] = tuple(d["betas"])
        return cls(**d).validated()

    def validated(self) -> TrainConfig:
        """This config with every field checked: TypeError/ValueError naming the field."""
        def integer(name, lo, hi=MAX_DIM):
            setattr(self, name, check_size(f"config.{name}", getattr(self, name), lo=lo, hi=hi))

        def real(name, lo, hi=math.inf):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"config.{name}: expected a number, got {type(v).__name__} {v!r}")
            if not (math.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"config.{name}: expected a finite number in [{lo}, {hi}], got {v}")
            setattr(self, name, float(v))

        for name in ("data", "init_from"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"config.{name}: expected None or a path, got {getattr(self, name)!r}")
        integer("vocab_size", 1, MAX_ELEMENTS)
        if self.dt_rank is not None:
            integer("dt_rank", 1)
        if self.discretization not in ("zoh", "euler"):
            raise ValueError(f"config.discretization: expected 'zoh' or 'euler', got {self.discretization!r}")
        integer("max_bytes", 1, MAX_ELEMENTS)
        for name in ("d_model", "d_state", "d_conv", "expand", "seq_len", "batch"):
            integer(name, 1)
        integer("n_layers", 0, MAX_LAYERS)
        integer("steps", 0, MAX_ELEMENTS)
        integer("warmup", 0, MAX_ELEMENTS)
        integer("checkpoint_every", 0, MAX_ELEMENTS)
        integer("seed", 0, 2 ** 63 - 1)
        try:
            self.eps = check_eps(self.eps)
        except (TypeError, ValueError) as e:
            raise type(e)(f"config.{e}") from None
        real("lr", 0.0)
        real("min_lr_frac", 0.0, 1.0)
        real("weight_decay", 0.0)
        real("max_delta", 0.0)
        real("grad_clip", 0.0)
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(isinstance(b, numbers.Real) and not isinstance(b, bool)
                           and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"config.betas: expected two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)
        for name in ("amp", "checkpointing", "carry_state"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"config.{name}: expected true or false, got {getattr(self, name)!r}")
        try:
            check_init(self.init)
        except ValueError as e:
            raise ValueError(f"config.{e}") from None
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"config.device: expected 'cpu' or 'gpu', got {self.device!r}")
        _check_model_memory(self)
        if self.threads is not None:
            try:
                self.threads = check_n_threads(self.threads)
            except (TypeError, ValueError) as e:
                raise type(e)(f"config.threads: {e}") from None
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


# Fields added after checkpoints were already being written: the value a checkpoint
# without the field means (what the code of that time did).
_ABSENT_MEANS = {"init": "legacy", "init_from": None, "vocab_size": VOCAB_SIZE, "dt_rank": None,
                 "discretization": "zoh", "carry_state": False}


def _with_absent_fields(d: dict) -> dict:
    """``d`` with the fields of :data:`_ABSENT_MEANS` it lacks filled in."""
    return {**_ABSENT_MEANS, **d}


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``lr * min_lr_frac``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    t = min(1.0, t)
    lo = cfg.lr * cfg.min_lr_frac
    return lo + 0.5 * (cfg.lr - lo) * (1.0 + math.cos(math.pi * t))


def amp_step(tokens, targets, params, opt, scaler, *, grad_clip=1.0, checkpointing=False,
             eps=DEFAULT_EPS, n_threads=None, reduce=None, discretization="zoh"):
    """One mixed-precision training step; returns ``(loss, applied)``.

    Forward/backward on ``fp16_view(params)`` (fp16-rounded copies of the fp32
    master weights) with the gradient seed multiplied by ``scaler.scale``; the
    gradients are rounded to fp16 (overflow -> inf, as fp16 storage would),
    checked, and on overflow the step is skipped: weights and optimizer moments
    stay untouched and the scale backs off. Otherwise they are unscaled in
    float32, clipped, and AdamW updates the fp32 master weights.
    ``reduce``: distributed hook ``(grads, loss, overflow) -> (grads, loss,
    overflow)`` (``Distributed.reduce``: mean over ranks, overflow of any rank).
    """
    from ..amp import fp16_view, round_fp16
    from ..optim import clip_grad_norm
    loss, grads = model_loss_and_grads(tokens, targets, fp16_view(params),
                                       checkpointing=checkpointing, eps=eps,
                                       discretization=discretization,
                                       loss_scale=scaler.scale, n_threads=n_threads)
    grads = {k: np.asarray(round_fp16(g), dtype=params[k].dtype) for k, g in grads.items()}
    overflow = bool(scaler.check(grads))
    if reduce is not None:
        grads, loss, overflow = reduce(grads, loss, overflow)
    if not overflow:
        scaler.unscale(grads)
        if grad_clip:
            clip_grad_norm(grads, grad_clip)
        opt.step(grads)
    applied = scaler.update(overflow)
    return loss, bool(applied)


class _Progress:
    """A plain ``\\r`` status line on a stream: step, loss, tokens/s, ETA."""

    def __init__(self, stream, total, first):
        self.stream, self.total, self.first = stream, total, first
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, step, loss, tokens, force=False):
        if self.stream is None:
            return
        now = time.perf_counter()
        if not force and now - self.last < 0.25:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        done = step + 1 - self.first
        eta = (self.total - step - 1) * dt / max(done, 1)
        self.stream.write(f"\rstep {step + 1:>6d}/{self.total}  loss {loss:7.4f}  "
                          f"{tokens / dt:9.0f} tok/s  ETA {int(eta) // 60:d}:{int(eta) % 60:02d}  ")
        self.stream.flush()

    def close(self):
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def _gpu_backend() -> str:
    """The GPU backend's name ("wgpu" or "dawn")."""
    from ..gpu.device import gpu
    return gpu().backend.NAME


def _make_optimizer(cfg: TrainConfig, params: dict):
    from ..optim import AdamW
    return AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                 weight_decay=cfg.weight_decay, max_delta=cfg.max_delta)


def _set_lr(opt, lr: float) -> None:
    opt.lr = lr


def evaluate(params, batches, eps=DEFAULT_EPS, n_threads=None, discretization="zoh") -> float | None:
    """Mean loss over the fixed held-out batches (None if there are none)."""
    vals = batches.val_batches()
    if not vals:
        return None
    total = 0.0
    for tok, tgt in vals:
        logits = model_forward(tok, params, eps=eps, discretization=discretization,
                               n_threads=n_threads).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
        total += float(np.mean(lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]))
    return total / len(vals)


def save_state(path, cfg, step, params, opt, scaler, losses, dist=None, carry=None,
               data=None) -> None:
    """``opt``: an AdamW or the GPU ResidentTrainer; both give the same
    ``state_dict()`` format, so CPU and GPU checkpoints hold the same keys.
    ``dist``: distributed run; only its root writes. ``data``: the batch source; a
    :class:`ShardedBatches` adds the stream position (and the ranks' slices of it).
    ``carry``: the state carried into the next step (``--carry-state``),
    ``(h, conv)`` or None, stored as arrays ``carry.h0`` / ``carry.conv_state``."""
    if dist is not None and not dist.is_root:
        return
    extra = {"scaler": scaler.state_dict() if scaler is not None else None}
    if hasattr(data, "state"):
        extra["distributed"] = data.state(step)
    opt_state = opt.state_dict() if opt is not None else None
    arrays = {"losses": np.asarray(losses, np.float64)}
    if carry is not None:
        arrays.update({CARRY_ARRAYS[0]: carry[0], CARRY_ARRAYS[1]: carry[1]})
    ckpt_io.save_checkpoint(path, params, step=step, config=cfg.to_dict(),
                            optimizer_state=opt_state, extra=extra, arrays=arrays)


@dataclass
class Run:
    """A training run as :func:`prepare` sets it up, for :func:`_loop` and :func:`finish`.

    ``start``/``end``: the steps of this call (``end`` may stop short of ``cfg.steps``);
    ``batches``: the batch source; ``opt`` (CPU AdamW) or ``trainer`` (the GPU's
    ResidentTrainer); ``scaler``: the AMP loss scaler or None; ``losses``: every step's
    loss from step 0 (appended to); ``path``: the checkpoint; ``dist``: the distributed
    run or None; ``carry`` (``--carry-state``): a one-element list holding the state
    ``(h, conv)`` the next step starts from (None: zeros); ``metrics``: the per-step
    MetricsFile (None on ranks other than the root); ``skipped``/``wall``: filled in by
    :func:`train` after the loop."""
    cfg: TrainConfig
    out_dir: str
    start: int
    end: int
    batches: object
    params: dict
    opt: object
    scaler: object
    trainer: object
    losses: list
    path: str
    dist: object = None
    carry: list | None = None
    metrics: MetricsFile | None = None
    log: object = print
    skipped: int = 0
    wall: float = 0.0


def _loop(run: Run, bar) -> int:
    """Steps ``run.start .. run.end-1``; appends to ``run.losses``; returns the number of
    steps skipped (AMP overflow, the optimizer's NaN guard: a non-finite gradient, or a
    step whose every element update was not finite and so left unchanged, e.g. an lr of
    1e300). ``run.carry`` is updated after every step. The GPU trainer without MPI
    submits each step before reading back the one before (``ResidentTrainer.step_async``:
    the same steps, the GPU not waiting for the host in between); a step after which a
    checkpoint is due is read back before the next one is submitted, so the checkpoint
    holds exactly the steps it counts. ``run.metrics`` gets a line per step."""
    from ..optim import clip_grad_norm
    cfg, start, end, batches, params = run.cfg, run.start, run.end, run.batches, run.params
    opt, scaler, trainer, losses, path = run.opt, run.scaler, run.trainer, run.losses, run.path
    dist, carry, metrics = run.dist, run.carry, run.metrics
    tokens_per_step = cfg.batch * cfg.seq_len * (1 if dist is None else dist.size)
    skipped = 0
    skipped_before = trainer.skipped if trainer is not None else 0
    reduce = None if dist is None else dist.reduce
    frozen = set(hf_init.frozen_names(params)) if cfg.init_from is not None else set()
    pipelined = trainer is not None and dist is None
    n_elements = sum(int(a.size) for a in params.values())
    seen_nonfinite = [opt.nonfinite if opt is not None else 0]
    grad_norm = [None]        # the last CPU step's norm before clipping (None: not computed)
    t_start = time.perf_counter()

    def void():
        # True when the last optimizer step left every element unchanged (its update was
        # not finite anywhere: applied in name only)
        n, seen_nonfinite[0] = opt.nonfinite - seen_nonfinite[0], opt.nonfinite
        return n >= n_elements

    def checkpoint_due(step):
        return bool(cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                    and step + 1 < end)

    def after(step, loss):
        """What follows step ``step`` once its loss is known."""
        losses.append(loss)
        if metrics is not None:
            gpu = trainer is not None
            metrics.step(step, loss, lr_at(cfg, step),
                         trainer.last_grad_norm if gpu else grad_norm[0],
                         trainer.skipped - skipped_before if gpu else skipped,
                         (step + 1 - start) * tokens_per_step
                         / max(time.perf_counter() - t_start, 1e-9))
        bar.update(step, float(np.mean(losses[-20:])), (step + 1 - start) * tokens_per_step,
                   force=step + 1 == end)
        if dist is not None:
            dist.check_weights(step + 1, trainer.params if trainer is not None else lambda: params)
        if checkpoint_due(step):
            if trainer is not None:
                if dist is None or dist.is_root:
                    save_state(path, cfg, step + 1, trainer.params(), trainer, scaler, losses,
                               dist, data=batches)
            else:
                save_state(path, cfg, step + 1, params, opt, scaler, losses, dist,
                           carry=None if carry is None else carry[0], data=batches)

    pending = None            # (step, PendingStep) submitted by step_async, not read back
    for step in range(start, end):
        tok, tgt = batches.get(step)
        lr = lr_at(cfg, step)
        if dist is not None:
            dist.step = step
        if pipelined:
            trainer.lr = lr
            cur = trainer.step_async(tok, tgt)
            if pending is not None:
                after(pending[0], float(pending[1].result()))
            pending = (step, cur)
            if checkpoint_due(step) or step + 1 == end:
                pending = None
                after(step, float(cur.result()))
            continue
        if trainer is not None:
            trainer.lr = lr
            # the GPU trainer streams its gradients into the all-reduce (dist.flat_stream)
            loss = float(trainer.step(tok, tgt, reduce=dist))
        elif scaler is not None:
            _set_lr(opt, lr)
            before = opt.skipped
            loss, applied = amp_step(tok, tgt, params, opt, scaler, grad_clip=cfg.grad_clip,
                                     checkpointing=cfg.checkpointing, eps=cfg.eps,
                                     n_threads=cfg.threads, reduce=reduce,
                                     discretization=cfg.discretization)
            skipped += (not applied) or opt.skipped != before or void()
        else:
            _set_lr(opt, lr)
            kw = {}
            if carry is not None:        # truncated BPTT: the state enters as a constant
                if batches.starts_pass(step):
                    carry[0] = None
                h0, conv = carry[0] if carry[0] is not None else (None, None)
                kw = {"h0": h0, "conv_state": conv, "return_state": True}
            red = None if dist is None else dist.reducer(params).begin()
            loss, grads, *new_state = model_loss_and_grads(
                tok, tgt, params, checkpointing=cfg.checkpointing, eps=cfg.eps,
                discretization=cfg.discretization, n_threads=cfg.threads,
                grads_ready=_grads_ready(frozen, red), **kw)
            if carry is not None:
                carry[0] = new_state[0]
            if red is not None:
                grads, loss, _ = red.finish(loss, False)
            if cfg.grad_clip:
                grad_norm[0] = clip_grad_norm(grads, cfg.grad_clip)
            skipped += (not opt.step(grads)) or void()
        after(step, loss)
    if trainer is not None:
        skipped += trainer.skipped - skipped_before
    return skipped


def _grads_ready(frozen, red):
    """model_loss_and_grads's ``grads_ready`` in a CPU step: the ``frozen`` gradients
    zeroed (parameters without a Hugging Face counterpart, hf_init.py), then each bucket
    of ``red`` (a begun GradReducer, or None) all-reduced as soon as it is complete,
    during the backward of the layers below."""
    def ready(names, grads):
        for name in names:
            if name in frozen:
                grads[name][...] = 0
        if red is not None:
            red.add(names, grads)
    return ready


class TrainingFailed(RuntimeError):
    """The run finished but did not train: every step was skipped, or the final loss is
    not finite. ``summary`` holds what :func:`train` would have returned (its files,
    checkpoint and summary.json included, are written)."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


def parameter_count(cfg: TrainConfig) -> int:
    """Number of parameters of the model ``cfg`` describes (expected_param_shapes, summed,
    without building the dict: a config may ask for 10^8 layers)."""
    from .._validate import BLOCK_PARAM_NAMES, BlockDims, block_param_shapes
    dims = BlockDims(Dm=cfg.d_model, D=cfg.expand * cfg.d_model, N=cfg.d_state, K=cfg.d_conv,
                     R=cfg.dt_rank or -(-cfg.d_model // 16))
    per_layer = sum(math.prod(s) for n, s in block_param_shapes(dims).items()
                    if n in BLOCK_PARAM_NAMES)
    return cfg.n_layers * per_layer + cfg.vocab_size * (cfg.d_model + 1) + cfg.d_model


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_model_memory(cfg: TrainConfig) -> None:
    """Refuse, before anything is allocated, a model whose weights, gradients and two
    AdamW moments (4 float32 copies) alone exceed this machine's memory."""
    n = parameter_count(cfg)
    need, have = 16 * n, _physical_memory()
    if n > MAX_ELEMENTS or (have is not None and need > have):
        raise ValueError(f"config: the model has {n:,} parameters; its weights, gradients and "
                         f"optimizer state need {need / 2 ** 30:,.1f} GiB"
                         + (f", more than this machine's {have / 2 ** 30:,.1f} GiB" if have else "")
                         + "; use fewer or smaller layers")


def expected_param_shapes(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the model ``cfg`` describes (the layout of
    ``init_model_params``: dt_rank = ceil(d_model / 16), vocab 256)."""
    from .._validate import BLOCK_PARAM_NAMES, BlockDims, block_param_shapes
    dims = BlockDims(Dm=cfg.d_model, D=cfg.expand * cfg.d_model, N=cfg.d_state, K=cfg.d_conv,
                     R=cfg.dt_rank or -(-cfg.d_model // 16))
    V = cfg.vocab_size
    shapes = {"embedding": (V, cfg.d_model), "final_norm": (cfg.d_model,), "lm_head_bias": (V,)}
    block = block_param_shapes(dims)
    for i in range(cfg.n_layers):
        shapes.update({f"layer{i}.{n}": block[n] for n in BLOCK_PARAM_NAMES})
    return shapes


def load_training_checkpoint(path) -> dict:
    """A training checkpoint, checked against the model its config describes before
    anything uses it (``train --resume`` and ``sample`` both read through here).

    Returns ``config`` (a validated :class:`TrainConfig`), ``params`` (float32, the
    exact names and shapes of that model, all finite), ``step``, ``losses`` (one float
    per step done), ``optimizer_state`` and ``scaler_state`` (None or a dict; checked
    when loaded into the optimizer / scaler). Every problem is one ValueError naming
    the file and the field; integer tensors are never converted to weights.
    """
    fname = os.fspath(path)
    ck = ckpt_io.load_checkpoint(fname)
    try:
        cfg = TrainConfig.from_dict(ck["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{fname}: field '__metadata__.config': {e}") from None
    step = ck["step"]
    if step > cfg.steps:
        raise ValueError(f"{fname}: field '__metadata__.step': {step} is past the run's "
                         f"{cfg.steps} steps")
    want = expected_param_shapes(cfg)
    got = ck["params"]
    if set(got) != set(want):
        missing, unknown = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(f"{fname}: tensors 'param.*': missing {missing[:5]}, unknown {unknown[:5]} "
                         f"for the model of its config")
    params = {}
    for name, shape in want.items():
        a = got[name]
        if a.dtype != np.float32:
            raise ValueError(f"{fname}: tensor 'param.{name}': field 'dtype': {a.dtype}, expected "
                             f"float32 (F32)")
        if a.shape != shape:
            raise ValueError(f"{fname}: tensor 'param.{name}': field 'shape': {list(a.shape)}, "
                             f"expected {list(shape)} for the model of its config")
        if not np.isfinite(a).all():
            raise ValueError(f"{fname}: tensor 'param.{name}': holds NaN or Inf")
        params[name] = np.ascontiguousarray(a)
    arrays = ck["arrays"]
    carry = _checked_carry(fname, cfg, arrays)
    unknown = sorted("array." + k for k in set(arrays) - {"losses"} - set(CARRY_ARRAYS))
    if unknown:
        raise ValueError(f"{fname}: unknown tensor(s) {unknown}")
    losses = arrays.get("losses", np.zeros(0))
    if losses.dtype != np.float64 or losses.ndim != 1 or losses.size != step:
        raise ValueError(f"{fname}: tensor 'array.losses': expected {step} float64 values (one per "
                         f"step), got {losses.dtype} of shape {list(losses.shape)}")
    extra = ck["extra"]
    known_extra = {"scaler", "distributed"}     # distributed: the data stream's position
    if set(extra) - known_extra:
        raise ValueError(f"{fname}: field '__metadata__.extra': unknown key(s) "
                         f"{sorted(set(extra) - known_extra)}")
    scaler_state = extra.get("scaler")
    if scaler_state is not None and not isinstance(scaler_state, dict):
        raise ValueError(f"{fname}: field '__metadata__.extra.scaler': expected an object or null")
    _check_data_state(fname, extra.get("distributed"))
    return {"config": cfg, "params": params, "step": step, "losses": [float(v) for v in losses],
            "optimizer_state": ck["optimizer_state"], "scaler_state": scaler_state,
            "extra": extra, "carry": carry}


CARRY_ARRAYS = ("carry.h0", "carry.conv_state")


def _checked_carry(fname, cfg, arrays):
    """The carried state of a ``--carry-state`` checkpoint: ``(h, conv)`` float32 of the
    shapes of the model and batch, or None (none stored: the next step starts from zeros)."""
    got = [arrays.get(k) for k in CARRY_ARRAYS]
    if all(a is None for a in got):
        return None
    D = cfg.expand * cfg.d_model
    shapes = ((cfg.n_layers, cfg.batch, D, cfg.d_state), (cfg.n_layers, cfg.batch, D, cfg.d_conv - 1))
    for k, a, shape in zip(CARRY_ARRAYS, got, shapes):
        if not cfg.carry_state or a is None or a.dtype != np.float32 or a.shape != shape \
                or not np.isfinite(a).all():
            raise ValueError(f"{fname}: tensor 'array.{k}': expected finite float32 of shape "
                             f"{list(shape)} in a --carry-state run, got "
                             f"{None if a is None else (str(a.dtype), list(a.shape))}")
    return tuple(np.ascontiguousarray(a) for a in got)


def _check_data_state(fname: str, state) -> None:
    """``extra["distributed"]`` (ShardedBatches.state) of a checkpoint: None or its exact
    fields, with non-negative integer sizes and positions."""
    if state is None:
        return
    where = f"{fname}: field '__metadata__.extra.distributed'"
    fields = {"world_size", "batch_per_rank", "global_batch", "data_position", "rank_positions",
              "data_order"}
    if not isinstance(state, dict) or set(state) != fields:
        raise ValueError(f"{where}: expected an object with the fields {sorted(fields)}")
    for key in ("world_size", "batch_per_rank", "global_batch", "data_position"):
        if type(state[key]) is not int or state[key] < (0 if key == "data_position" else 1):
            raise ValueError(f"{where}.{key}: {state[key]!r} is not a valid count")
    positions = state["rank_positions"]
    if not isinstance(positions, list) or not all(type(v) is int and v >= 0 for v in positions):
        raise ValueError(f"{where}.rank_positions: expected a list of non-negative integers")
    if not isinstance(state["data_order"], str):
        raise ValueError(f"{where}.data_order: expected a string")


def _restore(fname, what, load, state) -> None:
    """Load optimizer/scaler state from a checkpoint: its errors name the file."""
    try:
        load(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{fname}: {what}: {e}") from None


def _finite_or_none(v):
    return v if v is not None and math.isfinite(v) else None


def prepare(cfg: TrainConfig, out_dir, *, resume=None, log=None, stop_after=None,
            dist=None) -> Run:
    """Everything a run needs before its first step (:func:`train`'s arguments): stale
    temporaries removed, the checkpoint to resume read and checked, the configuration
    validated, the corpus, the batch source, the parameters, the optimizer or GPU trainer
    with their restored state, the metrics file."""
    log = log or (lambda s: print(s, file=sys.stderr))
    if dist is None or dist.is_root:
        os.makedirs(out_dir, exist_ok=True)
        for name in (CHECKPOINT_NAME, PLOT_NAME, SUMMARY_NAME, METRICS_NAME):
            for stale in ckpt_io.remove_stale_temporaries(out_dir, name):
                log(f"removed {stale}, left by an interrupted write")
    start, losses, state = 0, [], None
    if resume is not None:
        steps, threads = cfg.steps, cfg.threads   # the only settings a resume may change
        state = load_training_checkpoint(resume)
        cfg = state["config"]
        if steps < state["step"]:
            # refused before anything is written: the checkpoint stays loadable
            raise ValueError(f"--steps {steps}: {resume} is at step {state['step']} already; "
                             f"resume with --steps >= {state['step']} (the run's total)")
        cfg.steps, cfg.threads = steps, threads
        start = state["step"]
        losses = state["losses"]
        log(f"resuming from {resume} at step {start}")
    if state is None and cfg.init_from is not None:
        cfg = hf_init.config_from_hf(cfg)
    cfg = cfg.validated()
    if cfg.init_from is not None and (cfg.amp or cfg.device != "cpu"):
        raise ValueError("--init-from: fine-tuning runs on the CPU without --amp (for now)")
    stop = None if stop_after is None else check_size("stop_after", stop_after, lo=0, hi=MAX_ELEMENTS)

    if cfg.init_from is not None:
        corpus = hf_init.corpus_tokens(cfg, cfg.max_bytes)
    else:
        corpus = load_corpus(cfg.data, cfg.max_bytes)
    if cfg.carry_state and (dist is not None or cfg.amp or cfg.device != "cpu"):
        raise ValueError("--carry-state: runs on the CPU, without --amp and without MPI (for now)")
    if cfg.carry_state:
        batches = ContiguousBatches(corpus, cfg.seq_len, cfg.batch, cfg.seed)
    else:   # one stream for one process and for P ranks
        pos = state["extra"].get("distributed") if state is not None else None
        batches = (stream_batches(corpus, cfg.seq_len, cfg.batch, cfg.seed, 0, 1, start, pos)
                   if dist is None else dist.shard(corpus, cfg.seq_len, cfg.batch, cfg.seed,
                                                   start, pos))
    if state is not None:
        params = state["params"]
    elif cfg.init_from is not None:
        params = hf_init.initial_params(cfg)
    else:
        params = init_model_params(VOCAB_SIZE, cfg.d_model, cfg.n_layers, d_state=cfg.d_state,
                                   d_conv=cfg.d_conv, expand=cfg.expand, seed=cfg.seed,
                                   init=cfg.init)
    if dist is not None:
        dist.start(cfg.to_dict(), params)
    n_params = sum(a.size for a in params.values())
    log(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, d_state {cfg.d_state}, "
        f"{n_params:,} parameters; corpus {corpus.size:,} bytes "
        f"({'Python stdlib sources' if cfg.data is None else cfg.data}); "
        f"batch {cfg.batch} x seq_len {cfg.seq_len}, {cfg.steps} steps on {cfg.device}"
        f"{', amp' if cfg.amp else ''}{', checkpointing' if cfg.checkpointing else ''}"
        + ("" if dist is None else f"; {dist.size} ranks, global batch {dist.size * cfg.batch}"))

    opt = scaler = trainer = None
    if cfg.amp:
        from ..amp import DynamicLossScaler
        scaler = DynamicLossScaler()
        if state is not None and state["scaler_state"]:
            _restore(resume, "field '__metadata__.extra.scaler'", scaler.load_state_dict,
                     state["scaler_state"])
    if cfg.device == "gpu":
        try:
            from ..gpu import ResidentTrainer
        except Exception as e:  # wgpu missing, no adapter, executor not built ...
            raise RuntimeError(f"--device gpu: the GPU executor is unavailable ({e}); "
                               f"install mamba_ext[gpu] or use --device cpu") from None
        trainer = ResidentTrainer(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                                  weight_decay=cfg.weight_decay, max_delta=cfg.max_delta,
                                  clip=cfg.grad_clip, model_eps=cfg.eps,
                                  discretization=cfg.discretization,
                                  checkpointing=cfg.checkpointing, scaler=scaler)
        if scaler is not None:
            log(f"amp on the GPU: {trainer.products(cfg.batch, cfg.seq_len)}")
        if dist is not None and dist.size > 1 and _gpu_backend() == "dawn":
            log("warning: GPU ranks on the Dawn backend ran on one GPU but are untested on "
                "several (docs/distributed.md); the backend CI tests GPU ranks on is "
                "wgpu-native (MAMBA_EXT_GPU_BACKEND=wgpu)")
        if state is not None and state["optimizer_state"]:
            _restore(resume, "optimizer state", trainer.load_state_dict, state["optimizer_state"])
    else:
        opt = _make_optimizer(cfg, params)
        if state is not None and state["optimizer_state"]:
            _restore(resume, "optimizer state", opt.load_state_dict, state["optimizer_state"])

    path = os.path.join(out_dir, CHECKPOINT_NAME)
    carry = [state["carry"] if state is not None else None] if cfg.carry_state else None
    metrics = (MetricsFile(os.path.join(out_dir, METRICS_NAME), start)
               if dist is None or dist.is_root else None)
    end = max(start, cfg.steps if stop is None else min(cfg.steps, stop))
    return Run(cfg=cfg, out_dir=out_dir, start=start, end=end, batches=batches, params=params,
               opt=opt, scaler=scaler, trainer=trainer, losses=losses, path=path, dist=dist,
               carry=carry, metrics=metrics, log=log)


def train(cfg: TrainConfig, out_dir, *, resume=None, progress=sys.stderr, log=None,
          stop_after=None, dist=None) -> dict:
    """Run (or continue, with ``resume`` = a checkpoint path) a training run.

    ``stop_after``: stop after that many total steps as an interrupted run
    would (checkpoint written; the learning-rate schedule still targets
    ``cfg.steps``), e.g. to continue later with ``resume``. On Ctrl-C the last
    periodic checkpoint is kept. Temporary files a killed run left in ``out_dir``
    (``.checkpoint.safetensors.*.tmp`` and the like) are removed at the start.

    ``dist``: a ``mamba_ext.training.distributed.Distributed`` for data-parallel
    training (``cfg.batch`` is then the per-rank batch; only its root writes
    files; docs/distributed.md).

    Returns a summary dict: ``losses`` (every step's training loss, from step 0),
    ``final_loss`` (mean of the last 50 steps), ``val_loss``, ``tokens_per_s``,
    ``wall_s``, ``skipped_steps`` (of this call), ``checkpoint`` and ``plot`` paths,
    ``params``; summary.json in ``out_dir`` holds the scalars (valid JSON: null for a
    missing or non-finite loss). Raises :class:`TrainingFailed` after writing every file
    when the steps run were all skipped or the final loss is not finite.
    """
    run = prepare(cfg, out_dir, resume=resume, log=log, stop_after=stop_after, dist=dist)
    bar = _Progress(progress, run.cfg.steps, run.start)
    t0 = time.perf_counter()
    try:
        run.skipped = _loop(run, bar)
    except BaseException as e:
        if run.metrics is not None:      # the lines written so far stay; a resume continues them
            run.metrics.close()
        if isinstance(e, KeyboardInterrupt):
            # the step in flight may have half-updated the weights: keep the last
            # complete checkpoint rather than saving this state
            bar.close()
            run.log(f"interrupted; {run.path} holds the last checkpoint (resume with --resume)")
        raise
    run.wall = time.perf_counter() - t0
    bar.close()
    return finish(run)


def finish(run: Run) -> dict:
    """After the loop: the final checkpoint, the held-out loss, the metrics' last line,
    loss.png, summary.json and the closing log lines; :func:`train`'s summary (or
    :class:`TrainingFailed`)."""
    cfg, out_dir, start, end, batches = run.cfg, run.out_dir, run.start, run.end, run.batches
    params, opt, scaler, trainer, losses = run.params, run.opt, run.scaler, run.trainer, run.losses
    path, dist, carry, metrics, log = run.path, run.dist, run.carry, run.metrics, run.log
    skipped, wall = run.skipped, run.wall
    if trainer is not None:
        params, opt = trainer.params(), trainer
    done = end - start
    if dist is not None:
        dist.check_weights(end, lambda: params, force=True)
        if not dist.is_root:     # only the root writes files
            return {"losses": losses, "final_loss": float(np.mean(losses[-50:])) if losses else
                    float("nan"), "wall_s": wall, "steps": cfg.steps, "skipped_steps": skipped,
                    "checkpoint": path, "params": params}
    save_state(path, cfg, end, params, opt, scaler, losses, dist,
               carry=None if carry is None else carry[0], data=batches)
    with np.errstate(all="ignore"):
        val = evaluate(params, batches, cfg.eps, cfg.threads, cfg.discretization)
        final = float(np.mean(losses[-50:])) if losses else float("nan")
    metrics.finish(end, val)
    from .plot import write_loss_curve
    plot_path = os.path.join(out_dir, PLOT_NAME)
    plot_writer = write_loss_curve(plot_path, losses, reference=math.log(cfg.vocab_size),
                                   held_out=val,
                                   reference_label=f"ln({cfg.vocab_size}) = uniform guess")
    ranks = 1 if dist is None else dist.size
    tps = done * ranks * cfg.batch * cfg.seq_len / wall if wall > 0 else 0.0
    failure = None
    if done and skipped == done:
        failure = (f"every one of the {done} steps was skipped (non-finite gradients or fp16 "
                   f"overflow); nothing was learned: lower --lr")
    elif done and not math.isfinite(final):
        failure = (f"the loss is not finite ({final}) after {end} steps ({skipped} of {done} steps "
                   f"skipped): the run diverged; lower --lr")
    summary = {"losses": losses, "final_loss": final, "val_loss": val, "tokens_per_s": tps,
               "wall_s": wall, "steps": cfg.steps, "steps_run": done, "skipped_steps": skipped,
               "status": "failed" if failure else "ok", "error": failure,
               "checkpoint": path, "plot": plot_path, "metrics": metrics.path, "params": params}
    scalars = {k: v for k, v in summary.items() if k not in ("losses", "params")}
    scalars["final_loss"] = _finite_or_none(final)
    scalars["val_loss"] = _finite_or_none(val)
    text = json.dumps(scalars, indent=1, allow_nan=False)
    ckpt_io.atomic_write(os.path.join(out_dir, SUMMARY_NAME), lambda f: f.write(text.encode()))
    log(f"done: {done} steps in {wall:.1f} s, {tps:,.0f} tokens/s; "
        f"loss {losses[0] if losses else float('nan'):.3f} -> {final:.3f} (mean of last 50 steps; "
        f"ln({cfg.vocab_size}) = {math.log(cfg.vocab_size):.3f})"
        + (f", held-out loss {val:.3f}" if val is not None else "")
        + (f", {skipped} steps skipped" if skipped or cfg.amp else ""))
    drawn = ("matplotlib" if plot_writer == "matplotlib"
             else "the built-in writer; pip install matplotlib for a finer one")
    log(f"checkpoint: {path}\nloss curve: {plot_path} (drawn by {drawn})"
        f"\nmetrics per step: {metrics.path}")
    if cfg.init_from is not None:
        summary["hf"] = hf_init.write_hf(out_dir, cfg, params)
        log(f"Hugging Face folder: {summary['hf']}")
    if failure:
        raise TrainingFailed(f"training failed: {failure} (summary: {os.path.join(out_dir, SUMMARY_NAME)})",
                             summary)
    return summary
