"""The compile pipeline: checkpoint -> Relax -> passes -> per-bucket + generic libraries -> artifact.

`plan_compile` (compile/plan.py) decides and refuses what it can before anything is loaded; then
the phases of `PHASES` run in order (compile/phases/), each taking what it needs and returning new
values. `python -m compile.pipeline --list` lists the phases and each strategy's passes.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from artifact.manifest import Manifest, PrecisionEntry, hub_snapshot

from .attention_products import StartedKernels
from .build import make_target
from .config import CompileConfig
from .importer import export_and_import
from .int8_plan import Int8Plan
from .passes.strategy import STRATEGIES
from .phases.decisions import (Candidate, check_int8_plan, choose_attention, choose_precision, plan_int8_linears,
                               start_attention_kernels, start_candidates, start_int8_calibration)
from .phases.libraries import BuildRecord, LibraryBuilder, build_libraries
from .phases.load import TOKENIZER_DIR, copy_tokenizer, load_model
from .phases.manifest import assemble_manifest
from .phases.transform import FUSED_AT_BUILD, Variants, compile_sequence, save_weights, transform
from .plan import Arithmetic, Plan, plan_compile
from .progress import Progress
from .staging import atomic_directory
from .workers import Computed, Workers


@dataclass(frozen=True)
class Phase:
    """One phase of a compile: its name, what it does, whether this compile runs it and how many
    progress steps it reports."""

    name: str
    does: str
    runs: Callable[[Plan], bool] = lambda plan: True
    steps: Callable[[Plan], int] = lambda plan: 1


PHASES = (
    Phase("load", "the checkpoint (block-pruned when asked) and its PyTorch oracle"),
    Phase("import", "torch.export, then the Relax import with dynamic batch and seq (the int8 plan's calibration "
          "in a child meanwhile)"),
    Phase("attention", "attention's products beside bf16 / int8 linears", lambda plan: plan.chooses_attention),
    Phase("int8-plan", "int8: smoothing, sensitivity and fallback, simulated on the shipped sentences",
          lambda plan: plan.plans_int8),
    Phase("int8-check", "int8: the plan's generic library against the fp32 model", lambda plan: plan.checks_int8),
    Phase("precision", "precision auto: every candidate's generic library measured and timed (those the int8 plan "
          "does not decide built while it is simulated)",
          lambda plan: plan.requested_precision == "auto", steps=lambda plan: 2 if plan.plans_int8 else 1),
    Phase("passes", "per strategy, its pass sequence; weights lifted"),
    Phase("tokenizer", "copy the tokenizer"),
    Phase("libraries", "each bucket's library and the generic one, per strategy, built in worker processes at "
          "once; then chosen, validated, timed one at a time",
          steps=lambda plan: len(plan.buckets) + 2),
    Phase("accuracy", "the generic library against the fp32 model on the shipped sentences; its embeddings' "
          "ranges (int8 / uint8 embeddings)"),
)


def progress_steps(plan: Plan) -> int:
    """The progress steps a compile of `plan` reports: its phases'."""
    return sum(phase.steps(plan) for phase in PHASES if phase.runs(plan))


def compile_model(config: CompileConfig, progress: Progress | None = None) -> tuple[Manifest, list[BuildRecord]]:
    """Compile `config.model` into an artifact directory at `config.out`, atomically."""
    plan = plan_compile(config)
    progress = progress or Progress(0, quiet=True)
    progress.set_total(progress_steps(plan))
    with atomic_directory(config.out) as staging, Workers() as workers:
        attention_kernels = start_attention_kernels(config, plan, workers, staging)
        with progress.step(f"load {model_name(plan.info.path)} ({config.task})", "load"):
            wrapper, reference, sparsity = load_model(config, plan.info)
        calibration = start_int8_calibration(config, plan, reference, workers)
        with progress.step("torch.export + Relax import (dynamic batch, seq)", "import"):
            imported = export_and_import(wrapper, config.max_batch, plan.info.max_seq,
                                         int(plan.info.config["vocab_size"]), config.layout)
        arithmetic, auto_entry, candidate = decide_arithmetic(config, plan, imported, reference, staging, progress,
                                                              workers, attention_kernels, calibration)
        if candidate is not None and (sparsity is not None or plan.strategies != (candidate.strategy,)):
            candidate = None  # its passes are not all the shipped libraries'
        with progress.step(f"passes for strategy {', '.join(plan.strategies)}; lift weights", "passes"):
            variants = candidate.variants if candidate is not None else \
                transform(config, plan, arithmetic, imported, plan.strategies, sparse=sparsity is not None)
        with progress.step("copy tokenizer", "tokenizer"):
            copy_tokenizer(plan.info, staging / TOKENIZER_DIR)
        manifest, records = ship(config, plan, arithmetic, variants, reference, staging, sparsity, auto_entry, progress,
                                 workers, candidate)
        manifest.write(staging)
    progress.summary()
    return manifest, records


