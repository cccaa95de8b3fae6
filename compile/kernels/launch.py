"""Parallel only when it pays, and shared as the threads are free.

Every parallel loop of a scheduled kernel gets a serial twin, taken at run time when the loop's
work is too small to repay waking the thread pool.

A parallel loop launches TVM's thread pool: the other threads are woken (a futex when they sleep,
as they do after a pause) and joined, 10-30 us on these machines, where a layer norm or a row
quantisation of a few tokens computes in a few microseconds. ONNX Runtime runs such small ops on
the calling thread; so does a kernel here, when its iteration count (the product of its loops'
extents, known only at run time for a symbolic token count) is under `MIN_PARALLEL_WORK`.

TVM's pool hands each thread a fixed share of a parallel loop's iterations, so a thread that runs
slower for a while (a shared host: another tenant on its core) leaves the other waiting at the
join. perf of a bf16 MiniLM call at 512 tokens on a shared 2-core host found each thread idle
10-18% of the time, most of it waiting for the other to finish its share of a linear's panels, and
of an fp32 one at 128 tokens (x86-64-v3 code) the second thread idle 22% while the first ran the
same panels 19% slower. `claim_iterations` lets the threads take the iterations of such a loop as
they come free instead (one atomic compare-and-swap per claim, c/claims.c), as TBB's and
OpenMP's dynamic schedules do: the linears' panels and attention's (sequence, head) tasks, in every
CPU library, which links the counter (`claims_object`). Paired against fixed shares on that host:
bf16 MiniLM calls 0.89-0.95x the time (1x16 to 8x128); x86-64-v3 fp32 and int8 calls 0.91-0.97x
at 1x128 and 8x128 (alternating calls), 0.85-0.98x on mixed lengths (docs/experiments/claimed-iterations.md); the
fastest calls unchanged.

Claims shrink as the loop runs out, as OpenMP's guided schedule's do: each takes a share of what is
left, so the first are long (a thread's prefetched panels stay its own) and the last a grain, and
the threads reach the join at most a grain apart. With claims of a fixed 1/16 of the loop, perf of
an x86-64-v3 fp32 MiniLM call at 128 tokens found the calling thread waiting at the linears' joins
~3% of its time in a busy hour of a shared host (docs/experiments/guided-claims.md pairs the two kinds of
claim: 0.99-1.00x the time in a quiet hour, where the threads rarely wait).
"""

from __future__ import annotations

import collections
from pathlib import Path

import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.sym import Analyzer, ConstIntBound

from . import script
from .objects import CObject, load_in_process

# Iterations of a loop nest below which it runs on the calling thread. A power of two between the
# two ways it can be wrong, on MiniLM's packed libraries at 16-128 tokens on 2 threads: lower, the
# pool is woken for kernels that take less than the wake-up (a 16-token call has ~60 of them);
# higher, the second core idles through kernels worth splitting (the layer norms and row
# quantisations of 64-128 tokens). 2^15 to 2^17 were timed when it was chosen; 2^16 sits between.
MIN_PARALLEL_WORK = 1 << 16

CLAIM = "bert_claim"
_BODY = "claimed iterations"  # the placeholder `claim_iterations` puts the loop's body in
# Work a thread claims at once at the least: 14-28 us of an AVX-512 / AVX2 core's fp32 multiply-adds
CLAIMED_MULTIPLY_ADDS = 1 << 20
# The claim counter (c/claims.c)
CLAIMS = CObject("claims.c", frozenset({CLAIM}))


def claims_object() -> Path:
    """The claim counter compiled to an object file, which every CPU library links."""
    return CLAIMS.build()


def claim_grain(multiply_adds_per_iteration) -> tirx.PrimExpr:
    """The fewest iterations a claim takes, of a loop whose iterations each compute
    `multiply_adds_per_iteration`: CLAIMED_MULTIPLY_ADDS, so the counter's cache line, which moves
    between the cores at each claim, is not paid every few microseconds (a linear of 16 tokens)."""
    grain = tirx.IntImm("int64", CLAIMED_MULTIPLY_ADDS) // _int64(multiply_adds_per_iteration)
    return tirx.max(tirx.IntImm("int64", 1), grain)


def _int64(value) -> tirx.PrimExpr:
    return tirx.IntImm("int64", value) if isinstance(value, int) else tirx.Cast("int64", value)


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


def _fresh(stmt, copies: dict):
    """`stmt` with new loop, block, let and buffer variables: a second copy beside the first must not
    share them. Buffers it allocates get new ones, and those outside it get theirs from `copies`.
    None when a block matches a buffer region (a tensorized intrinsic's view, whose offsets name the
    loop variables inside its type)."""
    renamed, matched = dict(copies), []

    def define(var):
        renamed.setdefault(var, tirx.Var(var.name, var.ty))

    def loop(node):
        define(node.loop_var)
        return node

    def block(node):
        for iter_var in node.iter_vars:
            define(iter_var.var)
        for buffer in node.alloc_buffers:
            define(buffer)
        matched.extend(node.match_buffers)
        return node

    def let(node):
        define(node.var)
        return node

    def allocation(node):
        define(node.buffer)
        return node

    tvm_ffi.structural_map(stmt, [(tirx.For, loop), (s_tir.SBlock, block), (tirx.LetStmt, let),
                                  (tirx.AllocBuffer, allocation), (tirx.DeclBuffer, allocation)])
    if matched:
        return None
    return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda var: renamed.get(var, var))])


def _uses(stmt, buffers) -> collections.Counter:
    """How often each of `buffers` is named in `stmt`."""
    counts = collections.Counter()

    def count(var):
        if var in buffers:
            counts[var] += 1
        return var

    tvm_ffi.structural_map(stmt, [(tirx.Var, count)])
    return counts


