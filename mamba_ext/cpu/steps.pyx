# cython: language_level=3
"""Python entry points of the step kernels, one per step, named like the steps.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, M = B*L rows,
V vocab, C = ceil(L / SCAN_CHUNK) scan chunks (hstate), IC / OC input / output columns
of a linear layer.

Each function is a thin, typed wrapper over the nogil kernel that the block and the
model run (rmsnorm.pxd, linear.pxd, conv1d.pxd, scan.pxd, activations.pxd, model.pxd),
so that each step can be tested alone against the float64 NumPy reference steps of
mamba_ext.testing.reference (tests/cpu/test_<step>.py; the GPU mirrors them). The Cython
(cimport) names of the kernels are the same words; these live in their own module
because a Cython module cannot hold a `def` and a `cdef` of one name.

Conventions (llm.c): outputs first, then inputs, then weights; sizes come from the
shapes (checked: ValueError naming the argument); every array C-contiguous and of one
float dtype (float32 or float64; TypeError otherwise). Backward functions ACCUMULATE
(+=) into every gradient they are given (zero them for a plain gradient), except where
a docstring says "written".
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
import numpy as np
from mamba_ext._validate import check_n_threads
from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.constants cimport DEFAULT_EPS
from mamba_ext.cpu.rmsnorm cimport rmsnorm_forward as k_rmsnorm_forward
from mamba_ext.cpu.rmsnorm cimport rmsnorm_backward as k_rmsnorm_backward
from mamba_ext.cpu.linear cimport linear_forward as k_linear_forward
from mamba_ext.cpu.linear cimport linear_backward as k_linear_backward
from mamba_ext.cpu.conv1d cimport conv1d_forward as k_conv1d_forward
from mamba_ext.cpu.conv1d cimport conv1d_backward as k_conv1d_backward
from mamba_ext.cpu.scan cimport scan_forward_state, scan_backward_state, scan_nchunks
from mamba_ext.cpu.activations cimport (mx_gate_forward_f, mx_gate_forward_d,
                                        mx_gate_backward_f, mx_gate_backward_d)
from mamba_ext.cpu.model cimport (cross_entropy_forward_backward,
                                  embedding_forward as k_embedding_forward,
                                  embedding_backward as k_embedding_backward)

from mamba_ext.cpu.threads cimport mx_threads


cdef int _disc(str discretization) except -1:
    if discretization == "zoh":
        return 0
    if discretization == "euler":
        return 1
    raise ValueError(f"discretization: expected 'zoh' or 'euler', got {discretization!r}")


cdef int _same(str name, tuple got, tuple want) except -1:
    if got != want:
        raise ValueError(f"{name}: expected shape {want}, got {got}")
    return 0


cdef tuple _shape(object a, int ndim):
    return tuple(a.shape[:ndim])


# ------------------------------------------------------------------ rmsnorm

def rmsnorm_forward(floating[:, ::1] out not None, floating[::1] rstd not None,
                    const floating[:, ::1] x not None, const floating[::1] weight not None,
                    double eps=DEFAULT_EPS):
    """out (M, Dm) = x (M, Dm) * rstd * weight (Dm,), rstd (M,) = 1/sqrt(mean(x^2) + eps): written."""
    cdef idx_t M = x.shape[0], Dm = x.shape[1]
    _same("out", _shape(out, 2), (M, Dm))
    _same("rstd", _shape(rstd, 1), (M,))
    _same("weight", _shape(weight, 1), (Dm,))
    if not eps >= 0:
        raise ValueError(f"eps: expected >= 0, got {eps!r}")
    if M == 0:
        return
    with nogil:
        k_rmsnorm_forward(&out[0, 0], &rstd[0], &x[0, 0], &weight[0] if Dm > 0 else NULL,
                          M, Dm, eps, 0)


def rmsnorm_backward(floating[:, ::1] dx not None, floating[::1] dweight not None,
                     const floating[:, ::1] dout not None, const floating[:, ::1] x not None,
                     const floating[::1] weight not None, const floating[::1] rstd not None):
    """dx (M, Dm) +=, dweight (Dm,) += the VJP of rmsnorm_forward given dout (M, Dm) and the
    forward's x, weight and rstd (M,)."""
    cdef idx_t M = x.shape[0], Dm = x.shape[1]
    _same("dx", _shape(dx, 2), (M, Dm))
    _same("dout", _shape(dout, 2), (M, Dm))
    _same("dweight", _shape(dweight, 1), (Dm,))
    _same("weight", _shape(weight, 1), (Dm,))
    _same("rstd", _shape(rstd, 1), (M,))
    if M == 0 or Dm == 0:
        return
    with nogil:
        k_rmsnorm_backward(&dx[0, 0], &dweight[0], &dout[0, 0], &x[0, 0], &weight[0], &rstd[0],
                           M, Dm, 0)


