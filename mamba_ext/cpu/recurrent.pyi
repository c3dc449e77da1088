"""The compiled recurrent step of the whole model (public API: mamba_ext.recurrent).

layers: per layer, a tuple of 14 arrays in LAYER_ARRAYS order; the HALF_ARRAYS and the
embedding are uint16 (float16 bits) when ``half``.
"""
import numpy as np

LAYER_ARRAYS: tuple[str, ...]
HALF_ARRAYS: tuple[str, ...]

def mixer_step_arrays(out: np.ndarray, xn: np.ndarray, layer: tuple, h: np.ndarray,
                      tail: np.ndarray, zoh: bool, n_threads: int = 0) -> None: ...

class Stepper:
    def __init__(self, batch: int, embedding: np.ndarray, final_norm: np.ndarray,
                 lm_head_bias: np.ndarray, layers: list, h: list[np.ndarray],
                 conv: list[np.ndarray], eps: float, zoh: bool, half: bool,
                 n_threads: int) -> None: ...
    def step(self, ids: np.ndarray, logits: np.ndarray) -> None: ...
    def greedy(self, logits: np.ndarray, out: np.ndarray) -> int: ...
