"""Linear layers on the GPU (kernels/linear.wgsl), the mirror of mamba_ext/cpu/linear.pyx.

``Y = X @ W^T + b`` with X (M, I), W (O, I), Y (M, O): :func:`linear_forward`
(bias and residual added in the GEMM's store), :func:`linear_backward` (dX, dW
and db). Operands are addressed by offset and strides, so column slices of a
buffer (x_proj's dt_low | Bs | Cs, in_proj's xc | z) need no copies.

Size letters: M = B*L rows, I inputs, O outputs of the layer.
"""
from __future__ import annotations

import math

from .device import column_sum

GEMM_TILE = (64, 64)   # rows x columns of C per workgroup of kernels/linear.wgsl


def gemm(g, entry, M, N, K, a, a_off, a_rs, a_cs, b, b_off, b_rs, b_cs, c, c_off, c_rs,
         bias=None, bias_off=0, beta=0, res=None):
    """Op for C = beta*C + A @ B (+ bias) (+ res); see kernels/linear.wgsl for the strides."""
    grid = (math.ceil(N / GEMM_TILE[1]), math.ceil(M / GEMM_TILE[0]), 1)
    return g.op("linear", entry, grid,
                [M, N, K, a_off, a_rs, a_cs, b_off, b_rs, b_cs, c_off, c_rs, bias_off,
                 0 if bias is None else 1, beta, 0 if res is None else 1],
                [a, b, a if bias is None else bias, a if res is None else res, c])


def linear_forward(g, M, I, O, x, x_off, x_rs, w, w_off, b_off, y, y_off, y_rs, res=None):
    """Op: y[:, y_off:y_off+O] (row stride y_rs) = x (M, I; row stride x_rs) @ W^T + b
    (+ res (M, O), e.g. the block's residual input); W (O, I) at ``w_off`` and b (O,) at
    ``b_off`` of the parameter arena ``w``."""
    return gemm(g, "linear_forward", M, O, I, x, x_off, x_rs, 1, w, w_off, 1, I, y, y_off, y_rs,
                bias=w, bias_off=b_off, res=res)


def linear_backward(g, M, I, O, dy, dy_off, dy_rs, x, x_off, x_rs, w, w_off, b_off, gr,
                    dx=None, dx_off=0, dx_rs=0, dx_beta=0):
    """Ops of the backward of :func:`linear_forward`: dx (M, I) = dy @ W (``+=`` when
    ``dx_beta``; skipped when ``dx`` is None), dW (at ``w_off`` of the gradient arena
    ``gr``) += dy^T @ x, db (at ``b_off``) += column sums of dy."""
    ops = []
    if dx is not None:
        ops.append(gemm(g, "linear_backward", M, I, O, dy, dy_off, dy_rs, 1, w, w_off, I, 1,
                        dx, dx_off, dx_rs, beta=dx_beta))
    ops.append(gemm(g, "linear_backward", O, I, M, dy, dy_off, 1, dy_rs, x, x_off, x_rs, 1,
                    gr, w_off, I, beta=1))
    ops.append(column_sum(g, M, O, dy, dy_off, dy_rs, gr, b_off))
    return ops
