/* mx_constants.h - the numeric constants of the maths, defined once.
 *
 * Every other place reads them from here: the C kernels directly, the Cython
 * modules through `cdef extern`, Python as mamba_ext.cpu.block.A_LOG_MIN / A_LOG_MAX /
 * DEFAULT_EPS / SCAN_CHUNK (re-exported by mamba_ext.constants), WGSL as pipeline
 * override constants set from Python.
 */
#ifndef MX_CONSTANTS_H
#define MX_CONSTANTS_H

/* A = -exp(clamp(A_log, MX_A_LOG_MIN, MX_A_LOG_MAX)); A_log at or beyond a bound gets
   exactly zero gradient (docs/semantics.md step 7). */
#define MX_A_LOG_MIN (-10.0)
#define MX_A_LOG_MAX 5.0

/* RMSNorm epsilon of the reference semantics (added inside the square root). */
#define MX_DEFAULT_EPS 1e-6

/* Steps per chunk of the CPU chunked scan: the forward stores the state entering each
   chunk (hstate (B, C, D, N), C = ceil(L / MX_SCAN_CHUNK)); the backward recomputes
   one chunk's states at a time. 16/32/64 measured within noise at size c; 64 keeps
   the smallest cache. (The GPU scan has its own SCAN_CHUNK, chosen for its workgroups.) */
#define MX_SCAN_CHUNK 64

#endif /* MX_CONSTANTS_H */
