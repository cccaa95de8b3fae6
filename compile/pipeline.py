"""The compile pipeline: checkpoint -> Relax -> passes -> per-bucket + generic libraries -> artifact.

`plan_compile` (compile/plan.py) decides and refuses what it can before anything is loaded; then
the phases of `PHASES` run in order (compile/phases/), each taking what it needs and returning new
values. `python -m compile.pipeline --list` lists the phases and each strategy's passes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from artifact.manifest import Manifest, PrecisionEntry

from .build import make_target
from .config import CompileConfig
from .importer import export_and_import
from .int8_plan import Int8Plan
from .passes.strategy import STRATEGIES
from .phases.decisions import check_int8_plan, choose_attention, choose_precision, plan_int8_linears
from .phases.libraries import BuildRecord, LibraryBuilder, build_libraries
from .phases.load import TOKENIZER_DIR, copy_tokenizer, load_model
from .phases.manifest import assemble_manifest
from .phases.transform import FUSED_AT_BUILD, Variants, compile_sequence, save_weights, transform
from .plan import Arithmetic, Plan, plan_compile
from .progress import Progress
from .staging import atomic_directory


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
    Phase("import", "torch.export, then the Relax import with dynamic batch and seq"),
    Phase("attention", "attention's products beside bf16 / int8 linears", lambda plan: plan.chooses_attention),
    Phase("int8-plan", "int8: smoothing, sensitivity and fallback, simulated on the shipped sentences",
          lambda plan: plan.plans_int8),
    Phase("int8-check", "int8: the plan's generic library against the fp32 model", lambda plan: plan.checks_int8),
    Phase("precision", "precision auto: every candidate's generic library measured and timed",
          lambda plan: plan.requested_precision == "auto"),
    Phase("passes", "per strategy, its pass sequence; weights lifted"),
    Phase("tokenizer", "copy the tokenizer"),
    Phase("libraries", "each bucket's library and the generic one, per strategy; chosen, validated, timed",
          steps=lambda plan: 2 * (len(plan.buckets) + 1)),
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
    with atomic_directory(config.out) as staging:
        with progress.step(f"load {plan.info.path.name} ({config.task})"):
            wrapper, reference, sparsity = load_model(config, plan.info)
        with progress.step("torch.export + Relax import (dynamic batch, seq)"):
            imported = export_and_import(wrapper, config.max_batch, plan.info.max_seq,
                                         int(plan.info.config["vocab_size"]), config.layout)
        arithmetic, auto_entry = decide_arithmetic(config, plan, imported, reference, staging, progress)
        with progress.step(f"passes for strategy {', '.join(plan.strategies)}; lift weights"):
            variants = transform(config, plan, arithmetic, imported, plan.strategies, sparse=sparsity is not None)
        with progress.step("copy tokenizer"):
            copy_tokenizer(plan.info, staging / TOKENIZER_DIR)
        manifest, records = ship(config, plan, arithmetic, variants, reference, staging, sparsity, auto_entry, progress)
        manifest.write(staging)
    return manifest, records


def decide_arithmetic(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module, staging: Path,
                      progress: Progress) -> tuple[Arithmetic, PrecisionEntry | None]:
    """The decisions that need the model: attention's products, the int8 plan (checked), auto's
    precision. Returns what the libraries compute in, and auto's record of its choice."""
    arithmetic, auto_entry = Arithmetic(precision=config.precision), None
    if plan.chooses_attention:
        with progress.step(f"attention's products beside bf16 / int8 linears ({config.attention_products})"):
            arithmetic = arithmetic.but(attention=choose_attention(config, plan))
    if plan.plans_int8:
        with progress.step("int8: smoothing, sensitivity and fallback, simulated on the shipped sentences"):
            arithmetic = plan_int8_linears(config, plan, arithmetic, imported, reference, progress)
        if plan.requested_precision == "int8":
            arithmetic = check_int8_plan(config, plan, arithmetic, imported, reference, staging, progress)
    if plan.requested_precision == "auto":
        with progress.step(f"precision auto: measure {', '.join(plan.precision_candidates)}"):
            arithmetic, auto_entry = choose_precision(config, plan, arithmetic, imported, reference, staging,
                                                      progress)
    return arithmetic, auto_entry


def ship(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, variants: Variants, reference: torch.nn.Module,
         staging: Path, sparsity: dict | None, auto_entry: PrecisionEntry | None,
         progress: Progress) -> tuple[Manifest, list[BuildRecord]]:
    """The weights and libraries of the chosen arithmetic built, validated and timed, the strategies
    not in use dropped, and the manifest that records them."""
    (staging / "lib").mkdir()
    weight_files = {strategy: save_weights(staging, strategy, model) for strategy, model in variants.models.items()}
    builder = LibraryBuilder(config, plan, arithmetic, staging, variants.models, weight_files, reference)
    records, shared_strategy = build_libraries(builder, config, plan, progress)
    with progress.step(f"{arithmetic.precision} accuracy against the fp32 model on the shipped sentences"):
        precision_entry, quantization = builder.precision_report(records[-1], variants.linears, auto_entry)
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
