"""compile/kernels/dense.py: the scheduled matmuls on odd, symbolic and batched shapes, with each
epilogue, a transposed weight, rows padded to the register tile read in place, and the AVX-512 tile
built where it cannot run.

Small hand-written Relax modules go through the real CPU pipeline (legalize + fuse, then the
schedule pass, then lowering) and are compared with numpy / torch at rtol = atol = 1e-4."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx, topi

from compile.capabilities import Capabilities
from compile.kernels.dense import matmul_axes, schedule_matmul
from tests.support.relax_modules import attention_module, dense_module
from tests.support.schedules import cpu_target, fused, prim_funcs, random_floats
from tests.support.tvm_run import build_kernel, build_scheduled, run

TOL = dict(rtol=1e-4, atol=1e-4)
TARGET = cpu_target()


def _gelu(x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.gelu(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("m", [1, 7, 37, 64])
def test_dense_bias_static_odd_m(m):
    k, n = 48, 40  # n = 40: not a multiple of the AVX2 / AVX-512 N tiles either
    x, w, b = random_floats(m, k), random_floats(k, n), random_floats(n)
    np.testing.assert_allclose(run(build_scheduled(dense_module(m, k, n), TARGET), x, w, b), x @ w + b, **TOL)


def test_3d_activation_times_2d_weight_symbolic_seq():
    """x[b, s, k] @ w[k, n] + bias without a reshape: b acts as a batch axis, s as M."""
    s = tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, s, 48), "float32"))
    w = relax.Var("w", relax.TensorType((48, 40), "float32"))
    b = relax.Var("b", relax.TensorType((40,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(relax.op.matmul(x, w), b))
        bb.emit_func_output(out)
    (func,) = (f for n, f in prim_funcs(fused(bb.get(), TARGET)).items() if "matmul" in n)
    assert schedule_matmul(func, 8) is not None
    xs, ws, bs = random_floats(2, 11, 48), random_floats(48, 40), random_floats(40)
    np.testing.assert_allclose(run(build_scheduled(bb.get(), TARGET), xs, ws, bs), xs @ ws + bs, **TOL)


def test_dense_residual_and_scale_epilogue():
    m, k, n = 37, 64, 96
    x, w, b, r = random_floats(m, k), random_floats(k, n), random_floats(n), random_floats(m, n)
    out = run(build_scheduled(dense_module(m, k, n, "residual"), TARGET), x, w, b, r)
    np.testing.assert_allclose(out, (x @ w + b + r) * 0.5, **TOL)


def test_symbolic_m_dense_with_bias_gelu():
    mod = dense_module(tirx.Var("m", "int64"), 64, 96, "gelu")
    built = build_scheduled(mod, TARGET)
    w, b = random_floats(64, 96), random_floats(96)
    for m in (1, 5, 40):
        x = random_floats(m, 64)
        np.testing.assert_allclose(run(built, x, w, b), _gelu(x @ w + b), **TOL)


@pytest.mark.parametrize("m", [tirx.Var("m", "int64"), 37])
def test_a_padded_matmul_reads_its_rows_in_place(m):
    """Rows padded to the register tile are read from x itself, clamped to its last row, not from a
    zero-padded copy of x made every call (numerics at these row counts: the tests above)."""
    (func,) = (f for name, f in prim_funcs(fused(dense_module(m, 64, 96), TARGET)).items() if "matmul" in name)
    script = schedule_matmul(func, Capabilities.of(TARGET).lanes).mod["main"].script()
    last_row = "m - T.int64(1)" if isinstance(m, tirx.Var) else f"T.int64({m - 1})"
    assert "x_pad" not in script
    assert re.search(rf"x\[T\.min\(v_\w+, {re.escape(last_row)}\), v_k\]", script), script


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 7), (2, 33)])
def test_attention_batch_matmuls_symbolic_seq(batch, seq):
    heads, d = 12, 32
    q, kt, v = (random_floats(*shape) for shape in ((batch * heads, seq, d), (batch * heads, d, seq), (batch * heads, seq, d)))
    scores = q @ kt * d**-0.5
    probs = torch.softmax(torch.from_numpy(scores), -1).numpy()
    np.testing.assert_allclose(run(build_scheduled(attention_module(heads, d), TARGET), q, kt, v), probs @ v, **TOL)


def test_dense_with_transposed_weight():
    """topi dense is x[m, k] * w[n, k]: the N axis of B is not its innermost one."""
    m, k, n = 29, 64, 48
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.nn.dense, x, w))
        bb.emit_func_output(out)
    mod = bb.get()
    (func,) = prim_funcs(mod).values()
    sch = tvm.s_tir.Schedule(func)
    assert matmul_axes(sch.get(sch.get_sblock("T_matmul_NT"))) == ["I", "J", "K"]
    xs, ws = random_floats(m, k), random_floats(n, k)
    np.testing.assert_allclose(run(build_scheduled(mod, TARGET), xs, ws), xs @ ws.T, **TOL)


def test_avx512_tile_compiles_without_running():
    """The AVX-512 variant (8 x 48 tile) must at least build, even where it cannot run."""
    target = cpu_target("skylake-avx512")
    (func,) = prim_funcs(fused(dense_module(tirx.Var("m", "int64"), 64, 96), TARGET)).values()
    sch = schedule_matmul(func, Capabilities.of(target).lanes)
    assert sch is not None
    build_kernel(sch.mod["main"].with_attr("global_symbol", "mm"), target)
