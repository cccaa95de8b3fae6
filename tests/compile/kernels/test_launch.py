"""compile/kernels/launch.py: when a kernel launches the thread pool (its work, a run-time test over a
symbolic row count, a serial twin with buffers of its own), and the claim counter that hands the
threads their iterations as they come free, linked into every library that calls it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import tvm
from tvm import tirx
from tvm.script import tirx as T

from compile.schedule import cpu_schedule_pass
from tests.support.relax_modules import dense_module, layer_norm_module
from tests.support.schedules import compacted_allocations, cpu_target, fused, prim_funcs, random_floats
from tests.support.tvm_run import build_kernel, build_scheduled, run

TOL = dict(rtol=1e-4, atol=1e-4)
TARGET = cpu_target()


@pytest.mark.parametrize("rows,launches", [(4, "serial"), (4096, "parallel"), ("symbolic", "both")])
def test_a_kernel_launches_the_pool_only_when_its_work_repays_it(rows, launches):
    """A layer norm of a few rows runs on the calling thread, of many rows in parallel, and of a
    symbolic row count behind a run-time test of its iterations, each branch equal to PyTorch."""
    from compile.kernels.launch import MIN_PARALLEL_WORK

    module = layer_norm_module(tirx.Var("m", "int64") if rows == "symbolic" else rows, 64)
    (scheduled,) = prim_funcs(cpu_schedule_pass(TARGET)(fused(module, TARGET))).values()
    script = scheduled.script()
    assert ("T.parallel" in script) == (launches != "serial")
    assert (f">= T.int64({MIN_PARALLEL_WORK})" in script) == (launches == "both")
    g, be = random_floats(64), random_floats(64, 1)[:, 0]
    for count in ([4, 4096] if rows == "symbolic" else [rows]):  # both sides of the test
        xs = random_floats(count, 64) * 2
        expected = torch.nn.functional.layer_norm(torch.from_numpy(xs), (64,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
        np.testing.assert_allclose(run(build_scheduled(module, TARGET), xs, g, be), expected.numpy(), **TOL)


def test_a_matmul_big_enough_at_any_row_count_gets_no_serial_twin():
    """Over a symbolic row count a 384 -> 1152 matmul is >= 2^16 iterations even at one row, so it
    stays parallel without a run-time test or a twin, and its accumulator shrinks to one register tile
    per task."""
    from compile.kernels.launch import MIN_PARALLEL_WORK

    m = tirx.Var("m", "int64")
    scheduled_module = cpu_schedule_pass(TARGET)(fused(dense_module(m, 384, 1152), TARGET))
    (scheduled,) = [f for name, f in prim_funcs(scheduled_module).items() if "matmul" in name]
    script = scheduled.script()
    assert script.count('T.sblock("matmul_update")') == 1  # one copy of the nest: no serial twin
    assert f">= T.int64({MIN_PARALLEL_WORK})" not in script
    accumulators = [line for line in compacted_allocations(scheduled) if "global" in line]
    assert accumulators and all("m" not in line.split("alloc_buffer")[1] for line in accumulators), accumulators


def test_a_serial_twin_has_its_own_copies_of_the_loops_buffers():
    """A layer norm over a symbolic row count has a parallel loop and a serial twin; each keeps its
    per-row mean and partial sums in buffers of its own, so both shrink to one row (shared, they
    stayed [rows] arrays in memory, the lanes' partial sums `rows` floats apart)."""
    m = tirx.Var("m", "int64")
    (scheduled,) = prim_funcs(cpu_schedule_pass(TARGET)(fused(layer_norm_module(m, 384), TARGET))).values()
    allocations = compacted_allocations(scheduled)
    assert len(allocations) == 2 * 5, allocations  # sum, mean, variance and two partials, twice
    assert all("m" not in line.split("alloc_buffer")[1] for line in allocations), allocations


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
    library = build_kernel(claimed, TARGET)
    path = str(tmp_path / "held.so")
    library.export_library(path, addons=objects)
    seen, finished = tvm.runtime.tensor(np.zeros(count, np.int64)), tvm.runtime.tensor(np.zeros(1, np.int64))
    kernel = tvm.runtime.load_module(path)["main"]
    caller = threading.Thread(target=kernel, args=(seen, finished))
    caller.start()
    caller.join()
    assert seen.numpy()[0] == count - held_claim  # every iteration outside the held claim finished meanwhile
    assert sorted(seen.numpy()[1:]) == list(range(1, count)) and finished.numpy()[0] == count - 1  # each ran once


def test_a_library_carries_the_claim_counter_its_linears_call(tmp_path):
    """A linear's panels are claimed by the threads as they come free (its nest calls the counter),
    and a library from build_library runs in a process that never built a kernel: it links the
    counter itself (a fresh interpreter, where no JIT build has loaded it)."""
    import os
    import subprocess
    import sys

    from compile.build import build_library
    from compile.kernels.launch import CLAIM

    module = dense_module(tirx.Var("m", "int64"), 384, 96)
    (scheduled,) = [f for name, f in prim_funcs(cpu_schedule_pass(TARGET)(fused(module, TARGET))).items()
                    if "matmul" in name]
    assert f'"{CLAIM}"' in scheduled.script()
    build_library(module, TARGET, tmp_path / "dense.so")
    x, w, b = random_floats(37, 384), random_floats(384, 96), random_floats(96)
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
