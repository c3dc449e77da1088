# The numeric constants of the maths, from their single definition csrc/mx_constants.h.
# Python sees them as mamba_ext.cpu.block.A_LOG_MIN, A_LOG_MAX, DEFAULT_EPS, SCAN_CHUNK.
cdef extern from "csrc/mx_constants.h":
    const double A_LOG_MIN "MX_A_LOG_MIN"      # A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX))
    const double A_LOG_MAX "MX_A_LOG_MAX"
    const double DEFAULT_EPS "MX_DEFAULT_EPS"  # RMSNorm epsilon of the reference semantics
    enum: SCAN_CHUNK "MX_SCAN_CHUNK"           # steps per chunk of the CPU scan
