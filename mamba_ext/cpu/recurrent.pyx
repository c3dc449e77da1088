# cython: language_level=3
"""The recurrent step of the whole model (generation), compiled; contract: recurrent.pyi.

Size letters: B batch (one row per sequence), V vocab, Dm dModel, D dInner, N dState,
K dConv, R dtRank, P = R + 2N.

One call of ``Stepper.step`` feeds one token per sequence through the model and writes
the logits of the next token (docs/semantics.md, one time step):
  x = embedding[id]; per layer: xn = RMSNorm(x); [xc | z] = in_proj(xn);
  conv = conv1d step over [tail, xc] (tail shifted in place); u = silu(conv);
  [dt_low | Bs | Cs] = x_proj(u); delta = softplus(dt_proj(dt_low)); scan step (h in
  place) -> y; gated = y * silu(z); x += out_proj(gated);
  logits = RMSNorm(x) @ embedding^T + lm_head_bias (tied head).
The projections are linear_forward over the B rows (each weight is read once per
token for the whole batch; parallel over output columns, gemv for one row), or, with float16 weights, mx_linear_half_f (float32
accumulation) in parallel over output columns. The conv and scan steps run in parallel
over (row, channel block) jobs. The state arrays (h (B, D, N) and conv tail (B, D, K-1)
per layer) belong to the caller (mamba_ext.recurrent.RecurrentState) and are updated in
place; ``Stepper`` keeps raw pointers to them and to the weights, and holds references
to those arrays so they outlive it.

Scratch (one `floating` array, rows of B, in this order):
  x (B, Dm), xn (B, Dm), rstd (B,), xz (B, 2D), u (B, D), xproj (B, P), dt_low (B, R),
  delta (B, D), y (B, D), gated (B, D), out (B, Dm)
"""
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.math cimport isfinite
from cython.parallel cimport prange
cimport numpy as cnp
import numpy as np

from mamba_ext.cpu.types cimport floating, idx_t
from mamba_ext.cpu.activations cimport (
    mx_silu_forward_f, mx_silu_forward_d, mx_softplus_forward_f, mx_softplus_forward_d,
    mx_gate_forward_f, mx_gate_forward_d)
from mamba_ext.cpu.linear cimport linear_forward
from mamba_ext.cpu.rmsnorm cimport rmsnorm_forward

cnp.import_array()

from mamba_ext.cpu.threads cimport mx_threads

cdef extern from "csrc/mx_recurrent.h" nogil:
    void mx_conv_step_f(float* conv, float* tail, const float* xc, const float* weight,
                        const float* bias, idx_t D, idx_t K, idx_t S) noexcept
    void mx_conv_step_d(double* conv, double* tail, const double* xc, const double* weight,
                        const double* bias, idx_t D, idx_t K, idx_t S) noexcept
    void mx_scan_step_f(float* y, float* h, const float* u, const float* delta,
                        const float* A, const float* A_inv, const float* Bs, const float* Cs,
                        const float* D_vec, idx_t D, idx_t N, int zoh) noexcept
    void mx_scan_step_d(double* y, double* h, const double* u, const double* delta,
                        const double* A, const double* A_inv, const double* Bs,
                        const double* Cs, const double* D_vec, idx_t D, idx_t N,
                        int zoh) noexcept
    void mx_half_row_to_float(float* out, const uint16_t* w, idx_t n) noexcept
    void mx_linear_half_f(float* out, const float* x, const uint16_t* w, const float* bias,
                          idx_t B, idx_t IC, idx_t OC, idx_t o0, idx_t o1) noexcept

cdef enum:
    # below this many multiply-adds a parallel region costs more than it saves (a team
    # wake-up is microseconds, and far more on a busy machine): run on one thread
    PARALLEL_MIN_WORK = 1 << 17
    # channels per conv/scan job: small enough to spread one sequence over the threads,
    # large enough that a job outweighs its scheduling
    CHANNEL_BLOCK = 256
    # output columns per float16 matrix-vector job
    HALF_BLOCK = 64
    # below this many multiply-adds a float16 product runs on one thread: with
    # mamba_ext.configure_threads()'s OMP_WAIT_POLICY=PASSIVE each parallel region wakes
    # sleeping threads (futex), ~70 us here, against ~30 us for 2^18 float16 multiply-adds
    # on one core (2 x 64 at batch 16: 27,900 -> 83,300 tok/s, docs/performance.md)
    HALF_PARALLEL_MIN_WORK = 1 << 20

