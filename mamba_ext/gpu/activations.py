"""Elementwise steps on the GPU (kernels/activations.wgsl), the mirror of
mamba_ext/cpu/activations.pxd: the SiLU gate (softplus of dt_proj's output is
computed by the scan kernels where they read delta_pre, kernels/scan.wgsl).

Size letters: M = B*L rows, D dInner.
"""
from __future__ import annotations

from .device import elementwise


def gate_forward(g, M, D, y, Y, gated):
    """Op: gated (M, D) = y * SiLU(z), z = Y[:, D:2D]."""
    return elementwise(g, "activations", "gate_forward", M * D, [M * D, D, 2 * D], [y, Y, gated])


def gate_backward(g, M, D, dgated, y, Y, dy, dY, half=False):
    """Op: dy (M, D) = dgated * SiLU(z); dY[:, D:2D] = dgated * y * SiLU'(z); y and Y
    f32, or f16 pairs with ``half`` (the f16 mode's cache)."""
    return elementwise(g, "activations", "gate_backward", M * D, [M * D, D, 2 * D],
                       [dgated, y, Y, dy, dY], constants={"HALF": bool(half)})
