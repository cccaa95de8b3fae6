"""compile/lowering.py: the CPU libraries' TIR pipeline keeps small scratch buffers on the stack.

Before/Expected for `stack_allocate_small_buffers`, then what it changes in a real build: the
allocations LowerTVMBuiltin turns into heap workspaces, and the same results.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from compile.build import make_target
from compile.lowering import CPU_TIR_PIPELINE, STACK_BUFFER_BYTES, stack_allocate_small_buffers, tir_pipeline
from tests.support.tvm_run import build_kernel, call_kernel

SMALL = 256  # floats: 1 KB, where TVM starts using a heap workspace
LARGE = 4 * STACK_BUFFER_BYTES  # floats, read at every 16th: 16 KB after compaction, 4x the stack limit


@T.prim_func(private=True)
def before(a: T.Buffer((SMALL,), "float32"), out: T.Buffer((SMALL,), "float32")):
    small = T.alloc_buffer((SMALL,), "float32")
    scratch = T.alloc_buffer((SMALL,), "float32", scope="local")
    large = T.alloc_buffer((LARGE,), "float32")
    for i in range(SMALL):
        small[i] = a[i] * T.float32(2)
        scratch[i] = a[i] + T.float32(1)
        large[i * 16] = a[i]
        out[i] = small[i] + scratch[i] + large[i * 16]


@T.prim_func(private=True)
def expected(a: T.Buffer((SMALL,), "float32"), out: T.Buffer((SMALL,), "float32")):
    small = T.alloc_buffer((SMALL,), "float32", annotations={"disable_lower_builtin": T.bool(True)})
    scratch = T.alloc_buffer((SMALL,), "float32", scope="local", annotations={"disable_lower_builtin": T.bool(True)})
    large = T.alloc_buffer((LARGE,), "float32")
    for i in range(SMALL):
        small[i] = a[i] * T.float32(2)
        scratch[i] = a[i] + T.float32(1)
        large[i * 16] = a[i]
        out[i] = small[i] + scratch[i] + large[i * 16]


def test_buffers_up_to_the_limit_are_marked_to_stay_on_the_stack():
    after = stack_allocate_small_buffers(tvm.IRModule({"main": before}))["main"]
    tvm.ir.assert_structural_equal(after, expected)


def _lowered_host(pipeline: str) -> str:
    target = make_target("cpu")
    lower, finalize_host, _ = tvm.tirx.get_tir_pipeline(pipeline)
    mod = tvm.tirx.transform.BindTarget(target.with_host(target))(tvm.IRModule({"main": before.with_attr("global_symbol", "main")}))
    return finalize_host()(lower(mod)).script()


def test_only_the_large_buffer_is_left_a_heap_workspace():
    assert _lowered_host("default").count("TVMBackendAllocWorkspace") == 3  # TVM: "local" always, else from 1 KB
    assert _lowered_host(CPU_TIR_PIPELINE).count("TVMBackendAllocWorkspace") == 1


def test_the_cpu_pipeline_computes_the_same():
    target = make_target("cpu")
    assert tir_pipeline(target) == CPU_TIR_PIPELINE and tir_pipeline(make_target("cuda")) == "default"
    a = np.random.default_rng(0).standard_normal(SMALL).astype("float32")
    (out,) = call_kernel(build_kernel(before.with_attr("global_symbol", "main"), target), [a], [((SMALL,), "float32")])
    np.testing.assert_allclose(out, 4 * a + 1, rtol=1e-6)
