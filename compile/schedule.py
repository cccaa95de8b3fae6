"""The CPU schedule pass: every fused PrimFunc of a Relax module scheduled by its kernel family.

TVM 0.27's default CPU lowering leaves every fused PrimFunc as the serial, scalar loop nest that
LegalizeOps wrote, and `tvm.s_tir.dlight.cpu` has no matmul rule, so a whole BERT runs ~100x
slower than PyTorch. `cpu_schedule_pass` schedules each PrimFunc with the first rule that applies:

0. the bf16 and int8 kernels of `--precision bf16` / `int8` (kernels/bf16.py, kernels/int8.py), on
   AMX tiles where the target has them (kernels/amx.py);
1. `dense.schedule_matmul`: matmul / dense with a transposed weight / batch matmul, with injective
   epilogues (bias, GELU, residual add, scaling) and static or symbolic M, as a register-blocked
   micro-kernel (see its docstring);
2. `row_quantize.schedule_row_quantize`: the int8 row quantizer's own kernel in place of its TE form;
   `rows.schedule_rows` for other row kernels (softmax, layer norm): one
   parallel loop over rows, reductions in vector lanes; then dlight's CPU `Reduction` rule for
   row kernels of a width the lanes do not divide;
3. `fallback.schedule_fallback`: inline injective blocks, then per remaining block fuse the outer loops
   into one parallel loop and vectorise the innermost loop where that is legal.

A PrimFunc no rule recognises (or on which every rule raises) is left untouched, so the pass is
always safe to add. A rule that raises is a bug, not a decline (a rule that does not apply returns
None): it is logged as a warning, since the later rules that take the kernel over run it slower.
"""

from __future__ import annotations

import logging
from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.s_tir.dlight.cpu import Reduction
from tvm.target import Target

from .capabilities import Capabilities, KernelConfig
from .kernels import bf16, int8
from .kernels.common import SCHEDULED_ATTR
from .kernels.dense import schedule_matmul
from .kernels.fallback import schedule_fallback
from .kernels.fast_math import fast_math
from .kernels.launch import parallel_when_it_pays
from .kernels.row_quantize import schedule_row_quantize
from .kernels.rows import schedule_rows
from .passes.fuse_attention import fuse_attention

log = logging.getLogger(__name__)


def schedule_func(func: tirx.PrimFunc, target: Target, name: str = "a kernel") -> tirx.PrimFunc | None:
    """The scheduled `func` (called `name` in the warnings), or None when no rule recognises it (or
    every rule fails on it)."""
    capabilities = Capabilities.of(target)
    lanes = capabilities.lanes
    func = fast_math(func)
    rules = (
        ("bf16 matmul", lambda f: bf16.schedule_bf16_matmul(f, capabilities.amx)),
        ("int8 matmul", lambda f: int8.schedule_int8_matmul(f, capabilities.int8_kernel, capabilities.amx)),
        ("matmul", lambda f: schedule_matmul(f, lanes)),
        ("row quantize", lambda f: schedule_row_quantize(f, lanes)),
        ("rows", lambda f: schedule_rows(f, lanes)),
        ("dlight reduction", lambda f: Reduction().apply(f, target, False)),
        ("fallback", lambda f: schedule_fallback(f, lanes)),
    )
    for rule_name, rule in rules:
        try:
            sch = rule(func)
        except Exception as error:  # noqa: BLE001 - the next rule schedules it, slower: say so
            last_line = (str(error).strip().splitlines() or [""])[-1]  # TVM's errors end with the message
            log.warning("%s: the %s schedule failed (%s: %s); the next rules try it", name, rule_name,
                        type(error).__name__, last_line)
            sch = None
        if sch is not None:
            return parallel_when_it_pays(sch.mod["main"]).with_attr(SCHEDULED_ATTR, True)
    return None


