"""The benchmark sizes shared by the CPU and GPU benchmarks.

Size letters: Dm dModel, D dInner, N dState, K dConv, R dtRank, B batch, L seqLen.
"""
from __future__ import annotations

import math

# name -> (Dm, D, N, K, R, B, L); R = ceil(Dm/16) unless given
SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "a": (64, 128, 16, 4, math.ceil(64 / 16), 2, 256),
    "b": (128, 256, 16, 4, math.ceil(128 / 16), 1, 512),
    "c": (768, 1536, 16, 4, 48, 1, 1024),
    # the GPU training size of issue 10 (named explicitly: "all" is a, b, c)
    "d": (768, 1536, 16, 4, 48, 8, 2048),
}

# Whole-model training steps of the GPU bench (``bench --device gpu --train-step``):
# name -> (V, Dm, n_layers, B, L); the two model rows of the mamba_ssm anchor.
TRAIN_STEPS: dict[str, tuple[int, int, int, int, int]] = {
    "24x768": (256, 768, 24, 8, 1024),
    "4x256": (256, 256, 4, 16, 512),
    "24x768-L8192": (256, 768, 24, 1, 8192),     # long sequences (issue 10)
}