# ------------------------------------------------------------------ linear

def linear_forward(floating[:, ::1] out not None, const floating[:, ::1] x not None,
                   const floating[:, ::1] weight not None, const floating[::1] bias=None):
    """out (M, OC) = x (M, IC) @ weight (OC, IC)^T + bias (OC,) (None: no bias): written."""
    cdef idx_t M = x.shape[0], IC = x.shape[1], OC = weight.shape[0]
    _same("weight", _shape(weight, 2), (OC, IC))
    _same("out", _shape(out, 2), (M, OC))
    if bias is not None:
        _same("bias", _shape(bias, 1), (OC,))
    if M == 0 or OC == 0:
        return
    cdef const floating* pb = &bias[0] if bias is not None else NULL
    cdef const floating* pw = &weight[0, 0] if IC > 0 else NULL
    cdef const floating* px = &x[0, 0] if IC > 0 else NULL
    with nogil:
        k_linear_forward(&out[0, 0], px, pw, pb, M, IC, OC, 0)


cdef int _linear_backward(floating[:, ::1] dx, floating[:, ::1] dweight, floating[::1] dbias,
                          const floating[:, ::1] dout, const floating[:, ::1] x,
                          const floating[:, ::1] weight) except -1:
    cdef idx_t M = x.shape[0], IC = x.shape[1], OC = weight.shape[0]
    _same("weight", _shape(weight, 2), (OC, IC))
    _same("dout", _shape(dout, 2), (M, OC))
    if dx is not None:
        _same("dx", _shape(dx, 2), (M, IC))
    if dweight is not None:
        _same("dweight", _shape(dweight, 2), (OC, IC))
    if dbias is not None:
        _same("dbias", _shape(dbias, 1), (OC,))
    if M == 0 or OC == 0:
        return 0
    cdef floating* pdx = &dx[0, 0] if dx is not None and IC > 0 else NULL
    cdef floating* pdw = &dweight[0, 0] if dweight is not None and IC > 0 else NULL
    cdef floating* pdb = &dbias[0] if dbias is not None else NULL
    cdef const floating* px = &x[0, 0] if IC > 0 else NULL
    cdef const floating* pw = &weight[0, 0] if IC > 0 else NULL
    cdef int rc
    with nogil:
        rc = k_linear_backward(pdx, pdw, pdb, &dout[0, 0], px, pw, M, IC, OC, 0)
    if rc != 0:
        raise MemoryError("linear_backward: out of memory for the weight-gradient scratch")
    return 0


def linear_backward(dx, dweight, dbias, dout, x, weight):
    """dx (M, IC) += dout (M, OC) @ weight (OC, IC); dweight (OC, IC) += dout^T @ x (M, IC);
    dbias (OC,) += column sums of dout. Any of dx, dweight, dbias may be None (skipped)."""
    # the precision is dout's (a fused `def` would pick it from the first, maybe None, one)
    if getattr(dout, "dtype", None) == np.float32:
        _linear_backward[float](dx, dweight, dbias, dout, x, weight)
    else:
        _linear_backward[double](dx, dweight, dbias, dout, x, weight)


# ------------------------------------------------------------------ conv1d

