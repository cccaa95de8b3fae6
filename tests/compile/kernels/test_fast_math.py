"""The vectorisable exp and erf (compile/kernels/fast_math.py) against the C library's, vectorised
for x86-64-v3 so that they run on every CPU here; the softmax's exp also by its instructions."""

from __future__ import annotations

import math
import re

import numpy as np
import tvm
from tvm import te

from compile.build import make_target
from compile.kernels.fast_math import EXP2_POLYNOMIAL, exp2_of_nonpositive, fast_math
from tests.support.tvm_run import build_kernel, call_kernel

TARGET = make_target("cpu", mcpu="x86-64-v3")


def _build(op):
    x = te.placeholder((4096,), "float32", name="x")
    y = te.compute(x.shape, lambda i: op(x[i]), name="y")
    sch = tvm.s_tir.Schedule(fast_math(te.create_prim_func([x, y])))
    _, lanes = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 8])
    sch.vectorize(lanes)
    return build_kernel(sch.mod, TARGET)


def _elementwise(lib, values: np.ndarray) -> np.ndarray:
    return call_kernel(lib, [values], [(values.shape, values.dtype)])[0]


def test_erf_is_within_4e_7_of_the_c_librarys():
    lib = _build(te.erf)
    values = np.linspace(-6, 6, 4096, dtype=np.float32)
    expected = np.array([math.erf(v) for v in values.astype(np.float64)])
    assert np.abs(_elementwise(lib, values) - expected).max() < 4e-7


def test_exp_is_within_3e_7_relative_of_the_c_librarys():
    lib = _build(te.exp)
    values = np.linspace(-87, 88, 4096, dtype=np.float32)
    expected = np.exp(values.astype(np.float64))
    assert (np.abs(_elementwise(lib, values) - expected) / expected).max() < 3e-7


def test_exp_keeps_its_range_ends():
    """Past the polynomial's range: 0 at and below -88 (a masked key's exp), inf where float32 overflows
    (above 88.38), and inf / nan carried through, as the C library gives them."""
    lib = _build(te.exp)
    values = np.array([-np.inf, -3e38, -1000, -88.5, -88, 88.39, 88.7, 1000, np.inf] * 456, np.float32)
    expected = [0, 0, 0, 0, 0, np.inf, np.inf, np.inf, np.inf] * 456
    np.testing.assert_array_equal(_elementwise(lib, np.resize(values, 4096)), np.resize(expected, 4096))


def test_softmax_exp2_reduces_with_adds_and_rounds_without_floor_or_conversion():
    """The softmax's exp, of scores in log2 units less their largest (<= 0), is 2^v to within 1e-7: n =
    round(v) comes from the bits of one add, so its assembly has no vroundps or float-to-int conversion,
    and f = v - n is a subtraction, so its only multiply-adds are the polynomial's (exp's reduction takes
    two more, on the ports the attention products need). Below -127 it is 0, a masked key's weight."""
    lib = _build(exp2_of_nonpositive)
    values = np.linspace(-126, 0, 4096, dtype=np.float32)
    expected = 2.0 ** values.astype(np.float64)
    assert (np.abs(_elementwise(lib, values) - expected) / expected).max() < 1e-7
    np.testing.assert_array_equal(_elementwise(lib, np.resize(np.array([-127.5, -1000, -3e38, -np.inf], np.float32), 4096)), 0)
    assembly = lib.mod.inspect_source("asm")
    instructions = set(re.findall(r"^\s+(v\w+)\s", assembly, re.MULTILINE))
    assert "vpslld" in instructions and not instructions & {"vroundps", "vcvttps2dq", "vcvtps2dq"}
    multiply_adds, shifts = (len(re.findall(rf"^\s+{op}\s", assembly, re.MULTILINE))
                             for op in (r"vfn?madd\w*ps", "vpslld"))
    assert multiply_adds == (len(EXP2_POLYNOMIAL) - 1) * shifts  # one shift a vector (2^n): its Horner steps alone