# the four projection matrices are float16 bits when `half`
LAYER_ARRAYS = ("wInProj", "bInProj", "wConv", "bConv", "wXProj", "bXProj", "wDtProj",
                "bDtProj", "A", "A_inv", "D_vec", "wOutProj", "bOutProj", "normWeight")
HALF_ARRAYS = ("wInProj", "wXProj", "wDtProj", "wOutProj")


cdef inline void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef void _linear(floating* out, const floating* x, const void* w, const floating* bias,
                  idx_t B, idx_t IC, idx_t OC, int half, int nt) noexcept nogil:
    # out (B, OC) = x (B, IC) @ w (OC, IC)^T + bias (OC,)
    cdef idx_t j, nb, o0
    if floating is float:
        if half:
            nb = (OC + HALF_BLOCK - 1) // HALF_BLOCK
            if B * IC * OC < HALF_PARALLEL_MIN_WORK:
                nt = 1
            for j in prange(nb, schedule='static', num_threads=nt):
                o0 = j * HALF_BLOCK
                mx_linear_half_f(out, x, <const uint16_t*>w, bias, B, IC, OC, o0,
                                 min(OC, o0 + HALF_BLOCK))
            return
    linear_forward(out, x, <const floating*>w, bias, B, IC, OC, nt)


cdef void mixer_step(floating* out, const floating* xn, const void** w, floating* h,
                     floating* tail, floating* s, idx_t B, idx_t Dm, idx_t D, idx_t N,
                     idx_t K, idx_t S, idx_t R, int zoh, int half, int nt) noexcept nogil:
    # One token through one layer's mixer (steps 2-12, without the norm before it and the
    # residual after it): out (B, Dm) written from xn (B, Dm); w the layer's NW pointers
    # (LAYER_ARRAYS order); h (B, D, N) and tail (B, D, S), the last S >= K-1 conv inputs
    # (S = K-1 in Stepper; transformers' conv state keeps S = K), updated in place.
    # s: scratch of B * (6 D + P + R) values: xz (B, 2D), u (B, D), xproj (B, P),
    # dt_low (B, R), delta, y, gated (B, D).
    cdef idx_t P = R + 2 * N
    cdef floating* xz = s                           # xz (B, 2D) = [xc | z]
    cdef floating* u = xz + B * 2 * D               # u (B, D)
    cdef floating* xproj = u + B * D                # xproj (B, P) = [dt_low | Bs | Cs]
    cdef floating* dtl = xproj + B * P              # dt_low (B, R), contiguous copy
    cdef floating* delta = dtl + B * R              # delta (B, D)
    cdef floating* y = delta + B * D                # y (B, D)
    cdef floating* gated = y + B * D                # gated (B, D)
    cdef idx_t b, j, c, d0, nd
    cdef idx_t nblk = (D + CHANNEL_BLOCK - 1) // CHANNEL_BLOCK, njobs = B * nblk
    # threads of the conv/scan jobs: one unless the step's B*D*N is large enough
    cdef int nts = nt if B * D * N >= PARALLEL_MIN_WORK else 1
    _linear(xz, xn, w[W_IN], <const floating*>w[B_IN], B, Dm, 2 * D, half, nt)      # 2
    for j in prange(njobs, schedule='static', num_threads=nts):  # 3-4
        b = j // nblk
        d0 = (j % nblk) * CHANNEL_BLOCK
        nd = min(<idx_t>CHANNEL_BLOCK, D - d0)
        if floating is float:
            mx_conv_step_f(u + b * D + d0, tail + (b * D + d0) * S,
                           xz + b * 2 * D + d0, <const float*>w[W_CONV] + d0 * K,
                           <const float*>w[B_CONV] + d0, nd, K, S)
            mx_silu_forward_f(u + b * D + d0, u + b * D + d0, nd)
        else:
            mx_conv_step_d(u + b * D + d0, tail + (b * D + d0) * S,
                           xz + b * 2 * D + d0, <const double*>w[W_CONV] + d0 * K,
                           <const double*>w[B_CONV] + d0, nd, K, S)
            mx_silu_forward_d(u + b * D + d0, u + b * D + d0, nd)
    _linear(xproj, u, w[W_X], <const floating*>w[B_X], B, D, P, half, nt)          # 5
    for b in range(B):
        for c in range(R):
            dtl[b * R + c] = xproj[b * P + c]
    _linear(delta, dtl, w[W_DT], <const floating*>w[B_DT], B, R, D, half, nt)      # 6
    if floating is float:
        mx_softplus_forward_f(delta, B * D)
    else:
        mx_softplus_forward_d(delta, B * D)
    for j in prange(njobs, schedule='static', num_threads=nts):  # 7-10
        b = j // nblk
        d0 = (j % nblk) * CHANNEL_BLOCK
        nd = min(<idx_t>CHANNEL_BLOCK, D - d0)
        if floating is float:
            mx_scan_step_f(y + b * D + d0, h + (b * D + d0) * N, u + b * D + d0,
                           delta + b * D + d0, <const float*>w[A_] + d0 * N,
                           <const float*>w[A_INV] + d0 * N, xproj + b * P + R,
                           xproj + b * P + R + N, <const float*>w[D_VEC] + d0, nd, N, zoh)
        else:
            mx_scan_step_d(y + b * D + d0, h + (b * D + d0) * N, u + b * D + d0,
                           delta + b * D + d0, <const double*>w[A_] + d0 * N,
                           <const double*>w[A_INV] + d0 * N, xproj + b * P + R,
                           xproj + b * P + R + N, <const double*>w[D_VEC] + d0, nd, N, zoh)
    for b in range(B):                                                              # 11
        if floating is float:
            mx_gate_forward_f(gated + b * D, y + b * D, xz + b * 2 * D + D, D)
        else:
            mx_gate_forward_d(gated + b * D, y + b * D, xz + b * 2 * D + D, D)
    _linear(out, gated, w[W_OUT], <const floating*>w[B_OUT], B, D, Dm, half, nt)    # 12


