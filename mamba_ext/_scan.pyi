"""Compiled selective scan (C contract: _scan.pxd)."""
import numpy as np

def expm1f_vec(x: np.ndarray, out: np.ndarray) -> None: ...
