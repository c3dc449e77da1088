"""RMSNorm on the GPU (kernels/rmsnorm.wgsl), the mirror of mamba_ext/cpu/rmsnorm.pyx.

Size letters: M = B*L rows, Dm dModel.
"""
from __future__ import annotations

from .device import column_sum


def rmsnorm_forward(g, M, Dm, x, w, w_off, xn, rstd, eps):
    """Op: xn (M, Dm) = x * rstd * gain, rstd (M,) saved; gain (Dm,) at ``w_off`` of arena ``w``."""
    return g.op("rmsnorm", "rmsnorm_forward", g.grid1d(M, "rmsnorm rows"),
                [M, Dm, w_off, float(eps), 0], [x, w, xn, rstd])


def rmsnorm_backward(g, M, Dm, x, w, w_off, dxn, rstd, dx, gw, gr, eps, dres=None):
    """Ops: dx (M, Dm) = dres + RMSNorm backward of dxn; gain gradient (at ``w_off`` of
    the gradient arena ``gr``) += column sums of the per-row terms ``gw`` (M, Dm)."""
    return [
        g.op("rmsnorm", "rmsnorm_backward", g.grid1d(M, "rmsnorm rows"),
             [M, Dm, w_off, float(eps), 0 if dres is None else 1],
             [x, w, dxn, rstd, dxn if dres is None else dres, dx, gw]),
        *column_sum(g, M, Dm, gw, 0, Dm, gr, w_off),
    ]