cdef void recurrent_step(floating* logits, const int64_t* ids, const step_model* m) noexcept nogil:
    # scratch of m (module docstring): x, xn (B, Dm), rstd (B,), the mixer's scratch, out (B, Dm)
    cdef idx_t B = m.B, Dm = m.Dm, D = m.D, N = m.N, R = m.R, P = m.R + 2 * m.N
    cdef floating* x = <floating*>m.scratch        # x (B, Dm)
    cdef floating* xn = x + B * Dm                  # xn (B, Dm)
    cdef floating* rstd = xn + B * Dm               # rstd (B,)
    cdef floating* ms = rstd + B                    # the mixer's scratch, B * (6 D + P + R)
    cdef floating* out = ms + B * (6 * D + P + R)   # out (B, Dm)
    cdef const void** w
    cdef idx_t i, b, j
    cdef int half = m.half
    # 0. embedding lookup
    for b in range(B):
        if floating is float:
            if half:
                mx_half_row_to_float(x + b * Dm, <const uint16_t*>m.embedding + ids[b] * Dm, Dm)
                continue
        memcpy(x + b * Dm, <const floating*>m.embedding + ids[b] * Dm, Dm * sizeof(floating))
    for i in range(m.n_layers):
        w = m.w + i * NW
        rmsnorm_forward(xn, rstd, x, <const floating*>w[NORM], B, Dm, m.eps, m.n_threads)  # 1
        mixer_step(out, xn, w, <floating*>m.h[i], <floating*>m.tail[i], ms, B, Dm, D, N,
                   m.K, m.K - 1, R, m.zoh, half, m.n_threads)                                     # 2-12
        for j in range(B * Dm):
            x[j] += out[j]
    rmsnorm_forward(xn, rstd, x, <const floating*>m.final_norm, B, Dm, m.eps, m.n_threads)
    _linear(logits, xn, m.embedding, <const floating*>m.lm_head_bias, B, Dm, m.V, half, m.n_threads)