def model_name(path: Path) -> str:
    """What the progress calls a checkpoint: its Hub repository where it is a Hub snapshot, else its directory."""
    snapshot = hub_snapshot(path)
    return f"{snapshot[0]} at commit {snapshot[1][:12]}" if snapshot else path.name


def decide_arithmetic(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module, staging: Path,
                      progress: Progress, workers: Workers, attention_kernels: StartedKernels | None,
                      calibration: Computed | None) -> tuple[Arithmetic, PrecisionEntry | None, Candidate | None]:
    """The decisions that need the model: attention's products (`attention_kernels` built while it
    loaded), the int8 plan (checked; `calibration` taken while the model was exported), auto's precision. Returns what the libraries compute in, auto's
    record of its choice, and the generic library already built and measured in that arithmetic (None:
    none). The candidates the int8 plan does not decide are built while it is simulated."""
    arithmetic, auto_entry, candidate = Arithmetic(precision=config.precision), None, None
    if plan.chooses_attention:
        with progress.step(f"attention's products beside bf16 / int8 linears ({config.attention_products})",
                           "attention"):
            arithmetic = arithmetic.but(attention=choose_attention(config, plan, attention_kernels))
        shutil.rmtree(staging / "attention", ignore_errors=True)
    started = {}
    if plan.requested_precision == "auto" and plan.plans_int8:
        with progress.step("precision auto: start building the candidates the int8 plan does not decide", "precision"):
            started = start_candidates(config, plan, arithmetic, imported, reference, staging, workers)
    if plan.plans_int8:
        with progress.step("int8: smoothing, sensitivity and fallback, simulated on the shipped sentences"
                           + (f" (building {', '.join(started)} meanwhile)" if started else ""), "int8-plan"):
            arithmetic = plan_int8_linears(config, plan, arithmetic, imported, reference, progress, calibration)
        if plan.requested_precision == "int8":
            arithmetic, candidate = check_int8_plan(config, plan, arithmetic, imported, reference, staging, progress,
                                                    workers)
    if plan.requested_precision == "auto":
        with progress.step(f"precision auto: measure {', '.join(plan.precision_candidates)}", "precision"):
            arithmetic, auto_entry, candidate = choose_precision(config, plan, arithmetic, imported, reference,
                                                                 staging, progress, workers, started)
    return arithmetic, auto_entry, candidate


def ship(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, variants: Variants, reference: torch.nn.Module,
         staging: Path, sparsity: dict | None, auto_entry: PrecisionEntry | None, progress: Progress,
         workers: Workers, candidate: Candidate | None) -> tuple[Manifest, list[BuildRecord]]:
    """The weights and libraries of the chosen arithmetic built (the generic one is `candidate`'s where
    given), validated and timed, the strategies not in use dropped, and the manifest that records them."""
    (staging / "lib").mkdir()
    weight_files = {strategy: save_weights(staging, strategy, model) for strategy, model in variants.models.items()}
    builder = LibraryBuilder(config, plan, arithmetic, staging, variants.models, weight_files, reference, workers)
    if candidate is not None:
        builder.reuse(candidate.directory, candidate.library, candidate.strategy, candidate.latency_ms)
    for scratch in ("precision", "int8-plan"):  # the candidates not shipped
        shutil.rmtree(staging / scratch, ignore_errors=True)
    records, shared_strategy = build_libraries(builder, config, plan, progress)
    with progress.step(f"{arithmetic.precision} accuracy against the fp32 model on the shipped sentences",
                       "accuracy"):
        precision_entry, quantization = builder.precision_report(
            records[-1], variants.linears, auto_entry, candidate.accuracy if candidate is not None else None)
        embedding_ranges = builder.embedding_ranges(records[-1])
    used = {r.strategy for r in records}
    for strategy in set(weight_files) - used:
        (staging / weight_files.pop(strategy).file).unlink()
    manifest = assemble_manifest(config, plan, builder, variants, records, weight_files, shared_strategy, sparsity,
                                 precision_entry, quantization, embedding_ranges)
    return manifest, records


def describe() -> str:
    """The phases of a compile and, per strategy, the passes of its sequence for a CPU target in each
    precision (CUDA adds ToMixedPrecision for float16; --sparsity, SparsifyLinears after combining)."""
    lines = ["phases:"] + [f"  {phase.name:<11} {phase.does}" for phase in PHASES] + ["passes (CPU):"]
    cpu = make_target("cpu")
    empty_plan = Int8Plan(alpha=0.0, scales={}, fallback=[], fallback_keys=set(), simulated={})
    for precision in ("fp32", "bf16", "int8"):
        for strategy in STRATEGIES:
            passes, _ = compile_sequence(strategy, cpu, "float32", Arithmetic(precision, int8=empty_plan))
            names = [p.info.name for p in passes] + [f"{FUSED_AT_BUILD} (in each library's build)"]
            lines.append(f"  {precision} {strategy:<8} {' -> '.join(names)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m compile.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the phases and each strategy's passes")
    if parser.parse_args(argv).list:
        print(describe())
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
