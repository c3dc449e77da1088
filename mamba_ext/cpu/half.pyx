# cython: language_level=3
"""float16 conversions of flat float32 arrays in C (csrc/mx_half.h): mixed precision's
rounding of gradients to fp16 values (mamba_ext.amp.round_fp16), their fp16 copies for the
wire and the sum of the ranks' fp16 copies (mamba_ext.training.distributed.FlatStream).

NumPy's float16 casts run one element at a time (2.5-4.5 ns each on our 2-core machine);
these loops are vectorised and give the same bits as ``astype(np.float16)`` (NaN: a quiet
NaN). Large arrays are cut into CHUNK-element pieces over ``n_threads`` OpenMP threads
(0: the OpenMP default).

Size letters: n elements, P rows.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t
from mamba_ext.cpu.types cimport idx_t

cdef extern from "csrc/mx_half.h" nogil:
    void mx_float_to_half_row(uint16_t* out, const float* x, idx_t n) noexcept
    void mx_round_half_f(float* out, const float* x, idx_t n) noexcept
    void mx_half_rows_sum_f(float* out, const uint16_t* h, idx_t P, idx_t n, idx_t ld) noexcept

cdef enum:
    CHUNK = 65536          # elements per OpenMP work item
    PAR_MIN = 262144       # below this, threads cost more than they save


cdef inline idx_t _end(idx_t c, idx_t n) noexcept nogil:
    return n if (c + 1) * CHUNK > n else (c + 1) * CHUNK


def round_fp16_array(const float[::1] x, float[::1] out, int n_threads=0):
    """out (n,) = x (n,) rounded to float16 values, as float32 (``out`` may be ``x``)."""
    cdef idx_t n = x.shape[0], c
    if out.shape[0] != n:
        raise ValueError(f"round_fp16_array: out: expected {n} elements, got {out.shape[0]}")
    if n == 0:
        return
    with nogil:
        if n < PAR_MIN or n_threads == 1:
            mx_round_half_f(&out[0], &x[0], n)
        elif n_threads > 0:
            for c in prange((n + CHUNK - 1) // CHUNK, schedule='static', num_threads=n_threads):
                mx_round_half_f(&out[c * CHUNK], &x[c * CHUNK], _end(c, n) - c * CHUNK)
        else:
            for c in prange((n + CHUNK - 1) // CHUNK, schedule='static'):
                mx_round_half_f(&out[c * CHUNK], &x[c * CHUNK], _end(c, n) - c * CHUNK)


def fp16_bits(const float[::1] x, uint16_t[::1] out):
    """out (n,) = the float16 bits of x (n,) (``x.astype(np.float16).view(np.uint16)``)."""
    cdef idx_t n = x.shape[0]
    if out.shape[0] != n:
        raise ValueError(f"fp16_bits: out: expected {n} elements, got {out.shape[0]}")
    if n:
        with nogil:
            mx_float_to_half_row(&out[0], &x[0], n)


def sum_fp16_rows(const uint16_t[:, ::1] rows, float[::1] out):
    """out (n,) = the sum of the P rows (P, n) of float16 bits, in float32, in row order."""
    cdef idx_t P = rows.shape[0], n = rows.shape[1]
    if out.shape[0] != n:
        raise ValueError(f"sum_fp16_rows: out: expected {n} elements, got {out.shape[0]}")
    if P == 0:
        raise ValueError("sum_fp16_rows: rows: expected at least one row")
    if n:
        with nogil:
            mx_half_rows_sum_f(&out[0], &rows[0, 0], P, n, n)
