"""Compiled selective scan (C contract: _scan.pxd)."""
from typing import Literal

import numpy as np

def float32_function(which: Literal["exp", "expm1", "log1p_unit", "softplus", "sigmoid"],
                     x: np.ndarray, out: np.ndarray) -> None: ...
