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
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..io import checkpoint as ckpt_io
from .data import VOCAB_SIZE, ByteBatches, load_corpus, DEFAULT_MAX_BYTES
from ..model import init_model_params, model_forward, model_loss_and_grads

CHECKPOINT_NAME = "checkpoint.safetensors"
PLOT_NAME = "loss.png"


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
    eps: float = 1e-6
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

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"config: unknown key(s) {unknown}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``lr * min_lr_frac``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    t = min(1.0, t)
    lo = cfg.lr * cfg.min_lr_frac
    return lo + 0.5 * (cfg.lr - lo) * (1.0 + math.cos(math.pi * t))


def amp_step(tokens, targets, params, opt, scaler, *, grad_clip=1.0, checkpointing=False,
             eps=1e-6, n_threads=None, reduce=None):
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


def _make_optimizer(cfg: TrainConfig, params: dict):
    from ..optim import AdamW
    return AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                 weight_decay=cfg.weight_decay, max_delta=cfg.max_delta)


def _set_lr(opt, lr: float) -> None:
    opt.lr = lr


def evaluate(params, batches, eps=1e-6, n_threads=None) -> float | None:
    """Mean loss over the fixed held-out batches (None if there are none)."""
    vals = batches.val_batches()
    if not vals:
        return None
    total = 0.0
    for tok, tgt in vals:
        logits = model_forward(tok, params, eps=eps, n_threads=n_threads).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
        total += float(np.mean(lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]))
    return total / len(vals)


def save_state(path, cfg, step, params, opt, scaler, losses, dist=None) -> None:
    """``opt``: an AdamW or the GPU ResidentTrainer; both give the same
    ``state_dict()`` format, so CPU and GPU checkpoints hold the same keys.
    ``dist``: distributed run; only its root writes, adding the data position
    of every rank."""
    if dist is not None and not dist.is_root:
        return
    extra = {"scaler": scaler.state_dict() if scaler is not None else None}
    if dist is not None:
        extra["distributed"] = dist.data_state(step)
    opt_state = opt.state_dict() if opt is not None else None
    ckpt_io.save_checkpoint(path, params, step=step, config=cfg.to_dict(),
                            optimizer_state=opt_state,
                            extra=extra, arrays={"losses": np.asarray(losses, np.float64)})


def _loop(cfg, start, end, batches, params, opt, scaler, trainer, losses, path, bar,
          dist=None) -> int:
    """Steps ``start .. end-1``; appends to ``losses``; returns the number of
    AMP steps skipped on overflow."""
    from ..optim import clip_grad_norm
    tokens_per_step = cfg.batch * cfg.seq_len * (1 if dist is None else dist.size)
    skipped = 0
    reduce = None if dist is None else dist.reduce
    for step in range(start, end):
        tok, tgt = batches.get(step)
        lr = lr_at(cfg, step)
        if dist is not None:
            dist.step = step
        if trainer is not None:
            trainer.lr = lr
            loss = float(trainer.step(tok, tgt) if reduce is None
                         else trainer.step(tok, tgt, reduce=reduce))
        elif scaler is not None:
            _set_lr(opt, lr)
            loss, applied = amp_step(tok, tgt, params, opt, scaler, grad_clip=cfg.grad_clip,
                                     checkpointing=cfg.checkpointing, eps=cfg.eps,
                                     n_threads=cfg.threads, reduce=reduce)
            skipped += not applied
        else:
            _set_lr(opt, lr)
            loss, grads = model_loss_and_grads(tok, tgt, params, checkpointing=cfg.checkpointing,
                                               eps=cfg.eps, n_threads=cfg.threads)
            if reduce is not None:
                grads, loss, _ = reduce(grads, loss, False)
            if cfg.grad_clip:
                clip_grad_norm(grads, cfg.grad_clip)
            opt.step(grads)
        losses.append(loss)
        bar.update(step, float(np.mean(losses[-20:])), (step + 1 - start) * tokens_per_step,
                   force=step + 1 == end)
        if dist is not None:
            dist.check_weights(step + 1, trainer.params if trainer is not None else lambda: params)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < end:
            if trainer is not None:
                if dist is None or dist.is_root:
                    save_state(path, cfg, step + 1, trainer.params(), trainer, None, losses, dist)
            else:
                save_state(path, cfg, step + 1, params, opt, scaler, losses, dist)
    return skipped


