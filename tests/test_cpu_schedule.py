"""compile/schedule.py and its kernel families (compile/kernels/): numerics of the scheduled kernels on odd shapes, and that it applies.

Small hand-written Relax modules go through the real CPU pipeline (legalize + fuse, then the
schedule pass, then lowering) and are compared with numpy / torch at rtol = atol = 1e-4.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx, topi
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.script import tirx as T

from compile.build import make_target
from compile.capabilities import Capabilities
from compile.kernels.common import read_padded_rows_in_place
from compile.kernels.dense import matmul_axes, schedule_matmul
from compile.kernels.rows import schedule_rows
from compile.lowering import tir_pipeline
from compile.schedule import cpu_pipeline, cpu_schedule_pass

TOL = dict(rtol=1e-4, atol=1e-4)


def _target(mcpu: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({**make_target("cpu", mcpu=mcpu).export(), "num-cores": 2})


TARGET = _target()


def _fused(mod: tvm.IRModule) -> tvm.IRModule:
    with TARGET:
        return tvm.transform.Sequential(cpu.legalize_passes(TARGET))(mod)


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _run(mod: tvm.IRModule, *arrays: np.ndarray):
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET, relax_pipeline=cpu_pipeline(TARGET), tir_pipeline=tir_pipeline(TARGET)), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype("float32")


def _layer_norm_module(m, width: int) -> tvm.IRModule:
    """layer_norm(x[m, width]) with its own gamma and beta."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, width), "float32"))
    gamma, beta = (relax.Var(name, relax.TensorType((width,), "float32")) for name in ("g", "be"))
    with bb.function("main", [x, gamma, beta]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=1e-12)))
        bb.emit_func_output(out)
    return bb.get()