def cpu_schedule_pass(target: Target) -> tvm.ir.transform.Pass:
    """Module pass: schedule every PrimFunc a rule recognises, leave the others untouched.

    Insert it after LegalizeOps + AnnotateTIROpPattern + FoldConstant + FuseOps + FuseTIR and
    before the dataflow-lowering passes, as `cpu_pipeline` does.
    """

    @tvm.transform.module_pass(opt_level=0, name="CPUSchedule")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return schedule_unscheduled(mod, lambda name, func: schedule_func(func, target, name))

    return _pass


def schedule_unscheduled(mod: tvm.IRModule,
                         schedule: Callable[[str, tirx.PrimFunc], tirx.PrimFunc | None]) -> tvm.IRModule:
    """`mod` with every PrimFunc not yet scheduled replaced by `schedule(name, func)`, where that is
    not None; the caller's module stays as it was."""
    updates = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and not func.attrs.get(SCHEDULED_ATTR, False):
            scheduled = schedule(gvar.name_hint, func)
            if scheduled is not None:
                updates[gvar] = scheduled
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod.update_func(gvar, func)
    return mod


def apply_tuned(database, target: Target) -> tvm.ir.transform.Pass:
    """Module pass: every PrimFunc `database` (a MetaSchedule one, compile/tuning.py) holds a kept
    record for gets that schedule, and is marked scheduled so that the CPU schedule pass leaves it;
    the others pass unchanged."""

    def tuned(_name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
        sch = database.query_schedule(tuning_workload(fast_math(func)), target, workload_name="main")
        return None if sch is None else sch.mod["main"].with_attr(SCHEDULED_ATTR, True)

    @tvm.transform.module_pass(opt_level=0, name="ApplyTunedSchedules")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return schedule_unscheduled(mod, tuned)

    return _pass


def tuning_workload(func: tirx.PrimFunc) -> tvm.IRModule:
    """`func` as MetaSchedule keys it in a database (tune_tir's own normalisation)."""
    if "global_symbol" not in (func.attrs or {}):
        func = func.with_attr("global_symbol", "main")
    return tvm.IRModule({"main": func.with_attr("tirx.noalias", True)})


def fusion_passes(target: Target, kernels: KernelConfig) -> list[tvm.ir.transform.Pass]:
    """`cpu_pipeline` up to the schedule pass: its fused PrimFuncs are what is scheduled (and tuned)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    return (([fuse_attention(kernels)] if kernels.fused_attention else [])
            + cpu.library_dispatch_passes(target)
            + cpu.legalize_passes(target)
            + [relax.transform.RewriteDataflowReshape()])


def cpu_pipeline(target: Target, kernels: KernelConfig | None = None, tuned=None) -> tvm.ir.transform.Pass:
    """TVM's default CPU Relax pipeline (relax/backend/cpu_generic) with our two passes in it:
    `fuse_attention` first (attention cores onto the fused kernel, while the ops are high-level, as
    `kernels` says: by default the target's, its products in fp32) and `cpu_schedule_pass` after fusion.
    Reshape kernels become `vm.builtin.reshape` views before the schedule pass: once scheduled,
    TVM's own rewrite (later in the pipeline) no longer recognises them, and each would stay a copy.
    `tuned` (a MetaSchedule database, compile/tuning.py) schedules the kernels it holds records for
    (`apply_tuned`).

    A drop-in for `relax.get_default_pipeline(target)` on an llvm target, lowered as the libraries
    are with compile/lowering.py's TIR pipeline (the dense kernel relies on it to keep its
    accumulator in registers): `tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target),
    tir_pipeline=tir_pipeline(target))`.
    """
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    passes = (
        fusion_passes(target, kernels or KernelConfig.of(target))
        + ([apply_tuned(tuned, target)] if tuned is not None else [])
        + [cpu_schedule_pass(target)]
        + cpu.dataflow_lower_passes(target)
        + cpu.finalize_passes(target)
    )

    @tvm.transform.module_pass(opt_level=0, name="CPUPipelineWithSchedule")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