def mixer_step_arrays(out, xn, tuple layer, h, tail, bint zoh, int n_threads=0):
    """One token through one layer's mixer (no norm, no residual): out (B, Dm) written
    from xn (B, Dm); ``layer`` the NW arrays in LAYER_ARRAYS order (normWeight unused);
    h (B, D, N) and tail (B, D, S), the last S >= K-1 conv inputs oldest first (K from
    wConv), updated in place. float32 or float64, C-contiguous,
    one dtype (no float16 weights here). Used by mamba_ext.torch for transformers' decode."""
    cdef idx_t B, Dm, D, N, K, S, R
    cdef const void* w[NW]
    cdef void* p[5]
    cdef int k, nt
    cdef bint single
    arrays = (out, xn, h, tail) + layer
    if len(layer) != NW:
        raise ValueError(f"layer: expected {NW} arrays (LAYER_ARRAYS), got {len(layer)}")
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != out.dtype or not a.flags.c_contiguous:
            raise ValueError("mixer_step_arrays: every array C-contiguous of one dtype")
    if out.dtype != np.float32 and out.dtype != np.float64:
        raise TypeError(f"mixer_step_arrays: expected float32 or float64, got {out.dtype}")
    if out.ndim != 2 or xn.ndim != 2 or h.ndim != 3 or tail.ndim != 3:
        raise ValueError("mixer_step_arrays: out, xn (B, Dm); h (B, D, N); tail (B, D, S)")
    B, Dm, D, N, S = xn.shape[0], xn.shape[1], h.shape[1], h.shape[2], tail.shape[2]
    R, K = layer[W_DT].shape[1], layer[W_CONV].shape[1] if layer[W_CONV].ndim == 2 else 0
    if K < 1 or S < K - 1:
        raise ValueError(f"mixer_step_arrays: wConv (D, K >= 1) and tail (B, D, S >= K-1), "
                         f"got K {K}, S {S}")
    want = {W_IN: (2 * D, Dm), B_IN: (2 * D,), W_CONV: (D, K), B_CONV: (D,), W_X: (R + 2 * N, D),
            B_X: (R + 2 * N,), W_DT: (D, R), B_DT: (D,), A_: (D, N), A_INV: (D, N), D_VEC: (D,),
            W_OUT: (Dm, D), B_OUT: (Dm,)}
    for k, shape in want.items():
        if layer[k].shape != shape:
            raise ValueError(f"layer[{LAYER_ARRAYS[k]}]: expected shape {shape}, got {layer[k].shape}")
    if out.shape != (B, Dm) or h.shape[0] != B or tail.shape[:2] != (B, D):
        raise ValueError("mixer_step_arrays: out (B, Dm), h (B, D, N), tail (B, D, S)")
    for k in range(NW):
        w[k] = _ptr(layer[k])
    s = np.empty(B * (6 * D + R + 2 * N + R), out.dtype)
    for k, a in enumerate((out, xn, h, tail, s)):
        p[k] = _ptr(a)
    nt = mx_threads(n_threads)
    single = out.dtype == np.float32
    with nogil:
        if single:
            mixer_step(<float*>p[0], <const float*>p[1], w, <float*>p[2], <float*>p[3],
                       <float*>p[4], B, Dm, D, N, K, S, R, zoh, 0, nt)
        else:
            mixer_step(<double*>p[0], <const double*>p[1], w, <double*>p[2], <double*>p[3],
                       <double*>p[4], B, Dm, D, N, K, S, R, zoh, 0, nt)


cdef int _argmax_rows(int64_t* out, idx_t ld, const floating* logits, idx_t B,
                      idx_t V) noexcept nogil:
    # out[b * ld] = argmax of row b of logits (B, V) (first maximum); -1 if a row is not finite
    cdef idx_t b, v, best
    cdef floating mx
    for b in range(B):
        best = 0
        mx = logits[b * V]
        for v in range(V):
            if not isfinite(logits[b * V + v]):
                return -1
            if logits[b * V + v] > mx:
                mx = logits[b * V + v]
                best = v
        out[b * ld] = best
    return 0


