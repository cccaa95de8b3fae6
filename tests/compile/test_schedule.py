"""compile/schedule.py: the CPU schedule pass applies a rule to every kernel of a layer (parallel, vectorised),
says when a rule fails and lets the next one run, leaves a loop-carried kernel serial, and the pipeline
turns reshape kernels into views first.

Small hand-written Relax modules go through the real CPU pipeline (legalize + fuse, then the
schedule pass, then lowering) and are compared with numpy at rtol = atol = 1e-4."""

from __future__ import annotations

import re

import numpy as np
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

from compile.schedule import cpu_schedule_pass
from tests.support.relax_modules import attention_module, dense_module
from tests.support.schedules import cpu_target, fused, prim_funcs, random_floats
from tests.support.tvm_run import build_scheduled, run

TOL = dict(rtol=1e-4, atol=1e-4)
TARGET = cpu_target()


def test_a_schedule_rule_that_fails_is_said_and_a_later_rule_runs_the_kernel(monkeypatch, caplog):
    def failing(func, lanes):
        raise RuntimeError("the matmul rule cannot split this loop")

    monkeypatch.setattr("compile.schedule.schedule_matmul", failing)
    x, w, b = random_floats(9, 48), random_floats(48, 40), random_floats(40)
    with caplog.at_level("WARNING", logger="compile.schedule"):
        np.testing.assert_allclose(run(build_scheduled(dense_module(9, 48, 40), TARGET), x, w, b), x @ w + b, **TOL)
    assert any(re.match(r"fused_matmul\w*: the matmul schedule failed \(RuntimeError: the matmul rule cannot split "
                        r"this loop\); the next rules try it", message) for message in caplog.messages)


def _walk_loop_kinds(func: tirx.PrimFunc) -> set[str]:
    kinds: set[str] = set()
    script = func.script()
    for kind in ("T.parallel", "T.vectorized", "T.unroll"):
        if kind in script:
            kinds.add(kind)
    return kinds


def test_rule_applies_parallel_and_vectorized():
    dense = dense_module(tirx.Var("m", "int64"), 384, 1536, "gelu")
    before = prim_funcs(fused(dense, TARGET))
    with TARGET:
        after = prim_funcs(cpu_schedule_pass(TARGET)(fused(dense, TARGET)))
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
    after = cpu_schedule_pass(TARGET)(fused(attention_module(12, 32), TARGET))
    for name, func in prim_funcs(after).items():
        assert "T.parallel" in func.script(), name


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
    script = prim_funcs(after)["prefix_sum"].script()
    assert "T.parallel" not in script and "T.vectorized" not in script
    xs = random_floats(64)
    np.testing.assert_allclose(run(build_scheduled(mod, TARGET), xs), np.cumsum(xs), **TOL)


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
    built = build_scheduled(bb.get(), TARGET)
    calls = re.findall(r"call\s+(\S+)", relax.VMExecutable(built).as_text())
    assert "vm.builtin.reshape" in calls
    assert not [name for name in calls if name.startswith("reshape")]
    weights = random_floats(50, 64)
    chosen = np.array([3, 0, 49, 3, 17], dtype="int64")
    np.testing.assert_array_equal(run(built, chosen, weights), 2 * weights[chosen][None])
