"""Parallel only when it pays: every parallel loop of a scheduled kernel gets a serial twin, taken at
run time when the loop's work is too small to repay waking the thread pool.

A parallel loop launches TVM's thread pool: the other threads are woken (a futex when they sleep,
as they do after a pause) and joined, 10-30 us on these machines, where a layer norm or a row
quantisation of a few tokens computes in a few microseconds. ONNX Runtime runs such small ops on
the calling thread; so does a kernel here, when its iteration count (the product of its loops'
extents, known only at run time for a symbolic token count) is under `MIN_PARALLEL_WORK`.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer, ConstIntBound

# Iterations of a loop nest below which it runs on the calling thread. Measured while choosing it, on
# MiniLM's packed libraries, 2 threads, znver4: with the pool's threads asleep between kernels, 2^15
# to 2^17 take a 16-token call to 0.70-0.83x its time; with them spinning, 2^17 and more cost
# 3-13% at 64-128 tokens while 2^15 costs nothing. 2^16 sits between.
MIN_PARALLEL_WORK = 1 << 16


def _work(stmt) -> tirx.PrimExpr | None:
    """Iterations of the innermost statements under `stmt`, or None when an extent is data-dependent."""
    if isinstance(stmt, tirx.For):
        body = _work(stmt.body)
        if body is None or _reads_buffers(stmt.extent):
            return None
        return stmt.extent * body
    if isinstance(stmt, tirx.SeqStmt):
        parts = [_work(s) for s in stmt.seq]
        if any(p is None for p in parts):
            return None
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total
    if isinstance(stmt, tirx.IfThenElse):
        then, other = _work(stmt.then_case), _work(stmt.else_case) if stmt.else_case is not None else _one(stmt)
        return None if then is None or other is None else tirx.max(then, other)
    if isinstance(stmt, s_tir.SBlockRealize):
        return _work(stmt.block)
    if isinstance(stmt, s_tir.SBlock):
        body = _work(stmt.body)
        init = _work(stmt.init) if stmt.init is not None else None
        return body if init is None or body is None else body + init
    if isinstance(stmt, (tirx.LetStmt, tirx.AttrStmt, tirx.DeclBuffer, tirx.AllocBuffer)) and hasattr(stmt, "body"):
        return _work(stmt.body)
    return _one(stmt)


def _one(_stmt) -> tirx.PrimExpr:
    return tirx.IntImm("int64", 1)


def _reads_buffers(expr) -> bool:
    return any(type(var.ty).__name__ == "BufferType" for var in tirx.analysis.undefined_vars(expr))


def _fresh(stmt):
    """`stmt` with new loop, block and let variables (a second copy beside the first must not share
    them), or None when it defines buffers of its own (those would need copies too)."""
    renamed, buffers = {}, []

    def define(var):
        renamed.setdefault(var, tirx.Var(var.name, var.ty))

    def loop(node):
        define(node.loop_var)
        return node

    def block(node):
        for iter_var in node.iter_vars:
            define(iter_var.var)
        buffers.extend(node.alloc_buffers)
        return node

    def let(node):
        define(node.var)
        return node

    def allocation(node):
        buffers.append(node)
        return node

    tvm_ffi.structural_map(stmt, [(tirx.For, loop), (s_tir.SBlock, block), (tirx.LetStmt, let),
                                  (tirx.AllocBuffer, allocation), (tirx.DeclBuffer, allocation)])
    if buffers:
        return None
    return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda var: renamed.get(var, var))])


def _always_big_enough(work: tirx.PrimExpr) -> bool:
    """Whether `work` reaches MIN_PARALLEL_WORK whatever its symbolic sizes (each at least 1)."""
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(work):
        analyzer.update(var, ConstIntBound(1, ConstIntBound.POS_INF))
    return analyzer.can_prove(work >= MIN_PARALLEL_WORK)


def _version(loop):
    """`loop` as it is, or its serial twin, or both behind a run-time test of its iterations."""
    if loop.kind != tirx.ForKind.PARALLEL:
        return loop
    work = _work(loop)
    if work is None or _always_big_enough(work):
        # Data-dependent, or big enough at any size. No twin then: two copies of a loop nest share
        # its root-level buffers, which lowering can then no longer shrink to what one task uses
        # (a matmul's register tile stayed a [tokens, N] buffer in memory).
        return loop
    twin = _fresh(loop)
    if twin is None:
        return loop
    serial = tirx.For(twin.loop_var, twin.min, twin.extent, tirx.ForKind.SERIAL, twin.body)
    if isinstance(work, tirx.IntImm):
        return serial  # always too small
    return tirx.IfThenElse(tirx.Cast("int64", work) >= tirx.IntImm("int64", MIN_PARALLEL_WORK), loop, serial)


def parallel_when_it_pays(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each parallel loop run on the calling thread when its work is small (a kernel
    whose loops' extents are data, like attention's, tests its own bound)."""
    return tvm_ffi.structural_map(func, [(tirx.For, _version)])

