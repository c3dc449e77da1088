"""Compiled Mamba-1 block kernels (public API: mamba_ext.block; C contract: block.pxd).

sizes = (B, L, Dm, D, N, K, R); params / grads: the 13 arrays in BLOCK_PARAM_NAMES order.
"""
import numpy as np

# The constants of the maths, from their single definition csrc/mx_constants.h.
A_LOG_MIN: float      # A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX))
A_LOG_MAX: float
DEFAULT_EPS: float    # RMSNorm epsilon of the reference semantics
SCAN_CHUNK: int       # steps per chunk of the CPU scan (hstate is stored per chunk)

def cache_len(sizes: tuple[int, ...]) -> int: ...
def window_len(sizes: tuple[int, ...], itemsize: int) -> int: ...   # rows of one window
def hash_bytes(a: np.ndarray) -> int: ...    # 64-bit hash of a C-contiguous array's bytes
def _set_window_bytes(n: int) -> int: ...    # testing hook: the window budget; returns the old
def sealed(a: np.ndarray) -> np.ndarray: ...   # a read-only copy that cannot be made writeable
def sealed_empty(n: int, dtype) -> np.ndarray: ...   # the same, 1-D, contents undefined
def cache_pool(limit: int | None = None) -> tuple[int, int]: ...   # (bytes held, limit) of freed caches kept
def forward(x: np.ndarray, params: list[np.ndarray], out: np.ndarray, cache: np.ndarray,
            sizes: tuple[int, ...], eps: float, discretization: int, n_threads: int,
            h0: np.ndarray | None = None, conv_state: np.ndarray | None = None,
            h_last: np.ndarray | None = None, conv_tail: np.ndarray | None = None) -> None: ...
def backward(dx: np.ndarray, grads: list[np.ndarray], dout: np.ndarray, cache: np.ndarray,
             params: list[np.ndarray], sizes: tuple[int, ...], discretization: int,
             n_threads: int, conv_state: np.ndarray | None = None,
             dh_last: np.ndarray | None = None, dconv_tail: np.ndarray | None = None,
             dh0: np.ndarray | None = None, dconv_state: np.ndarray | None = None) -> None: ...