def train(cfg: TrainConfig, out_dir, *, resume=None, progress=sys.stderr, log=None,
          stop_after=None, dist=None) -> dict:
    """Run (or continue, with ``resume`` = a checkpoint path) a training run.

    ``stop_after``: stop after that many total steps as an interrupted run
    would (checkpoint written; the learning-rate schedule still targets
    ``cfg.steps``), e.g. to continue later with ``resume``. On Ctrl-C the last
    periodic checkpoint is kept.

    ``dist``: a ``mamba_ext.training.distributed.Distributed`` for data-parallel
    training (``cfg.batch`` is then the per-rank batch; only its root writes
    files; docs/distributed.md).

    Returns a summary dict: ``losses`` (every step's training loss, from step 0),
    ``final_loss`` (mean of the last 50 steps), ``val_loss``, ``tokens_per_s``,
    ``wall_s``, ``checkpoint`` and ``plot`` paths, ``params``.
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    if dist is None or dist.is_root:
        os.makedirs(out_dir, exist_ok=True)
    start, losses, state = 0, [], None
    if resume is not None:
        state = ckpt_io.load_checkpoint(resume)
        steps, threads = cfg.steps, cfg.threads   # the only settings a resume may change
        cfg = TrainConfig.from_dict(state["config"])
        cfg.steps, cfg.threads = steps, threads
        start = state["step"]
        losses = [float(v) for v in state["arrays"].get("losses", np.zeros(0))][:start]
        log(f"resuming from {resume} at step {start}")
    if cfg.device not in ("cpu", "gpu"):
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {cfg.device!r}")

    corpus = load_corpus(cfg.data, cfg.max_bytes)
    if dist is None:
        batches = ByteBatches(corpus, cfg.seq_len, cfg.batch, cfg.seed)
    else:
        batches = dist.shard(corpus, cfg.seq_len, cfg.batch, cfg.seed, start,
                             state["extra"].get("distributed") if state is not None else None)
    if state is not None:
        params = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state["params"].items()}
    else:
        params = init_model_params(VOCAB_SIZE, cfg.d_model, cfg.n_layers, d_state=cfg.d_state,
                                   d_conv=cfg.d_conv, expand=cfg.expand, seed=cfg.seed)
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
    if cfg.device == "gpu":
        if cfg.amp:
            raise ValueError("--amp is not supported with --device gpu")
        try:
            from ..gpu import ResidentTrainer
        except Exception as e:  # wgpu missing, no adapter, executor not built ...
            raise RuntimeError(f"--device gpu: the GPU executor is unavailable ({e}); "
                               f"install mamba_ext[gpu] or use --device cpu") from None
        trainer = ResidentTrainer(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                                  weight_decay=cfg.weight_decay, max_delta=cfg.max_delta,
                                  clip=cfg.grad_clip, model_eps=cfg.eps)
        if state is not None and state["optimizer_state"]:
            trainer.load_state_dict(state["optimizer_state"])
    else:
        opt = _make_optimizer(cfg, params)
        if state is not None and state["optimizer_state"]:
            opt.load_state_dict(state["optimizer_state"])
        if cfg.amp:
            from ..amp import DynamicLossScaler
            scaler = DynamicLossScaler()
            if state is not None and state["extra"].get("scaler"):
                scaler.load_state_dict(state["extra"]["scaler"])

    path = os.path.join(out_dir, CHECKPOINT_NAME)
    bar = _Progress(progress, cfg.steps, start)
    t0 = time.perf_counter()
    skipped = 0
    end = max(start, cfg.steps if stop_after is None else min(cfg.steps, int(stop_after)))
    try:
        skipped = _loop(cfg, start, end, batches, params, opt, scaler, trainer, losses, path, bar,
                        dist)
    except KeyboardInterrupt:
        # the step in flight may have half-updated the weights: keep the last
        # complete checkpoint rather than saving this state
        bar.close()
        log(f"interrupted; {path} holds the last checkpoint (resume with --resume)")
        raise
    wall = time.perf_counter() - t0
    bar.close()
    if trainer is not None:
        params, opt = trainer.params(), trainer
    done = end - start
    if dist is not None:
        dist.check_weights(end, lambda: params, force=True)
        if not dist.is_root:     # only the root writes files
            return {"losses": losses, "final_loss": float(np.mean(losses[-50:])) if losses else
                    float("nan"), "wall_s": wall, "steps": cfg.steps, "skipped_steps": skipped,
                    "checkpoint": path, "params": params}
    save_state(path, cfg, end, params, opt, scaler, losses, dist)
    from .plot import write_loss_curve
    plot_path = os.path.join(out_dir, PLOT_NAME)
    write_loss_curve(plot_path, losses, reference=math.log(VOCAB_SIZE))
    val = evaluate(params, batches, cfg.eps, cfg.threads)
    ranks = 1 if dist is None else dist.size
    tps = done * ranks * cfg.batch * cfg.seq_len / wall if wall > 0 else 0.0
    final = float(np.mean(losses[-50:])) if losses else float("nan")
    summary = {"losses": losses, "final_loss": final, "val_loss": val, "tokens_per_s": tps,
               "wall_s": wall, "steps": cfg.steps, "skipped_steps": skipped,
               "checkpoint": path, "plot": plot_path, "params": params}
    text = json.dumps({k: v for k, v in summary.items() if k not in ("losses", "params")}, indent=1)
    ckpt_io.atomic_write(os.path.join(out_dir, "summary.json"), lambda f: f.write(text.encode()))
    log(f"done: {done} steps in {wall:.1f} s, {tps:,.0f} tokens/s; "
        f"loss {losses[0] if losses else float('nan'):.3f} -> {final:.3f} (mean of last 50 steps; "
        f"ln(256) = {math.log(VOCAB_SIZE):.3f})"
        + (f", held-out loss {val:.3f}" if val is not None else "")
        + (f", {skipped} steps skipped on fp16 overflow" if cfg.amp else ""))
    log(f"checkpoint: {path}\nloss curve: {plot_path}")
    return summary