def _dense_module(m, k: int, n: int, epilogue: str = "bias") -> tvm.IRModule:
    """x[m, k] @ w[k, n] + b, then an optional GELU or residual-add-and-scale epilogue."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    r = relax.Var("r", relax.TensorType((m, n), "float32"))
    params = [x, w, b] + ([r] if epilogue == "residual" else [])
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
            if epilogue == "gelu":
                y = bb.emit(relax.op.nn.gelu(y))
            elif epilogue == "residual":
                y = bb.emit(relax.op.multiply(relax.op.add(y, r), relax.const(0.5, "float32")))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _gelu(x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.gelu(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("m", [1, 7, 37, 64])
def test_dense_bias_static_odd_m(m):
    k, n = 48, 40  # n = 40: not a multiple of the AVX2 / AVX-512 N tiles either
    x, w, b = _rand(m, k), _rand(k, n), _rand(n)
    np.testing.assert_allclose(_run(_dense_module(m, k, n), x, w, b), x @ w + b, **TOL)


def test_a_schedule_rule_that_fails_is_said_and_a_later_rule_runs_the_kernel(monkeypatch, caplog):
    def failing(func, lanes):
        raise RuntimeError("the matmul rule cannot split this loop")

    monkeypatch.setattr("compile.schedule.schedule_matmul", failing)
    x, w, b = _rand(9, 48), _rand(48, 40), _rand(40)
    with caplog.at_level("WARNING", logger="compile.schedule"):
        np.testing.assert_allclose(_run(_dense_module(9, 48, 40), x, w, b), x @ w + b, **TOL)
    assert any(re.match(r"fused_matmul\w*: the matmul schedule failed \(RuntimeError: the matmul rule cannot split "
                        r"this loop\); the next rules try it", message) for message in caplog.messages)


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
    (func,) = (f for n, f in _prim_funcs(_fused(bb.get())).items() if "matmul" in n)
    assert schedule_matmul(func, 8) is not None
    xs, ws, bs = _rand(2, 11, 48), _rand(48, 40), _rand(40)
    np.testing.assert_allclose(_run(bb.get(), xs, ws, bs), xs @ ws + bs, **TOL)


def test_dense_residual_and_scale_epilogue():
    m, k, n = 37, 64, 96
    x, w, b, r = _rand(m, k), _rand(k, n), _rand(n), _rand(m, n)
    out = _run(_dense_module(m, k, n, "residual"), x, w, b, r)
    np.testing.assert_allclose(out, (x @ w + b + r) * 0.5, **TOL)


def test_symbolic_m_dense_with_bias_gelu():
    mod = _dense_module(tirx.Var("m", "int64"), 64, 96, "gelu")
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET, relax_pipeline=cpu_pipeline(TARGET), tir_pipeline=tir_pipeline(TARGET)), tvm.cpu())
    w, b = _rand(64, 96), _rand(96)
    for m in (1, 5, 40):
        x = _rand(m, 64)
        out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy()
        np.testing.assert_allclose(out, _gelu(x @ w + b), **TOL)


@pytest.mark.parametrize("m", [tirx.Var("m", "int64"), 37])
def test_a_padded_matmul_reads_its_rows_in_place(m):
    """Rows padded to the register tile are read from x itself, clamped to its last row, not from a
    zero-padded copy of x made every call (numerics at these row counts: the tests above)."""
    (func,) = (f for name, f in _prim_funcs(_fused(_dense_module(m, 64, 96))).items() if "matmul" in name)
    script = schedule_matmul(func, Capabilities.of(TARGET).lanes).mod["main"].script()
    last_row = "m - T.int64(1)" if isinstance(m, tirx.Var) else f"T.int64({m - 1})"
    assert "x_pad" not in script
    assert re.search(rf"x\[T\.min\(v_\w+, {re.escape(last_row)}\), v_k\]", script), script


@T.macro
def _pad_five_rows_to_eight(x, x_pad):
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("x_pad"):
            vi, vk = T.axis.remap("SS", [i, k])
            x_pad[vi, vk] = T.if_then_else(vi < T.int64(5), x[vi, vk], T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def _sums_padded_rows(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(8),), "float32")):
    x_pad = T.sblock_alloc_buffer((T.int64(8), T.int64(4)))
    _pad_five_rows_to_eight(x, x_pad)
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x_pad[vi, vk]


@T.prim_func(private=True, s_tir=True)
def _sums_rows_read_clamped(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(8),), "float32")):
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x[T.min(vi, T.int64(4)), vk]


@T.prim_func(private=True, s_tir=True)
def _sums_padded_row_pairs(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(4),), "float32")):
    x_pad = T.sblock_alloc_buffer((T.int64(8), T.int64(4)))
    _pad_five_rows_to_eight(x, x_pad)
    for i, k in T.grid(T.int64(4), T.int64(4)):
        with T.sblock("pair_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            T.reads(x_pad[vi * T.int64(2):vi * T.int64(2) + T.int64(2), vk])
            T.writes(y[vi])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x_pad[vi * T.int64(2), vk] + x_pad[vi * T.int64(2) + T.int64(1), vk]


def _padded_copy(func: tirx.PrimFunc) -> tirx.Buffer:
    (copy,) = func.body.block.alloc_buffers
    return copy


def test_reads_of_a_padded_copy_read_the_rows_clamped():
    """The copy is dropped and each read of it reads x itself, row min(i, M - 1)."""
    rewritten = read_padded_rows_in_place(_sums_padded_rows, _padded_copy(_sums_padded_rows))
    assert tvm_ffi.structural_equal(rewritten, _sums_rows_read_clamped), rewritten.script()


def test_a_reader_of_several_padded_rows_keeps_the_copy():
    """Clamping the first of a block of rows would let the block run past x's end: nothing changes."""
    rewritten = read_padded_rows_in_place(_sums_padded_row_pairs, _padded_copy(_sums_padded_row_pairs))
    assert tvm_ffi.structural_equal(rewritten, _sums_padded_row_pairs)


def _attention_module(heads: int, d: int, static_seq: int | None = None) -> tvm.IRModule:
    """softmax(q @ k^T * scale) @ v on [batch * heads, seq, d], seq symbolic unless given."""
    bh = tirx.Var("bh", "int64")
    s = static_seq or tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((bh, s, d), "float32"))
    kt = relax.Var("kt", relax.TensorType((bh, d, s), "float32"))
    v = relax.Var("v", relax.TensorType((bh, s, d), "float32"))
    with bb.function("main", [q, kt, v]):
        with bb.dataflow():
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, kt), relax.const(d**-0.5, "float32")))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(relax.op.matmul(probs, v))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 7), (2, 33)])
def test_attention_batch_matmuls_symbolic_seq(batch, seq):
    heads, d = 12, 32
    q, kt, v = _rand(batch * heads, seq, d), _rand(batch * heads, d, seq), _rand(batch * heads, seq, d)
    scores = q @ kt * d**-0.5
    probs = torch.softmax(torch.from_numpy(scores), -1).numpy()
    np.testing.assert_allclose(_run(_attention_module(heads, d), q, kt, v), probs @ v, **TOL)


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
    (func,) = _prim_funcs(mod).values()
    sch = tvm.s_tir.Schedule(func)
    assert matmul_axes(sch.get(sch.get_sblock("T_matmul_NT"))) == ["I", "J", "K"]
    xs, ws = _rand(m, k), _rand(n, k)
    np.testing.assert_allclose(_run(mod, xs, ws), xs @ ws.T, **TOL)