cdef idx_t _row_ld(str name, object a, idx_t L) except -1:
    # a (B, L, D) array whose rows are evenly spaced and whose channels are contiguous
    # (e.g. the x columns of a (B, L, 2D) array): the distance of its rows, in values
    cdef Py_ssize_t item = a.itemsize
    st = a.strides
    if a.shape[2] > 1 and st[2] != item:
        raise ValueError(f"{name}: expected contiguous channels (last stride {item} bytes), "
                         f"got strides {st}")
    if st[1] % item or (L > 1 and st[1] < a.shape[2] * item) or st[1] < 0:
        raise ValueError(f"{name}: expected rows of D values, evenly spaced, got strides {st}")
    if a.shape[0] > 1 and st[0] != L * st[1]:
        raise ValueError(f"{name}: expected the sequences' rows to follow each other, got strides {st}")
    return max(st[1] // item, a.shape[2])


def conv1d_forward(floating[:, :, ::1] conv not None, const floating[:, :, :] xc not None,
                   const floating[:, ::1] weight not None, const floating[::1] bias not None):
    """conv (B, L, D) = bias (D,) + sum_k weight (D, K)[:, k] * xc (B, L, D)[t-k]: written
    (causal, zero history before t = 0). xc may be a view with evenly spaced rows (e.g. the
    first D columns of a (B, L, 2D) array): no copy."""
    cdef idx_t B = xc.shape[0], L = xc.shape[1], D = xc.shape[2], K = weight.shape[1]
    _same("conv", _shape(conv, 3), (B, L, D))
    _same("weight", _shape(weight, 2), (D, K))
    _same("bias", _shape(bias, 1), (D,))
    if B * L * D == 0:
        return
    cdef idx_t ld = _row_ld("xc", xc, L)
    with nogil:
        k_conv1d_forward(&conv[0, 0, 0], &xc[0, 0, 0], ld, &weight[0, 0] if K > 0 else NULL,
                         &bias[0], B, L, D, K, 0)


def conv1d_backward(floating[:, :, ::1] dxc not None, floating[:, ::1] dweight not None,
                    floating[::1] dbias not None, const floating[:, :, ::1] dconv not None,
                    const floating[:, :, :] xc not None, const floating[:, ::1] weight not None):
    """dxc (B, L, D) +=, dweight (D, K) +=, dbias (D,) += the VJP of conv1d_forward given
    dconv (B, L, D); xc as in conv1d_forward (evenly spaced rows)."""
    cdef idx_t B = xc.shape[0], L = xc.shape[1], D = xc.shape[2], K = weight.shape[1]
    for name, a in (("dxc", dxc), ("dconv", dconv)):
        _same(name, _shape(a, 3), (B, L, D))
    _same("weight", _shape(weight, 2), (D, K))
    _same("dweight", _shape(dweight, 2), (D, K))
    _same("dbias", _shape(dbias, 1), (D,))
    if B * L * D == 0:
        return
    cdef idx_t ld = _row_ld("xc", xc, L)
    cdef int rc
    with nogil:
        rc = k_conv1d_backward(&dxc[0, 0, 0], D, &dweight[0, 0] if K > 0 else NULL, &dbias[0],
                               &dconv[0, 0, 0], &xc[0, 0, 0], ld,
                               &weight[0, 0] if K > 0 else NULL, B, L, D, K, 0)
    if rc != 0:
        raise MemoryError("conv1d_backward: out of memory for the gradient partial sums")


# ------------------------------------------------------------------ scan

def scan_forward(floating[:, :, ::1] y not None, floating[:, :, :, ::1] hstate not None,
                 const floating[:, :, ::1] u not None, const floating[:, :, ::1] delta not None,
                 const floating[:, :, ::1] Bs not None, const floating[:, :, ::1] Cs not None,
                 const floating[:, ::1] A_log not None, const floating[::1] D_vec not None,
                 str discretization="zoh", const floating[:, :, ::1] h0=None,
                 floating[:, :, ::1] h_last=None, n_threads=None, bint a_given=False):
    """Selective scan: y (B, L, D) = scan(u, delta, A, Bs, Cs) + D_vec * u and hstate
    (B, C, D, N), the state entering each chunk of SCAN_CHUNK steps: written.
    u, delta (B, L, D); Bs, Cs (B, L, N); A_log (D, N) (A = -exp(clamp(A_log)); with
    a_given, A itself: negative values, not clamped); D_vec (D,);
    h0 (B, D, N) the state before step 0 (None: zeros); h_last (B, D, N) written with the
    state after step L-1 (None: not wanted)."""
    cdef idx_t B = u.shape[0], L = u.shape[1], D = u.shape[2], N = A_log.shape[1]
    cdef int disc = _disc(discretization), rc
    cdef int nt = check_n_threads(n_threads)
    _same("delta", _shape(delta, 3), (B, L, D))
    _same("y", _shape(y, 3), (B, L, D))
    _same("Bs", _shape(Bs, 3), (B, L, N))
    _same("Cs", _shape(Cs, 3), (B, L, N))
    _same("A_log", _shape(A_log, 2), (D, N))
    _same("D_vec", _shape(D_vec, 1), (D,))
    _same("hstate", _shape(hstate, 4), (B, scan_nchunks(L), D, N))
    if h0 is not None:
        _same("h0", _shape(h0, 3), (B, D, N))
    if h_last is not None:
        _same("h_last", _shape(h_last, 3), (B, D, N))
    if B * L * D * N == 0:
        return
    cdef const floating* ph0 = &h0[0, 0, 0] if h0 is not None else NULL
    cdef floating* phl = &h_last[0, 0, 0] if h_last is not None else NULL
    with nogil:
        rc = scan_forward_state(&y[0, 0, 0], &hstate[0, 0, 0, 0], phl, &u[0, 0, 0],
                                &delta[0, 0, 0], &Bs[0, 0, 0], &Cs[0, 0, 0], N, &A_log[0, 0],
                                a_given, &D_vec[0], ph0, B, L, D, N, disc, nt)
    if rc == -2:
        raise ValueError("A_log: with a_given, expected A itself: negative values (no NaN)")
    if rc != 0:
        raise MemoryError("scan_forward: out of memory for scratch buffers")


def scan_backward(floating[:, :, ::1] du not None, floating[:, :, ::1] ddelta not None,
                  floating[:, :, ::1] dBs not None, floating[:, :, ::1] dCs not None,
                  floating[:, ::1] dA_log not None, floating[::1] dD_vec not None,
                  const floating[:, :, ::1] dy not None,
                  const floating[:, :, :, ::1] hstate not None,
                  const floating[:, :, ::1] u not None, const floating[:, :, ::1] delta not None,
                  const floating[:, :, ::1] Bs not None, const floating[:, :, ::1] Cs not None,
                  const floating[:, ::1] A_log not None, const floating[::1] D_vec not None,
                  str discretization="zoh", const floating[:, :, ::1] dh_last=None,
                  floating[:, :, ::1] dh0=None, n_threads=None, bint a_given=False):
    """Gradients of the scan ACCUMULATE: du, ddelta (B, L, D), dBs, dCs (B, L, N), dA_log
    (D, N) (exactly 0 added where A_log is clamped; with a_given, dLoss/dA), dD_vec (D,),
    dh0 (B, D, N) (None: not wanted), given dy (B, L, D), dh_last (B, D, N) (None: 0) and
    the forward's hstate and inputs."""
    cdef idx_t B = u.shape[0], L = u.shape[1], D = u.shape[2], N = A_log.shape[1]
    cdef int disc = _disc(discretization), rc
    cdef int nt = check_n_threads(n_threads)
    for name, a in (("du", du), ("ddelta", ddelta), ("dy", dy), ("delta", delta)):
        _same(name, _shape(a, 3), (B, L, D))
    for name, a in (("dBs", dBs), ("dCs", dCs), ("Bs", Bs), ("Cs", Cs)):
        _same(name, _shape(a, 3), (B, L, N))
    _same("A_log", _shape(A_log, 2), (D, N))
    _same("dA_log", _shape(dA_log, 2), (D, N))
    _same("D_vec", _shape(D_vec, 1), (D,))
    _same("dD_vec", _shape(dD_vec, 1), (D,))
    _same("hstate", _shape(hstate, 4), (B, scan_nchunks(L), D, N))
    if dh_last is not None:
        _same("dh_last", _shape(dh_last, 3), (B, D, N))
    if dh0 is not None:
        _same("dh0", _shape(dh0, 3), (B, D, N))
    if B * L * D * N == 0:
        return
    cdef const floating* pdhl = &dh_last[0, 0, 0] if dh_last is not None else NULL
    cdef floating* pdh0 = &dh0[0, 0, 0] if dh0 is not None else NULL
    with nogil:
        rc = scan_backward_state(&du[0, 0, 0], &ddelta[0, 0, 0], &dBs[0, 0, 0], &dCs[0, 0, 0],
                                 &dA_log[0, 0], &dD_vec[0], pdh0, &dy[0, 0, 0], pdhl,
                                 &hstate[0, 0, 0, 0], &u[0, 0, 0], &delta[0, 0, 0],
                                 &Bs[0, 0, 0], &Cs[0, 0, 0], N, &A_log[0, 0], a_given,
                                 &D_vec[0], B, L, D, N, disc, nt)
    if rc != 0:
        raise MemoryError("scan_backward: out of memory for scratch buffers")


# ------------------------------------------------------------------ gate

def gate_forward(floating[:, ::1] gated not None, const floating[:, ::1] y not None,
                 const floating[:, ::1] z not None):
    """gated (M, D) = y (M, D) * silu(z (M, D)): written."""
    cdef idx_t M = y.shape[0], D = y.shape[1], r
    _same("z", _shape(z, 2), (M, D))
    _same("gated", _shape(gated, 2), (M, D))
    if M * D == 0:
        return
    with nogil:
        for r in range(M):
            if floating is float:
                mx_gate_forward_f(&gated[r, 0], &y[r, 0], &z[r, 0], D)
            else:
                mx_gate_forward_d(&gated[r, 0], &y[r, 0], &z[r, 0], D)


def gate_backward(floating[:, ::1] dy not None, floating[:, ::1] dz not None,
                  const floating[:, ::1] dgated not None, const floating[:, ::1] y not None,
                  const floating[:, ::1] z not None):
    """dy (M, D) = dgated * silu(z), dz (M, D) = dgated * y * silu'(z): WRITTEN (the block
    writes them into fresh buffers); dgated, y, z (M, D)."""
    cdef idx_t M = y.shape[0], D = y.shape[1], r
    for name, a in (("z", z), ("dgated", dgated), ("dy", dy), ("dz", dz)):
        _same(name, _shape(a, 2), (M, D))
    if M * D == 0:
        return
    with nogil:
        for r in range(M):
            if floating is float:
                mx_gate_backward_f(&dy[r, 0], &dz[r, 0], &dgated[r, 0], &y[r, 0], &z[r, 0], D)
            else:
                mx_gate_backward_d(&dy[r, 0], &dz[r, 0], &dgated[r, 0], &y[r, 0], &z[r, 0], D)


# ------------------------------------------------------------------ embedding

cdef int _check_ids(const int64_t[::1] ids, idx_t V, str name) except -1:
    cdef idx_t i
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= V:
            raise ValueError(f"{name}: id {ids[i]} at position {i} outside [0, {V})")
    return 0


def embedding_forward(floating[:, ::1] h not None, const int64_t[::1] tokens not None,
                      const floating[:, ::1] embedding not None):
    """h (M, Dm) = embedding (V, Dm) [tokens (M,)]: written."""
    cdef idx_t M = tokens.shape[0], V = embedding.shape[0], Dm = embedding.shape[1]
    _same("h", _shape(h, 2), (M, Dm))
    _check_ids(tokens, V, "tokens")
    if M * Dm == 0:
        return
    with nogil:
        k_embedding_forward(&h[0, 0], &tokens[0], &embedding[0, 0], M, Dm)


def embedding_backward(floating[:, ::1] dembedding not None, const floating[:, ::1] dh not None,
                       const int64_t[::1] tokens not None):
    """dembedding (V, Dm) [tokens[r]] += dh (M, Dm) [r]."""
    cdef idx_t M = tokens.shape[0], V = dembedding.shape[0], Dm = dembedding.shape[1]
    _same("dh", _shape(dh, 2), (M, Dm))
    _check_ids(tokens, V, "tokens")
    if M * Dm == 0:
        return
    with nogil:
        k_embedding_backward(&dembedding[0, 0], &dh[0, 0], &tokens[0], M, Dm)


# ------------------------------------------------------------------ cross-entropy

cdef double _cross_entropy(floating[:, ::1] dlogits, const floating[:, ::1] logits,
                           const int64_t[::1] targets, double loss_scale,
                           int n_threads) except? -1:
    # dlogits = (softmax - onehot) * loss_scale / M (written), returns the mean loss
    cdef idx_t M = logits.shape[0], V = logits.shape[1], r
    cdef double total = 0.0
    cdef double* row_loss
    _same("dlogits", _shape(dlogits, 2), (M, V))
    _same("targets", _shape(targets, 1), (M,))
    if M == 0:
        raise ValueError("logits: the mean loss over zero rows is undefined")
    _check_ids(targets, V, "targets")
    dlogits[:, :] = logits
    row_loss = <double*>malloc(M * sizeof(double))
    if row_loss == NULL:
        raise MemoryError("cross_entropy: out of memory")
    with nogil:
        cross_entropy_forward_backward(row_loss, &dlogits[0, 0], &targets[0], M, V,
                                       loss_scale / <double>M, mx_threads(n_threads))
        for r in range(M):             # fixed order: deterministic, as in the model
            total += row_loss[r]
    free(row_loss)
    return total / <double>M


def cross_entropy_forward(const floating[:, ::1] logits not None,
                          const int64_t[::1] targets not None, n_threads=None):
    """Mean over the M rows of logsumexp(logits (M, V)) - logits[target] (targets (M,))."""
    cdef floating[:, ::1] scratch = np.empty_like(np.asarray(logits))
    cdef int nt = check_n_threads(n_threads)
    return _cross_entropy(scratch, logits, targets, 1.0, nt)


def cross_entropy_backward(floating[:, ::1] dlogits not None,
                           const floating[:, ::1] logits not None,
                           const int64_t[::1] targets not None, double loss_scale=1.0,
                           n_threads=None):
    """dlogits (M, V) = d(mean loss)/dlogits * loss_scale = (softmax - onehot) * loss_scale
    / M: WRITTEN (the model computes it in place of the logits). Returns the mean loss."""
    cdef int nt = check_n_threads(n_threads)
    return _cross_entropy(dlogits, logits, targets, loss_scale, nt)
