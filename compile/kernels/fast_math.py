"""Vectorisable float32 exp and erf for CPU kernels."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

# LLVM has no vector erf and lowers exp to libm `expf`, so TVM emits one scalar libm call per
# element and those loops cannot be vectorised: the softmax's exp cost 17% of the whole model and
# the GELU's erf more than the FFN matmul it is fused into. The float32 rational / polynomial
# forms below (the ones `topi.fast_exp` / `topi.fast_erf` use, from Cephes and Eigen; relative
# error ~1e-7) vectorise like any other arithmetic.
_EXP, _ERF = tvm.ir.Op.get("tirx.exp"), tvm.ir.Op.get("tirx.erf")
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
          5.0000001201e-1)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


# 2^f on [-1/2, 1/2], degree 6, fitted for least relative error (8e-8 evaluated in float32, as exp's)
EXP2_POLYNOMIAL = (1.5345800784416497e-4, 1.3399932067841291e-3, 9.618489071726799e-3, 5.550328642129898e-2,
                   0.24022646248340607, 0.6931471824645996, 1.0)
LOG2E, _LN2 = 1.44269504088896341, 0.6931471805599453
_ROUNDER = 1.5 * 2**23 + 127


def _f32(value: float):
    return tirx.const(value, "float32")


def _horner(x, coefficients):
    result = _f32(coefficients[0])
    for c in coefficients[1:]:
        result = result * x + _f32(c)
    return result


def _rounded(shifted):
    """The integer n that `shifted` = x + `_ROUNDER` rounded x to, read back through the sum's bits (as
    (x + c) - c, TVM's simplifier would fold it to x)."""
    return tirx.reinterpret("float32", tirx.reinterpret("int32", shifted)) - _f32(_ROUNDER)


def _exp_of_clamped(x):
    """exp(x) for x in [-88, 88.72], in 12 operations that need the two FMA ports where the reduction
    by a floor takes 17 (the floor is two, the float-to-int conversion one more). The nearest integer
    n of x / ln 2 is rounded by adding 1.5 x 2^23 + 127, whose ulp is 1: the sum's low bits then
    hold n + 127, the exponent field of 2^n, in [0, 255] over that range (0: 2^n = 0, the exp of a
    masked key; 255: inf, as exp overflows float32 above 88.38)."""
    shifted = x * _f32(LOG2E) + _f32(_ROUNDER)
    f = x - _rounded(shifted) * _f32(_LN2)
    y = _horner(f, _EXP_P) * f * f + f + _f32(1.0)
    return tirx.reinterpret("float32", tirx.reinterpret("int32", shifted) << 23) * y


def _fast_exp(v):
    return tirx.max(_exp_of_clamped(tirx.max(tirx.min(v, _f32(88.72)), _f32(-88.0))), v)


def exp2_of_nonpositive(v):
    """2^v for v <= 0, as a softmax takes it of its scores less their largest where the scores are in
    log2 units (the attention kernel scales its queries by log2(e)): no clamp above, and a reduction of
    two adds, where exp's takes two FMAs on the ports the products need. The nearest integer n of v
    comes from the bits of v + 1.5 x 2^23 + 127 as in `_exp_of_clamped`; 2^f on f = v - n in [-1/2, 1/2]
    is `EXP2_POLYNOMIAL`. Below -127 the exponent field is 0: 2^v is 0, the weight of a masked key."""
    x = tirx.max(v, _f32(-127.0))
    shifted = x + _f32(_ROUNDER)
    return tirx.reinterpret("float32", tirx.reinterpret("int32", shifted) << 23) * _horner(
        x - _rounded(shifted), EXP2_POLYNOMIAL)


def _fast_erf(v):
    x = tirx.max(tirx.min(v, _f32(4.0)), _f32(-4.0))
    return x * _horner(x * x, _ERF_P) / _horner(x * x, _ERF_Q)


def _rewrite_call(call):
    if str(call.ty) == "float32" and len(call.args) == 1:
        if call.op.same_as(_EXP):
            return _fast_exp(call.args[0])
        if call.op.same_as(_ERF):
            return _fast_erf(call.args[0])
    return call


def fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with float32 exp and erf replaced by their vectorisable approximations."""
    return tvm_ffi.structural_map(func, [(tvm.ir.expr.Call, _rewrite_call)])
