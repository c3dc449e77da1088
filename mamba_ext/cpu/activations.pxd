# Elementwise steps of the block over one row of n values (C: csrc/mx_activations.h,
# scalar float32 maths: csrc/mx_math.h). Suffix _f: float, _d: double.
#   silu_forward:     out (n,) = silu(conv (n,))            (out may alias conv)
#   softplus_forward: delta (n,) = softplus(delta_pre) in place
#   gate_forward:     gated (n,) = y (n,) * silu(z (n,))
#   gate_backward:    dy (n,) = dgated * silu(z); dz (n,) = dgated * y * silu'(z)
#   silu_backward:    du (n,) *= silu'(conv (n,))           (du becomes dconv)
#   softplus_backward: ddelta (n,) *= -expm1(-delta (n,))    (ddelta becomes ddelta_pre)
#   exp_shift:        x (n,) = exp(x - shift) in place        (the cross-entropy's softmax)
#   add:              out (n,) += a (n,)                      (no overlap)
#   row_sum, row_dot2, row_dot3: sum of a, a b, a b c over the row, in double, fixed order
#   row_max:          the largest value of a (n >= 1)
#   rmsnorm_row, rmsnorm_dx_row, rmsnorm_dw_row: RMSNorm's row loops in double
#                     (out = x s w; dx += s (g w - x s dot); dw += g (x s))
cdef extern from "csrc/mx_activations.h" nogil:
    void mx_silu_forward_f(float* out, const float* conv, Py_ssize_t n) noexcept
    void mx_silu_forward_d(double* out, const double* conv, Py_ssize_t n) noexcept
    void mx_softplus_forward_f(float* delta, Py_ssize_t n) noexcept
    void mx_softplus_forward_d(double* delta, Py_ssize_t n) noexcept
    void mx_gate_forward_f(float* gated, const float* y, const float* z, Py_ssize_t n) noexcept
    void mx_gate_forward_d(double* gated, const double* y, const double* z, Py_ssize_t n) noexcept
    void mx_gate_backward_f(float* dy, float* dz, const float* dgated, const float* y,
                            const float* z, Py_ssize_t n) noexcept
    void mx_gate_backward_d(double* dy, double* dz, const double* dgated, const double* y,
                            const double* z, Py_ssize_t n) noexcept
    void mx_silu_backward_f(float* du, const float* conv, Py_ssize_t n) noexcept
    void mx_silu_backward_d(double* du, const double* conv, Py_ssize_t n) noexcept
    void mx_softplus_backward_f(float* ddelta, const float* delta, Py_ssize_t n) noexcept
    void mx_softplus_backward_d(double* ddelta, const double* delta, Py_ssize_t n) noexcept
    void mx_exp_shift_f(float* x, float shift, Py_ssize_t n) noexcept
    void mx_exp_shift_d(double* x, double shift, Py_ssize_t n) noexcept
    void mx_add_f(float* out, const float* a, Py_ssize_t n) noexcept
    void mx_add_d(double* out, const double* a, Py_ssize_t n) noexcept
    double mx_row_sum_f(const float* a, Py_ssize_t n) noexcept
    double mx_row_sum_d(const double* a, Py_ssize_t n) noexcept
    float mx_row_max_f(const float* a, Py_ssize_t n) noexcept
    double mx_row_max_d(const double* a, Py_ssize_t n) noexcept
    double mx_row_dot2_f(const float* a, const float* b, Py_ssize_t n) noexcept
    double mx_row_dot2_d(const double* a, const double* b, Py_ssize_t n) noexcept
    double mx_row_dot3_f(const float* a, const float* b, const float* c, Py_ssize_t n) noexcept
    double mx_row_dot3_d(const double* a, const double* b, const double* c,
                         Py_ssize_t n) noexcept
    void mx_rmsnorm_row_f(float* out, const float* x, const float* weight, double s,
                          Py_ssize_t n) noexcept
    void mx_rmsnorm_row_d(double* out, const double* x, const double* weight, double s,
                          Py_ssize_t n) noexcept
    void mx_rmsnorm_dx_row_f(float* dx, const float* g, const float* weight, const float* x,
                             double s, double dot, Py_ssize_t n) noexcept
    void mx_rmsnorm_dx_row_d(double* dx, const double* g, const double* weight,
                             const double* x, double s, double dot, Py_ssize_t n) noexcept
    void mx_rmsnorm_dw_row_f(float* dw, const float* g, const float* x, double s,
                             Py_ssize_t n) noexcept
    void mx_rmsnorm_dw_row_d(double* dw, const double* g, const double* x, double s,
                             Py_ssize_t n) noexcept