def _always_big_enough(work: tirx.PrimExpr) -> bool:
    """Whether `work` reaches MIN_PARALLEL_WORK whatever its symbolic sizes (each at least 1)."""
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(work):
        analyzer.update(var, ConstIntBound(1, ConstIntBound.POS_INF))
    return analyzer.can_prove(work >= MIN_PARALLEL_WORK)


def _version(loop, root_buffers, root_uses, copied):
    """`loop` as it is, or its serial twin, or both behind a run-time test of its iterations. The
    twin's copies of root-level buffers used only in `loop` are appended to `copied`."""
    if loop.kind != tirx.ForKind.PARALLEL:
        return loop
    work = _work(loop)
    if work is None or _always_big_enough(work):
        return loop  # data-dependent, or big enough at any size: nothing to test at run time
    # a root-level buffer used only in this loop gets a copy for the twin: one buffer behind both
    # would be compacted to what both touch, not to one task's share (a layer norm's per-row mean and
    # partial sums would stay [tokens] arrays in memory, its partials strided by the token count)
    copies = {buffer: tirx.Var(buffer.name, buffer.ty) for buffer, count in _uses(loop, root_buffers).items()
              if count == root_uses[buffer]}
    twin = _fresh(loop, copies)
    if twin is None:
        return loop
    copied.extend(copies.values())
    serial = tirx.For(twin.loop_var, twin.min, twin.extent, tirx.ForKind.SERIAL, twin.body)
    if isinstance(work, tirx.IntImm):
        return serial  # always too small
    return tirx.IfThenElse(tirx.Cast("int64", work) >= tirx.IntImm("int64", MIN_PARALLEL_WORK), loop, serial)


def parallel_when_it_pays(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each parallel loop run on the calling thread when its work is small (a kernel
    whose loops' extents are data, like attention's, tests its own bound)."""
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return tvm_ffi.structural_map(func, [(tirx.For, lambda loop: _version(loop, set(), {}, []))])
    root = realize.block
    root_buffers = set(root.alloc_buffers)
    root_uses = _uses(root.body, root_buffers)
    copied = []
    body = tvm_ffi.structural_map(root.body, [(tirx.For, lambda loop: _version(loop, root_buffers, root_uses, copied))])
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                        list(root.alloc_buffers) + copied, root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, root))


def _claims_loop(iterations: tirx.PrimExpr, grain: tirx.PrimExpr) -> tirx.Stmt:
    """A loop whose threads claim its iterations in shrinking runs of at least `grain`, with its
    counter. Each thread walks the iterations in order, running those of its claims (a placeholder
    body) and claiming the next run after the last of one: claims only grow, so one pass meets them
    all, and the loop keeps plain bounds (bounds read from a buffer defeat TVM's buffer compaction)."""

    @script.prim_func(s_tir=True, check_well_formed=False)  # the extents name the kernel's variables
    def template():
        claims = T.alloc_buffer((1,), "int64")
        claims[0] = T.int64(0)
        for _worker in T.parallel(iterations):  # each thread's first turn claims until none are left
            claim = T.alloc_buffer((2,), "int64", scope="local")  # [first, end) of the thread's claim
            claim[0] = claims[0]  # a plain read: the thread's later turns end here, no atomic
            if claim[0] < iterations:
                claim[0] = T.call_extern("int64", CLAIM, claims.access_ptr("rw"), iterations, grain,
                                         claim.access_ptr("w", offset=1))
                for claimed in range(iterations):
                    if claim[0] <= claimed and claimed < claim[1]:
                        T.evaluate(T.call_extern("int32", _BODY))
                        if claimed == claim[1] - 1:
                            claim[0] = T.call_extern("int64", CLAIM, claims.access_ptr("rw"), iterations, grain,
                                                     claim.access_ptr("w", offset=1))

    return template.body


def _is_placeholder(stmt: tirx.Evaluate) -> bool:
    args = getattr(stmt.value, "args", ())
    return len(args) == 1 and getattr(args[0], "value", None) == _BODY


def claim_iterations(func: tirx.PrimFunc, grain: tirx.PrimExpr, loop_var: tirx.Var | None = None) -> tirx.PrimFunc:
    """`func` with the parallel loop over `loop_var` (by default its only parallel loop; from 0) shared
    by claims of `grain` iterations: each thread runs the next unclaimed ones as soon as it is free.
    Its library must link `claims_object` (build_library does); this process may JIT and run it."""
    load_in_process(claims_object())
    loops = []
    tvm_ffi.structural_map(func.body, [(tirx.For, lambda loop: loops.append(loop) or loop)])
    (loop,) = [loop for loop in loops if (loop.loop_var.same_as(loop_var) if loop_var is not None
                                          else loop.kind == tirx.ForKind.PARALLEL)]
    assert loop.kind == tirx.ForKind.PARALLEL and isinstance(loop.min, tirx.IntImm) and int(loop.min) == 0
    assert loop.loop_var.ty.dtype == "int64", "the claims count in int64"

    def splice(node):
        if node.loop_var.name != "claimed":
            return node
        body = tvm_ffi.structural_map(node.body, [(tirx.Var, lambda var: loop.loop_var
                                                   if var.same_as(node.loop_var) else var)])
        body = tvm_ffi.structural_map(body, [(tirx.Evaluate, lambda stmt: loop.body if _is_placeholder(stmt)
                                               else stmt)])
        return tirx.For(loop.loop_var, node.min, node.extent, tirx.ForKind.SERIAL, body)

    shared = tvm_ffi.structural_map(_claims_loop(loop.extent, grain), [(tirx.For, splice)])
    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, lambda node: shared if node.same_as(loop)
                                                               else node)]))
