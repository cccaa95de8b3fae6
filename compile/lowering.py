"""The TIR lowering of CPU libraries: TVM's default pipeline, plus small scratch buffers on the stack.

TVM's LowerTVMBuiltin gives every constant-size "global" allocation of 1 KB or more, and every
"local" one of any size, a heap workspace (`TVMBackendAllocWorkspace`). The matmul's register
accumulator is 8 x 32 fp32 on AVX-512, exactly 1 KB: as a heap pointer LLVM must assume it may alias other memory, and once the k loop holds any
call (the weight prefetch, kernels/dense.py) it stores every accumulator register back to memory
on every step. As a stack alloca they are promoted to registers. `StackAllocateSmallBuffers` marks
such allocations (up to `STACK_BUFFER_BYTES`) to stay allocas, which LowerTVMBuiltin then leaves.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.target import Target
from tvm.tirx.compilation_pipeline import register_tir_pipeline

CPU_TIR_PIPELINE = "bert_cpu"
STACK_BUFFER_BYTES = 4096  # TVM's own limit is 1024; a worker thread's stack is megabytes
KEEP_ON_STACK = "disable_lower_builtin"  # LowerTVMBuiltin's annotation for "leave this allocation be"


def _constant_bytes(buffer: tirx.Buffer) -> int | None:
    size = 1
    for dim in buffer.shape:
        if not isinstance(dim, tirx.IntImm):
            return None
        size *= int(dim)
    dtype = tvm.runtime.DataType(buffer.dtype)
    return size * dtype.bits * dtype.lanes // 8


@tirx.transform.prim_func_pass(opt_level=0, name="StackAllocateSmallBuffers")
def stack_allocate_small_buffers(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Mark each constant-size "global" or "local" allocation of at most `STACK_BUFFER_BYTES` to stay
    a stack alloca."""

    def mark(node: tirx.AllocBuffer):
        nbytes = _constant_bytes(node.buffer)
        if node.buffer.scope() not in ("global", "local") or nbytes is None or nbytes > STACK_BUFFER_BYTES:
            return node
        return tirx.AllocBuffer(node.buffer, {**node.annotations, KEEP_ON_STACK: tirx.IntImm("bool", 1)})

    return tvm_ffi.structural_map(func, [(tirx.AllocBuffer, mark)])


def _cpu_tir_pipeline():
    lower, finalize_host, finalize_device = default_s_tir_pipeline()
    return tvm.transform.Sequential([lower, stack_allocate_small_buffers]), finalize_host, finalize_device


register_tir_pipeline(CPU_TIR_PIPELINE, _cpu_tir_pipeline)


def tir_pipeline(target: Target) -> str:
    """The TIR pipeline name to build `target`'s libraries with (`tvm.compile(..., tir_pipeline=)`)."""
    return CPU_TIR_PIPELINE if target.kind.name == "llvm" else "default"