def test_norm_softmax_meanpool_symbolic():
    """The non-matmul kernels of a BERT: layer norm, masked softmax, masked mean-pool."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((b, s, 64), "float32"))
    mask = relax.Var("mask", relax.TensorType((b, s), "float32"))
    gamma, beta = relax.Var("g", relax.TensorType((64,), "float32")), relax.Var("be", relax.TensorType((64,), "float32"))
    with bb.function("main", [h, mask, gamma, beta]):
        with bb.dataflow():
            ln = bb.emit(relax.op.nn.layer_norm(h, gamma, beta, axes=[-1], epsilon=1e-12))
            sm = bb.emit(relax.op.nn.softmax(relax.op.add(ln, relax.op.expand_dims(mask, [2])), axis=1))
            m3 = relax.op.expand_dims(mask, [2])
            pooled = relax.op.divide(relax.op.sum(relax.op.multiply(ln, m3), axis=[1]), relax.op.sum(m3, axis=[1]))
            out = bb.emit_output(relax.Tuple([ln, sm, bb.emit(pooled)]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), TARGET, relax_pipeline=cpu_pipeline(TARGET), tir_pipeline=tir_pipeline(TARGET)), tvm.cpu())
    g, be = _rand(64), _rand(64, 1)[:, 0]
    for shape in [(1, 1), (3, 17)]:
        x = _rand(*shape, 64)
        msk = np.ones(shape, "float32")
        msk[1:, shape[1] // 2 :] = 0
        ln, sm, pooled = (o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in (x, msk, g, be)]))
        t = torch.from_numpy(x)
        ref_ln = torch.nn.functional.layer_norm(t, (64,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
        ref_sm = torch.softmax(ref_ln + torch.from_numpy(msk)[:, :, None], dim=1)
        m3 = torch.from_numpy(msk)[:, :, None]
        np.testing.assert_allclose(ln, ref_ln.numpy(), **TOL)
        np.testing.assert_allclose(sm, ref_sm.numpy(), **TOL)
        np.testing.assert_allclose(pooled, ((ref_ln * m3).sum(1) / m3.sum(1)).numpy(), **TOL)


def test_layer_norm_is_one_parallel_loop_with_vectorised_reductions():
    """Each row's mean and variance reduced in vector lanes, all under one parallel loop over rows
    (dlight's rule launched the pool once per block and summed each row in a scalar chain)."""
    module = _layer_norm_module(tirx.Var("t", "int64"), 384)
    (norm,) = _prim_funcs(_fused(module)).values()
    scheduled = schedule_rows(norm, Capabilities.of(TARGET).lanes).mod.script()
    assert scheduled.count("T.parallel") == 1 and scheduled.count("_rf") >= 2 and "T.vectorized" in scheduled
    xs, g, be = _rand(7, 384) * 3 + 1, _rand(384), _rand(384, 1)[:, 0]
    expected = torch.nn.functional.layer_norm(torch.from_numpy(xs), (384,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
    np.testing.assert_allclose(_run(module, xs, g, be), expected.numpy(), **TOL)


@pytest.mark.parametrize("lane_multiple", [2, 5])
def test_attention_softmax_rows_get_the_vectorised_rule(lane_multiple):
    """Attention's scaled, masked softmax over a sequence bound (where attention is left unfused):
    one fused kernel, one parallel loop over rows, max and sum reduced in vector lanes (`rfactor`),
    equal to PyTorch; symbolic batch. The bound is a multiple of this CPU's lanes (16 and 40 with
    AVX2, 32 and 80 with AVX-512)."""

    seq = lane_multiple * Capabilities.of(TARGET).lanes
    b = tirx.Var("b", "int64")
    bb = relax.BlockBuilder()
    scores = relax.Var("scores", relax.TensorType((b, 4, seq, seq), "float32"))
    mask = relax.Var("mask", relax.TensorType((b, 1, 1, seq), "float32"))
    with bb.function("main", [scores, mask]):
        with bb.dataflow():
            scaled = relax.op.add(relax.op.divide(scores, relax.const(8.0, "float32")), mask)
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(scaled, axis=-1)))
        bb.emit_func_output(out)
    fused = _prim_funcs(_fused(bb.get()))
    softmax = next(f for name, f in fused.items() if "softmax" in name)
    scheduled = schedule_rows(softmax, Capabilities.of(TARGET).lanes)
    assert scheduled is not None and "_rf" in scheduled.mod.script()  # the partial reductions
    assert scheduled.mod.script().count("T.parallel") == 1  # one launch of the thread pool
    x, msk = _rand(3, 4, seq, seq) * 4, np.zeros((3, 1, 1, seq), "float32")
    msk[1, ..., seq // 2:] = -1e9
    expected = torch.softmax(torch.from_numpy(x) / 8.0 + torch.from_numpy(msk), dim=-1).numpy()
    np.testing.assert_allclose(_run(bb.get(), x, msk), expected, **TOL)


def test_row_rule_leaves_a_width_the_lanes_do_not_divide_to_dlight():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(x, axis=-1)))
        bb.emit_func_output(out)
    softmax = next(iter(_prim_funcs(_fused(bb.get())).values()))
    assert schedule_rows(softmax, 8) is None


