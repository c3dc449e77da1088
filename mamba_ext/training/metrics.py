"""The per-step metrics file of a training run (``metrics.jsonl`` beside the checkpoint).

One JSON object per line, written as the run goes (follow it with ``tail -f``, plot it with
any tool): ``step`` (1-based: steps done), ``loss`` (that step's mean cross-entropy),
``lr``, ``grad_norm`` (the global gradient norm before clipping; null where the step does
not compute it: CPU mixed precision), ``skipped`` (steps skipped so far in this call),
``tokens_per_s`` (since this call started); the last line of a finished run adds
``held_out`` (the held-out loss, null without held-out batches). A resumed run keeps the
lines of the steps its checkpoint holds and continues after them.
"""
from __future__ import annotations

import json
import math
import os

METRICS_NAME = "metrics.jsonl"


def _num(v):
    """A JSON number, or null for None / NaN / inf (the file stays valid JSON)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class MetricsFile:
    """Appends one line per step to ``path``; ``start``: the step the run starts from
    (lines of later steps, left by a run that went further than its last checkpoint, are
    dropped, atomically, before the first append)."""

    def __init__(self, path: str, start: int):
        from ..io.checkpoint import atomic_write
        self.path = path
        kept = []
        if start > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:          # a line cut short by a killed run
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("step"), int) \
                            and rec["step"] <= start:
                        kept.append(json.dumps(rec, allow_nan=False))
        text = "".join(s + "\n" for s in kept).encode()
        atomic_write(path, lambda f: f.write(text))
        self._f = open(path, "a", encoding="utf-8")

    def step(self, step: int, loss, lr, grad_norm, skipped: int, tokens_per_s) -> None:
        """The line of step ``step`` (0-based; written as ``step + 1``)."""
        self._write({"step": step + 1, "loss": _num(loss), "lr": _num(lr),
                     "grad_norm": _num(grad_norm), "skipped": int(skipped),
                     "tokens_per_s": _num(tokens_per_s)})

    def finish(self, step: int, held_out) -> None:
        """The held-out loss at the end (``step`` steps done), then close."""
        self._write({"step": int(step), "held_out": _num(held_out)})
        self.close()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def _write(self, rec) -> None:
        self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()
