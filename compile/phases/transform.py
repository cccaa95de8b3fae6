"""The graph phase: per strategy, one named sequence of passes from the imported module to the lifted
one, its weights computed once, and the manifest's record of it (taken by a pass instrument)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from artifact.hashing import file_sha256
from artifact.manifest import PassCounts, StrategyPasses, WeightsEntry

from ..config import CompileConfig
from ..kernels import bf16, int8
from ..capabilities import Capabilities, KernelConfig
from ..opcount import PassRecorder, kernel_calls
from ..passes.bf16 import LinearsToBF16
from ..passes.fuse_attention import fuse_attention_in
from ..passes.lift import LiftedModel, transform_weights
from ..passes.packing import PackLinearWeights
from ..passes.precision import precision_passes
from ..passes.quantize import QuantizeLinearsInt8
from ..passes.smooth import PARAM_PREFIX, SmoothLinears
from ..passes.sparsity import SparseWeights, SparsifyLinears
from ..passes.strategy import strategy_passes
from ..plan import Arithmetic, Plan
from ..sparse_choice import SparseChoice, measured_times

FUSED_AT_BUILD = "FuseAttention"  # the CPU pass each library's build runs (schedule.cpu_pipeline), recorded last
LINEAR_KERNELS = {"int8": int8.MATMUL, "bf16": bf16.MATMUL}  # the kernels a precision puts linears on


def linear_passes(arithmetic: Arithmetic, target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The linears on the chosen precision's kernels, their weights in the CPU kernel's panels."""
    passes = []
    if arithmetic.precision == "int8":  # int8 panels, smoothed; what the plan keeps out: bf16 or fp32
        plan_int8 = arithmetic.int8
        passes += [SmoothLinears(plan_int8.scales),
                   QuantizeLinearsInt8(target, frozenset(plan_int8.fallback_keys),
                                       keep_in_bf16=plan_int8.fallback_precision == "bf16")]
    elif arithmetic.precision == "bf16":  # bf16 panels; what is left (if any) stays fp32
        passes.append(LinearsToBF16())
    if target.kind.name == "llvm":  # weights in the CPU kernel's panel layout, packed at load
        passes.append(PackLinearWeights(Capabilities.of(target).lanes))
    return passes


def compile_sequence(strategy: str, target: tvm.target.Target, dtype: str, arithmetic: Arithmetic,
                     sparsify: tvm.transform.Pass | None = None) -> tuple[list[tvm.transform.Pass], int]:
    """(A strategy's passes, in order, how many of them rewrite the graph): the strategy's combining,
    sparse kernels, CUDA's dtype; the linears on the precision's kernels; then LiftTransformParams
    (weight-only work moved out of `main`, run once by `transform_weights`)."""
    graph = [*strategy_passes(strategy), *([sparsify] if sparsify is not None else []), *precision_passes(dtype)]
    return [*graph, *linear_passes(arithmetic, target), relax.transform.LiftTransformParams()], len(graph)


def sparse_choice(config: CompileConfig, plan: Plan, arithmetic: Arithmetic) -> SparseChoice:
    """How the sparse pass decides each weight: timed here against the dense kernel of the weight's precision
    (the int8 plan's kept-out linears: the precision they are kept in) where the target runs here."""
    timed = config.sparse_choice == "timed" and plan.runs_here and config.target == "cpu"
    kept = arithmetic.int8.fallback_keys if arithmetic.int8 is not None else set()

    def precision_of(name: str) -> str:
        key = name[len(PARAM_PREFIX):-len("_weight")] if name.startswith(PARAM_PREFIX) else name
        return arithmetic.int8.fallback_precision if key in kept else arithmetic.precision

    return SparseChoice(config.block_shape(), config.sparse_max_density, plan.target, precision_of,
                        measured_times(plan.target, linear_passes) if timed else None)


@dataclass(frozen=True)
class Variants:
    """The lifted model per strategy, and what the passes did: the manifest's record per strategy,
    the op counts before them, how many linears went on the precision's kernels, the sparse report."""

    models: dict[str, LiftedModel]
    passes: dict[str, StrategyPasses]
    before: PassCounts
    linears: int
    sparsity: dict | None


def transform(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported, strategies: tuple[str, ...],
              sparse: bool = False) -> Variants:
    """Per strategy: its sequence run under a `PassRecorder` on the imported module, then the lifted
    weights computed (`sparse`: the sparse kernels' pass runs too, and reports)."""
    models, records, recorder, weights = {}, {}, None, None
    choice = sparse_choice(config, plan, arithmetic) if sparse else None
    for strategy in strategies:
        weights = SparseWeights(list(imported.params)) if sparse else None
        passes, graph = compile_sequence(strategy, plan.target, config.dtype, arithmetic,
                                         SparsifyLinears(weights, choice) if sparse else None)
        recorder = PassRecorder()
        with tvm.transform.PassContext(instruments=[recorder]):
            lifted = tvm.transform.Sequential(passes, name=f"compile_{strategy}")(imported.mod)
        models[strategy] = transform_weights(lifted, weights.params if sparse else imported.params)
        records[strategy] = _strategy_record(recorder, graph, models[strategy], config, plan)
    kernel = LINEAR_KERNELS.get(arithmetic.precision)
    linears = kernel_calls(models[strategies[-1]].mod, kernel) if kernel else 0
    return Variants(models, records, PassCounts(**recorder.before), linears, weights.report if sparse else None)


def _strategy_record(recorder: PassRecorder, graph: int, lifted: LiftedModel, config: CompileConfig,
                     plan: Plan) -> StrategyPasses:
    """The manifest's record of one strategy's sequence: its passes as run, the op counts after the
    graph rewrites and after lifting, and (CPU) the attention cores each library's build fuses."""
    names, fused = recorder.names(), None
    if config.target == "cpu":
        names.append(FUSED_AT_BUILD)
        fused = fuse_attention_in(lifted.mod, KernelConfig(plan.capabilities))[1]
    return StrategyPasses(pipeline=names, after=PassCounts(**recorder.after[graph - 1][1]),
                          main_after_lift=PassCounts(**recorder.after[-1][1]), attention_fused=fused)


def save_weights(staging: Path, strategy: str, variant: LiftedModel) -> WeightsEntry:
    """One safetensors file per strategy; keys are prefixed with the parameter's position,
    because lifted parameter names (lv12, ...) are not unique."""
    from safetensors.numpy import save_file

    name = f"weights-{strategy}.safetensors"
    keys = [f"{index:04d}.{weight_name}" for index, weight_name in enumerate(variant.weight_names)]
    save_file(dict(zip(keys, (np.ascontiguousarray(w) for w in variant.weights))), str(staging / name))
    return WeightsEntry(file=name, sha256=file_sha256(staging / name), names=keys)