def _walk_loop_kinds(func: tirx.PrimFunc) -> set[str]:
    kinds: set[str] = set()
    script = func.script()
    for kind in ("T.parallel", "T.vectorized", "T.unroll"):
        if kind in script:
            kinds.add(kind)
    return kinds


def test_rule_applies_parallel_and_vectorized():
    before = _prim_funcs(_fused(_dense_module(tirx.Var("m", "int64"), 384, 1536, "gelu")))
    with TARGET:
        after = _prim_funcs(cpu_schedule_pass(TARGET)(_fused(_dense_module(tirx.Var("m", "int64"), 384, 1536, "gelu"))))
    names = [n for n in before if "matmul" in n]
    assert names, before.keys()
    for name in names:
        unscheduled, scheduled = before[name], after[name]
        assert not tvm_ffi.structural_equal(unscheduled, scheduled)
        assert "T.parallel" not in unscheduled.script()
        assert {"T.parallel", "T.vectorized", "T.unroll"} <= _walk_loop_kinds(scheduled)
        assert "T.erf" not in scheduled.script()  # replaced by the vectorisable rational form
        assert scheduled.attrs["tirx.is_scheduled"]


def test_every_kernel_of_a_layer_is_parallel():
    """No kernel of an attention + norm module is left serial (none may become the bottleneck)."""
    after = cpu_schedule_pass(TARGET)(_fused(_attention_module(12, 32)))
    for name, func in _prim_funcs(after).items():
        assert "T.parallel" in func.script(), name


def test_vector_lanes_follow_target_features():
    assert Capabilities.of(_target("skylake-avx512")).lanes == 16
    assert Capabilities.of(_target("haswell")).lanes == 8
    assert Capabilities.of(_target("x86-64")).lanes == 4


def test_avx512_tile_compiles_without_running():
    """The AVX-512 variant (8 x 48 tile) must at least build, even where it cannot run."""
    target = _target("skylake-avx512")
    (func,) = _prim_funcs(_fused(_dense_module(tirx.Var("m", "int64"), 64, 96))).values()
    sch = schedule_matmul(func, Capabilities.of(target).lanes)
    assert sch is not None
    tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "mm")}), target)


@T.prim_func(private=True, s_tir=True)
def _prefix_sum(a: T.Buffer((T.int64(64),), "float32"), c: T.Buffer((T.int64(64),), "float32")):
    for i in range(T.int64(64)):
        with T.sblock("scan"):
            vi = T.axis.spatial(T.int64(64), i)
            T.reads(a[vi], c[vi - T.int64(1)])
            T.writes(c[vi])
            c[vi] = T.if_then_else(vi == T.int64(0), a[vi], c[vi - T.int64(1)] + a[vi])