cdef class Stepper:
    """Pointers of one model's prepared weights and one batch's state, plus scratch.

    Stepper(embedding, final_norm, lm_head_bias, layers, h, conv, eps, zoh, half,
    n_threads): ``layers`` a list of per-layer tuples in LAYER_ARRAYS order, ``h`` and
    ``conv`` the per-layer state arrays (B, D, N) and (B, D, K-1). Every array
    C-contiguous of the state's dtype, except the HALF_ARRAYS and the embedding, which
    are uint16 (float16 bits) when ``half``. Shapes are checked by the caller
    (mamba_ext.recurrent).
    """
    def __cinit__(self):
        self.m.w = NULL
        self.m.h = NULL
        self.m.tail = NULL

    def __init__(self, idx_t batch, cnp.ndarray embedding, cnp.ndarray final_norm,
                 cnp.ndarray lm_head_bias, list layers, list h, list conv, double eps,
                 bint zoh, bint half, int n_threads):
        cdef idx_t i, k, n_layers = len(layers)
        cdef idx_t B = batch, D = 0, N = 0, K = 1, R = 0, Dm, P
        self.dtype = final_norm.dtype
        self.single = self.dtype == np.float32
        if half and not self.single:
            raise ValueError("Stepper: float16 weights need a float32 state")
        arrays = [embedding, final_norm, lm_head_bias] + h + conv
        for p in layers:
            if len(p) != NW:
                raise ValueError(f"layers: expected {NW} arrays per layer")
            arrays.extend(p)
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError("Stepper: every array must be C-contiguous")
        if n_layers != len(h) or n_layers != len(conv) or B < 1:
            raise ValueError("Stepper: one h and one conv state per layer, batch >= 1")
        self.keep = arrays
        if n_layers:
            D, N, K, R = h[0].shape[1], h[0].shape[2], conv[0].shape[2] + 1, layers[0][W_DT].shape[1]
        Dm = final_norm.shape[0]
        P = R + 2 * N
        self.m.n_layers, self.m.B, self.m.V, self.m.Dm = n_layers, B, embedding.shape[0], Dm
        self.m.D, self.m.N, self.m.K, self.m.R = D, N, K, R
        self.m.eps = eps
        self.m.zoh = zoh
        self.m.half = half
        self.m.n_threads = mx_threads(n_threads)
        self.m.embedding = _ptr(embedding)
        self.m.final_norm = _ptr(final_norm)
        self.m.lm_head_bias = _ptr(lm_head_bias)
        self.m.w = <const void**>malloc((n_layers * NW + 1) * sizeof(void*))
        self.m.h = <void**>malloc((n_layers + 1) * sizeof(void*))
        self.m.tail = <void**>malloc((n_layers + 1) * sizeof(void*))
        if self.m.w == NULL or self.m.h == NULL or self.m.tail == NULL:
            raise MemoryError("Stepper: out of memory")
        for i in range(n_layers):
            for k in range(NW):
                self.m.w[i * NW + k] = _ptr(layers[i][k])
            self.m.h[i] = _ptr(h[i])
            self.m.tail[i] = _ptr(conv[i])
        # scratch: x, xn (B, Dm), rstd (B,), xz (B, 2D), u (B, D), xproj (B, P),
        # dt_low (B, R), delta, y, gated (B, D), out (B, Dm)
        self.scratch = np.empty(B * (3 * Dm + 1 + 6 * D + P + R), self.dtype)
        self.m.scratch = _ptr(self.scratch)

    def __dealloc__(self):
        free(self.m.w)
        free(self.m.h)
        free(self.m.tail)

    def step(self, cnp.ndarray ids, cnp.ndarray logits):
        """Feed ids (B,) int64 (in range, checked by the caller); logits (B, V) written."""
        cdef const int64_t* ip = <const int64_t*>_ptr(ids)
        cdef void* lp = _ptr(logits)
        if ids.dtype != np.int64 or ids.shape[0] != self.m.B or not ids.flags.c_contiguous:
            raise ValueError("Stepper.step: ids must be (B,) C-contiguous int64")
        if logits.dtype != self.dtype or logits.size != self.m.B * self.m.V \
                or not logits.flags.c_contiguous:
            raise ValueError("Stepper.step: logits must be (B, V) C-contiguous of the state dtype")
        with nogil:
            if self.single:
                recurrent_step(<float*>lp, ip, &self.m)
            else:
                recurrent_step(<double*>lp, ip, &self.m)

    def greedy(self, cnp.ndarray logits, cnp.ndarray out):
        """Greedy continuation: out (B, n) int64 written column by column with the argmax
        of ``logits`` (B, V) (the logits of the last token fed), each fed back in turn
        (the last one is not fed). Returns -1 on success, else the column whose logits
        were not finite (a diverged model)."""
        cdef idx_t n = out.shape[1], i, j = 0, B = self.m.B
        cdef int64_t* op = <int64_t*>_ptr(out)
        cdef void* lp = _ptr(logits)
        cdef int64_t* ids
        cdef int bad = 0
        if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != B \
                or not out.flags.c_contiguous:
            raise ValueError("Stepper.greedy: out must be (B, n) C-contiguous int64")
        if logits.dtype != self.dtype or logits.size != B * self.m.V \
                or not logits.flags.c_contiguous:
            raise ValueError("Stepper.greedy: logits must be (B, V) C-contiguous of the state dtype")
        ids = <int64_t*>malloc(B * sizeof(int64_t))       # ids (B,) of the token being fed
        if ids == NULL:
            raise MemoryError("Stepper.greedy: out of memory")
        with nogil:
            for j in range(n):
                if self.single:
                    bad = _argmax_rows(op + j, n, <float*>lp, B, self.m.V)
                else:
                    bad = _argmax_rows(op + j, n, <double*>lp, B, self.m.V)
                if bad:
                    break
                if j + 1 < n:
                    for i in range(B):
                        ids[i] = op[i * n + j]
                    if self.single:
                        recurrent_step(<float*>lp, ids, &self.m)
                    else:
                        recurrent_step(<double*>lp, ids, &self.m)
        free(ids)
        return j if bad else -1
