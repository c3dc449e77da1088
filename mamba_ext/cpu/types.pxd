# Shared C types of the kernels.
#
# Size letters used in every kernel file (shape comments such as `# x (M, Dm)`):
#   B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
#   P = R + 2N (x_proj output columns), M = B*L (rows), V vocab size,
#   C = ceil(L / SCAN_CHUNK) scan chunks.
# Every array is C-contiguous, row-major; row r = b*L + t.

ctypedef Py_ssize_t idx_t

# One kernel body serves both precisions.
ctypedef fused floating:
    float
    double
