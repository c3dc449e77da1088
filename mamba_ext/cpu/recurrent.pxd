# C-level contract of the recurrent step of the whole model (generation).
# Size letters: B batch, V vocab, Dm dModel, D dInner, N dState, K dConv, R dtRank.
cimport numpy as cnp
from libc.stdint cimport int64_t
from mamba_ext.cpu.types cimport floating, idx_t

# Per-layer pointers, in this order (also the order of the Python tuples given to Stepper,
# LAYER_ARRAYS); A (D, N) = -exp(clamp(A_log)), A_INV (D, N) = 1/A, computed once.
cdef enum:
    W_IN, B_IN, W_CONV, B_CONV, W_X, B_X, W_DT, B_DT, A_, A_INV, D_VEC, W_OUT, B_OUT, NORM, NW

ctypedef struct step_model:
    idx_t n_layers, B, V, Dm, D, N, K, R
    double eps
    int zoh, half, n_threads    # half: the four projections and the embedding are float16 bits
    const void* embedding       # (V, Dm), float16 bits when half
    const void* final_norm      # (Dm,)
    const void* lm_head_bias    # (V,)
    const void** w              # (n_layers, NW) pointers
    void** h                    # (n_layers,) -> h (B, D, N), updated in place
    void** tail                 # (n_layers,) -> conv tail (B, D, K-1), updated in place
    void* scratch               # B * (3 Dm + 1 + 6 D + P + R) values (recurrent.pyx)

# Feed ids (B,) (in [0, V), checked by the caller): logits (B, V) written, the state
# advanced one step. floating = float with half weights.
cdef void recurrent_step(floating* logits, const int64_t* ids,
                         const step_model* m) noexcept nogil

cdef class Stepper:
    cdef step_model m
    cdef object keep            # every array pointed to, kept alive
    cdef object dtype
    cdef bint single            # float32 state (always so with float16 weights)
    cdef cnp.ndarray scratch
