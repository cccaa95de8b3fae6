"""The vectorisable exp and erf (compile/kernels/fast_math.py) against the C library's, vectorised
for x86-64-v3 so that they run on every CPU here."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import te

from compile.build import make_target
from compile.kernels.fast_math import fast_math

TARGET = make_target("cpu", mcpu="x86-64-v3")


def _build(op):
    x = te.placeholder((4096,), "float32", name="x")
    y = te.compute(x.shape, lambda i: op(x[i]), name="y")
    sch = tvm.s_tir.Schedule(fast_math(te.create_prim_func([x, y])))
    _, lanes = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 8])
    sch.vectorize(lanes)
    return tvm.compile(sch.mod, target=TARGET)


def _run(lib, values: np.ndarray) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros_like(values))
    lib(tvm.runtime.tensor(values), out)
    return out.numpy()


def test_erf_is_within_4e_7_of_the_c_librarys():
    lib = _build(te.erf)
    values = np.linspace(-6, 6, 4096, dtype=np.float32)
    expected = np.array([math.erf(v) for v in values.astype(np.float64)])
    assert np.abs(_run(lib, values) - expected).max() < 4e-7


def test_exp_is_within_3e_7_relative_of_the_c_librarys():
    lib = _build(te.exp)
    values = np.linspace(-87, 88, 4096, dtype=np.float32)
    expected = np.exp(values.astype(np.float64))
    assert (np.abs(_run(lib, values) - expected) / expected).max() < 3e-7