def test_unrecognised_loop_carried_kernel_stays_correct():
    """A scan reads its own output: parallelising or vectorising it would be wrong."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64,), "float32"))
    scan = bb.add_func(_prefix_sum, "prefix_sum")
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(scan, (x,), relax.TensorType((64,), "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    with TARGET:
        after = cpu_schedule_pass(TARGET)(mod)
    script = _prim_funcs(after)["prefix_sum"].script()
    assert "T.parallel" not in script and "T.vectorized" not in script
    xs = _rand(64)
    np.testing.assert_allclose(_run(mod, xs), np.cumsum(xs), **TOL)


@pytest.mark.parametrize("rows,launches", [(4, "serial"), (4096, "parallel"), ("symbolic", "both")])
def test_a_kernel_launches_the_pool_only_when_its_work_repays_it(rows, launches):
    """A layer norm of a few rows runs on the calling thread, of many rows in parallel, and of a
    symbolic row count behind a run-time test of its iterations, each branch equal to PyTorch."""
    from compile.kernels.launch import MIN_PARALLEL_WORK

    module = _layer_norm_module(tirx.Var("m", "int64") if rows == "symbolic" else rows, 64)
    (scheduled,) = _prim_funcs(cpu_schedule_pass(TARGET)(_fused(module))).values()
    script = scheduled.script()
    assert ("T.parallel" in script) == (launches != "serial")
    assert (f">= T.int64({MIN_PARALLEL_WORK})" in script) == (launches == "both")
    g, be = _rand(64), _rand(64, 1)[:, 0]
    for count in ([4, 4096] if rows == "symbolic" else [rows]):  # both sides of the test
        xs = _rand(count, 64) * 2
        expected = torch.nn.functional.layer_norm(torch.from_numpy(xs), (64,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
        np.testing.assert_allclose(_run(module, xs, g, be), expected.numpy(), **TOL)


def test_a_matmul_big_enough_at_any_row_count_gets_no_serial_twin():
    """Over a symbolic row count a 384 -> 1152 matmul is >= 2^16 iterations even at one row, so it
    stays parallel without a run-time test or a twin, and its accumulator shrinks to one register tile
    per task."""
    from compile.kernels.launch import MIN_PARALLEL_WORK

    m = tirx.Var("m", "int64")
    (scheduled,) = [f for name, f in _prim_funcs(cpu_schedule_pass(TARGET)(_fused(_dense_module(m, 384, 1152)))).items()
                    if "matmul" in name]
    script = scheduled.script()
    assert script.count('T.sblock("matmul_update")') == 1  # one copy of the nest: no serial twin
    assert f">= T.int64({MIN_PARALLEL_WORK})" not in script
    accumulators = [line for line in _compacted_allocations(scheduled) if "global" in line]
    assert accumulators and all("m" not in line.split("alloc_buffer")[1] for line in accumulators), accumulators


def _compacted_allocations(func: tirx.PrimFunc) -> list[str]:
    """The allocations of `func` (lines of its script) once lowering has shrunk each to the region its
    users touch."""
    compacted = tvm.transform.Sequential([s_tir.transform.LowerInitBlock(),
                                          s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                                          s_tir.transform.ConvertBlocksToOpaque(),
                                          s_tir.transform.CompactBufferAllocation()])(tvm.IRModule({"main": func}))
    return [line for line in compacted.script().splitlines() if "alloc_buffer" in line]


def test_a_serial_twin_has_its_own_copies_of_the_loops_buffers():
    """A layer norm over a symbolic row count has a parallel loop and a serial twin; each keeps its
    per-row mean and partial sums in buffers of its own, so both shrink to one row (shared, they
    stayed [rows] arrays in memory, the lanes' partial sums `rows` floats apart)."""
    m = tirx.Var("m", "int64")
    (scheduled,) = _prim_funcs(cpu_schedule_pass(TARGET)(_fused(_layer_norm_module(m, 384)))).values()
    allocations = _compacted_allocations(scheduled)
    assert len(allocations) == 2 * 5, allocations  # sum, mean, variance and two partials, twice
    assert all("m" not in line.split("alloc_buffer")[1] for line in allocations), allocations


def test_a_reshape_kernel_becomes_a_view_before_it_is_scheduled():
    """The packed embedding reshapes its ids and each gathered block of table rows to [1, tokens,
    hidden]: LegalizeOps makes those copy kernels, and once the schedule pass has parallelised them
    TVM no longer recognises them as reshapes; the pipeline turns them into `vm.builtin.reshape`
    views first."""
    tokens = tirx.Var("tokens", "int64")
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((tokens,), "int64"))
    table = relax.Var("table", relax.TensorType((50, 64), "float32"))
    with bb.function("main", [ids, table]):
        with bb.dataflow():
            batched = bb.emit(relax.op.expand_dims(ids, [0]))
            rows = bb.emit(relax.op.reshape(batched, relax.ShapeExpr([tokens])))
            gathered = bb.emit(relax.op.take(table, rows, axis=0))
            embedded = bb.emit(relax.op.reshape(gathered, relax.ShapeExpr([1, tokens, 64])))
            out = bb.emit_output(relax.op.multiply(embedded, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    built = tvm.compile(bb.get(), TARGET, relax_pipeline=cpu_pipeline(TARGET), tir_pipeline=tir_pipeline(TARGET))
    calls = re.findall(r"call\s+(\S+)", relax.VMExecutable(built).as_text())
    assert "vm.builtin.reshape" in calls
    assert not [name for name in calls if name.startswith("reshape")]
    vm = relax.VirtualMachine(built, tvm.cpu())
    weights = _rand(50, 64)
    chosen = np.array([3, 0, 49, 3, 17], dtype="int64")
    got = vm["main"](tvm.runtime.tensor(chosen), tvm.runtime.tensor(weights)).numpy()
    np.testing.assert_array_equal(got, 2 * weights[chosen][None])


_HELD_ITERATION = r"""
#include <sched.h>
#include <stdint.h>
#include <time.h>

/* Iteration 0: wait (10 s at most) until `others` iterations have finished; how many had. */
int64_t test_wait_for_others(int64_t *finished, int64_t others) {
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  do {
    sched_yield();
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (__atomic_load_n(finished, __ATOMIC_ACQUIRE) < others && now.tv_sec - start.tv_sec < 10);
  return __atomic_load_n(finished, __ATOMIC_ACQUIRE);
}

int64_t test_finish(int64_t *finished) { return __atomic_add_fetch(finished, 1, __ATOMIC_ACQ_REL); }
"""


def _claim_function(library):
    """`library`'s claim counter, callable from Python."""
    import ctypes

    from compile.kernels.launch import CLAIM

    claim = getattr(library, CLAIM)
    claim.restype = ctypes.c_int64
    claim.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    return claim


def _claim_spread() -> int:
    """What a claim divides the iterations left by: twice TVM_NUM_THREADS, else the CPUs this process
    may run on."""
    import os

    return 2 * (int(os.environ.get("TVM_NUM_THREADS", 0)) or len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("threads", [None, "3"])
@pytest.mark.parametrize("iterations, grain", [(48, 1), (48, 5), (1000, 3), (3, 1)])
def test_claims_shrink_to_the_grain_as_the_loop_runs_out(iterations, grain, threads, monkeypatch, tmp_path):
    """The claim counter hands out [first, end) runs that tile the loop in order, each the larger of
    the grain and 1 / spread of what is left: the first at most half a thread's fair share, the
    last ones a grain (the most the threads can reach the join apart). Past the end: empty claims."""
    import ctypes

    from tvm.support import cc

    from compile.kernels.launch import claims_object

    if threads is None:
        monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("TVM_NUM_THREADS", threads)  # the pool's size, which the spread follows
    shared = tmp_path / "claims.so"
    cc.create_shared(str(shared), [str(claims_object())])
    claim = _claim_function(ctypes.CDLL(str(shared)))  # its own copy: the spread read from this environment
    counter, end, runs = ctypes.c_int64(0), ctypes.c_int64(-1), []
    while (first := claim(ctypes.byref(counter), iterations, grain, ctypes.byref(end))) < iterations:
        runs.append((first, end.value))
    assert end.value == first == counter.value == iterations  # nothing left: an empty claim
    assert runs[0][0] == 0 and all(a[1] == b[0] for a, b in zip(runs, runs[1:])) and runs[-1][1] == iterations
    sizes = [stop - start for start, stop in runs]
    spread = _claim_spread()
    assert sizes[0] == max(grain, iterations // spread) <= max(grain, iterations // 2)
    assert sizes == sorted(sizes, reverse=True)  # shrinking
    assert all(size >= grain for size in sizes[:-1]) and 0 < sizes[-1] <= grain
    if iterations // spread > grain:
        assert len(runs) < -(-iterations // grain)  # fewer claims than of a grain each: longer ones while much is left


@pytest.mark.parametrize("grain", [1, 3])
def test_a_thread_held_in_one_iteration_leaves_the_rest_to_the_others(grain, monkeypatch, tmp_path):
    """Claimed iterations: while one thread is held in iteration 0, the others run every iteration
    outside its claim (the first: the larger of the grain and 1 / spread of the loop). With TVM's
    fixed shares the held thread's own share would wait for it (and iteration 0 would give up after
    10 s, having seen fewer finish)."""
    import ctypes

    from compile.kernels.launch import CLAIMS, claim_iterations, claims_object
    from compile.kernels.objects import SOURCES, c_object, load_in_process

    count = 10
    monkeypatch.setenv("TVM_NUM_THREADS", "2")  # a thread's pool is sized when it first launches one
    # the first claim the kernel will meet: from the counter this process resolves first (the one
    # claim_iterations loads; its spread maybe read earlier), asked of a fresh loop
    load_in_process(claims_object())
    first, end = ctypes.c_int64(0), ctypes.c_int64(0)
    _claim_function(ctypes.CDLL(None))(ctypes.byref(first), count, grain, ctypes.byref(end))
    held_claim = end.value

    @T.prim_func(s_tir=True)
    def held(seen: T.Buffer((T.int64(count),), "int64"), finished: T.Buffer((T.int64(1),), "int64")):
        for i in T.parallel(T.int64(count)):
            with T.sblock("iteration"):
                vi = T.axis.spatial(T.int64(count), i)
                T.reads(finished[0])
                T.writes(seen[vi], finished[0])
                if vi == 0:
                    seen[vi] = T.call_extern("int64", "test_wait_for_others", finished.access_ptr("rw"),
                                             T.int64(count - held_claim))
                else:
                    seen[vi] = T.call_extern("int64", "test_finish", finished.access_ptr("rw"))

    claimed = claim_iterations(held, tirx.IntImm("int64", grain))
    assert "bert_claim" in claimed.script()
    objects = [str(c_object("held_iteration", (SOURCES / CLAIMS.source).read_text() + _HELD_ITERATION, ()))]
    library = tvm.compile(tvm.IRModule({"main": claimed}), TARGET, tir_pipeline=tir_pipeline(TARGET))
    path = str(tmp_path / "held.so")
    library.export_library(path, addons=objects)
    seen, finished = tvm.runtime.tensor(np.zeros(count, np.int64)), tvm.runtime.tensor(np.zeros(1, np.int64))
    kernel = tvm.runtime.load_module(path)["main"]
    caller = threading.Thread(target=kernel, args=(seen, finished))
    caller.start()
    caller.join()
    assert seen.numpy()[0] == count - held_claim  # every iteration outside the held claim finished meanwhile
    assert sorted(seen.numpy()[1:]) == list(range(1, count)) and finished.numpy()[0] == count - 1  # each ran once


def test_a_c_micro_kernel_object_lives_until_the_process_exits():
    """The object file the libraries link stays for the process's compiles, and its scratch
    directory goes when the process does (a compile leaves nothing behind in the temp dir)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("from compile.kernels.objects import c_object\n"
              "obj = c_object('probe', 'int probe(void) { return 1; }', ())\nassert obj.is_file()\nprint(obj)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    obj = Path(result.stdout.strip())
    assert obj.name == "probe.o" and not obj.parent.exists()


def test_a_library_carries_the_claim_counter_its_linears_call(tmp_path):
    """A linear's panels are claimed by the threads as they come free (its nest calls the counter),
    and a library from build_library runs in a process that never built a kernel: it links the
    counter itself (a fresh interpreter, where no JIT build has loaded it)."""
    import os
    import subprocess
    import sys

    from compile.build import build_library
    from compile.kernels.launch import CLAIM

    module = _dense_module(tirx.Var("m", "int64"), 384, 96)
    (scheduled,) = [f for name, f in _prim_funcs(cpu_schedule_pass(TARGET)(_fused(module))).items() if "matmul" in name]
    assert f'"{CLAIM}"' in scheduled.script()
    build_library(module, TARGET, tmp_path / "dense.so")
    x, w, b = _rand(37, 384), _rand(384, 96), _rand(96)
    np.save(tmp_path / "x.npy", x), np.save(tmp_path / "w.npy", w), np.save(tmp_path / "b.npy", b)
    script = ("import numpy as np, sys, tvm\n"
              "d = sys.argv[1]\n"
              "vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(d + '/dense.so'), tvm.cpu())\n"
              "args = [tvm.runtime.tensor(np.load(f'{d}/{n}.npy')) for n in 'xwb']\n"
              "np.save(d + '/y.npy', vm['main'](*args).numpy())\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TVM_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), x @ w + b, **TOL)
