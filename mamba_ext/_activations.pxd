# Scalar activation helpers shared by the kernels, inline, for float and double.
#
# silu(x) = x * sigmoid(x); softplus(x) = max(x, 0) + log1p(exp(-|x|)) (no overflow
# for any x); softplus'(x) = sigmoid(x). Every function picks the single- or
# double-precision libm routine so float32 never round-trips through double.
from libc.math cimport exp, expf, log1p, log1pf, expm1, expm1f, fabs, fabsf
from mamba_ext._types cimport floating


cdef inline floating exp_(floating x) noexcept nogil:
    if floating is float:
        return expf(x)
    else:
        return exp(x)


cdef inline floating expm1_(floating x) noexcept nogil:
    if floating is float:
        return expm1f(x)
    else:
        return expm1(x)


cdef inline floating sigmoid(floating x) noexcept nogil:
    # exp(-x) may overflow to inf for x << 0: 1/(1+inf) = 0, the right limit.
    return 1 / (1 + exp_(-x))


cdef inline floating silu(floating x) noexcept nogil:
    return x * sigmoid(x)


cdef inline floating silu_grad(floating x) noexcept nogil:
    # d/dx x*s(x) = s(x) * (1 + x * (1 - s(x)))
    cdef floating s = sigmoid(x)
    return s * (1 + x * (1 - s))


cdef inline floating softplus(floating x) noexcept nogil:
    if floating is float:
        return (x if x > 0 else 0) + log1pf(expf(-fabsf(x)))
    else:
        return (x if x > 0 else 0) + log1p(exp(-fabs(x)))


cdef inline floating softplus_grad_from_output(floating sp) noexcept nogil:
    # sigmoid(x) from sp = softplus(x): exp(sp) = 1 + exp(x), so
    # sigmoid(x) = 1 - exp(-sp) = -expm1(-sp), accurate for tiny sp as well.
    return -expm1_(-sp)
