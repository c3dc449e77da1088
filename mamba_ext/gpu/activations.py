"""Elementwise steps on the GPU (kernels/activations.wgsl), the mirror of
mamba_ext/cpu/activations.pxd: the SiLU gate (softplus of dt_proj's output is
computed by the scan kernels where they read delta_pre, kernels/scan.wgsl).

Size letters: M = B*L rows, D dInner.
"""
from __future__ import annotations

import math

from .device import column_sum_final, column_sum_part, elementwise

# gate_backward_f16's row blocks: at most this many (the partial sums column_sum_final adds)
_GATE_ROW_BLOCKS = 128


def gate_forward(g, M, D, y, Y, gated):
    """Op: gated (M, D) = y * SiLU(z), z = Y[:, D:2D]."""
    return elementwise(g, "activations", "gate_forward", M * D, [M * D, D, 2 * D], [y, Y, gated])


def gate_forward_f16(g, M, D, y, Y, y16, Y16, gated16, gated16_t):
    """Op of the f16 mode's forward (BlockLayer): gated = y * SiLU(z) as
    :func:`gate_forward` computes it, written only as f16 copies, row-major into
    ``gated16`` (M, D) and transposed into ``gated16_t`` (D, M) (out_proj's operands), with
    y (M, D) and Y (M, 2D) rounded to f16 into ``y16`` and ``Y16`` (the backward's cache):
    one read of y and Y for what the gate and four packs took. M and D multiples of 64."""
    if M % 64 or D % 64:
        raise ValueError(f"mamba_ext.gpu.gate_forward_f16: M {M} and D {D} must be "
                         f"multiples of 64")
    return g.op("activations", "gate_forward_f16",
                g.check_grid((D // 64, M // 64, 1), "gate_forward_f16"), [M * D, D, 2 * D],
                [y, Y, y16, Y16, gated16, gated16_t])


def gate_backward(g, M, D, dgated, y, Y, dy, dY, half=False):
    """Op: dy (M, D) = dgated * SiLU(z); dY[:, D:2D] = dgated * y * SiLU'(z); y and Y
    f32, or f16 pairs with ``half`` (the f16 mode's cache)."""
    if half and D % 2:
        raise ValueError(f"mamba_ext.gpu.gate_backward: f16 pairs need an even D, got {D}")
    return elementwise(g, "activations", "gate_backward", M * D // (2 if half else 1),
                       [M * D, D, 2 * D], [dgated, y, Y, dy, dY], constants={"HALF": bool(half)})


def gate_backward_f16(g, M, D, dgated, y16, Y16, dy, dY16, grad, db_off):
    """Ops of the f16 mode's backward (BlockLayer): :func:`gate_backward` on the f16 cache
    (y16 (M, D), Y16 (M, 2D): f16 pairs), dy (M, D) f32 as it computes it, the z half of dY
    written only as f16 pairs into ``dY16`` (M, 2D) (in_proj's operand), and in_proj's bias
    gradient of the z half, grad[db_off + D + j] += the column sums of dz (the f32 values:
    per row block, then over the blocks in a fixed order), from the same pass. D a multiple of 64."""
    if D % 64:
        raise ValueError(f"mamba_ext.gpu.gate_backward_f16: D must be a multiple of 64, got {D}")
    rows_per = 32 * max(1, math.ceil(M / (32 * _GATE_ROW_BLOCKS)))   # whole steps of 8 x GB_ROWS
    RB = math.ceil(M / rows_per)
    part = column_sum_part(g, RB, D)
    return [g.op("activations", "gate_backward_f16",
                 g.check_grid((D // 64, RB, 1), "gate_backward_f16"), [M, D, rows_per],
                 [dgated, y16, Y16, dy, dY16, part]),
            column_sum_final(g, D, RB, part, grad, db_off + D, dgated)]
