"""Compiled Mamba-1 language model (public API: mamba_ext.model; C contract: model.pxd).

sizes = (V, n_layers, B, L, Dm, D, N, K, R); layers / g_layers: per layer, 13 arrays.
states: None or (h0, conv_state, h_last, conv_tail), each None or a C-contiguous array
(n_layers, B, D, N) / (n_layers, B, D, K-1); h_last and conv_tail are written.
"""
from typing import Callable, Sequence

import numpy as np

def _raise_status(status: int) -> None: ...
def workspace_bytes(sizes: Sequence[int], checkpointing: bool, itemsize: int) -> int: ...
def sequence_groups(sizes: Sequence[int], checkpointing: bool = False) -> tuple[int, int]: ...
def _set_group_rows(n: int) -> int: ...    # testing hook: the rows of a sequence group; returns the old
def forward(logits: np.ndarray, tokens: np.ndarray, embedding: np.ndarray,
            final_norm: np.ndarray, lm_head_bias: np.ndarray, layers: list,
            sizes: Sequence[int], eps: float, discretization: int,
            n_threads: int, states: tuple | None = None) -> None: ...
def loss_and_grads(tokens: np.ndarray, targets: np.ndarray, embedding: np.ndarray,
                   final_norm: np.ndarray, lm_head_bias: np.ndarray, layers: list,
                   g_embedding: np.ndarray, g_final_norm: np.ndarray,
                   g_lm_head_bias: np.ndarray, g_layers: list, sizes: Sequence[int],
                   eps: float, discretization: int, loss_scale: float, checkpointing: bool,
                   n_threads: int, states: tuple | None = None,
                   grads_done: Callable[[int], None] | None = None) -> float: ...
