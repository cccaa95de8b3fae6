"""The decisions that need the loaded model: attention's products, the int8 plan (checked against its
own library), and `--precision auto`'s choice. Each returns a new `Arithmetic`; none changes the plan."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from artifact.manifest import PrecisionCandidate, PrecisionEntry

from .. import attention_products, precision
from ..config import CompileConfig
from ..errors import ValidationError
from ..int8_plan import Int8Plan, plan_for
from ..plan import Arithmetic, Plan
from ..precision import Measured
from ..progress import Progress
from ..timing import interleaved_medians, use_all_cores
from .libraries import LibraryBuilder, Workload
from .transform import save_weights, transform

# (batch, seq) `--precision auto` times each candidate at: one short query, one passage, a batch.
AUTO_PRECISION_SHAPES = ((1, 16), (1, 128), (8, 128))
REPLANS = 2  # times an int8 plan is admitted again after its library missed what the plan kept
log = logging.getLogger(__name__)


def choose_attention(config: CompileConfig, plan: Plan) -> attention_products.AttentionChoice:
    """The arithmetic of attention's products beside bf16 / int8 linears: timed on this CPU where
    the libraries run here and are validated (as the strategies are), else as asked or the rule."""
    if plan.measures:
        use_all_cores()
    choice = attention_products.choose(plan.target, attention_products.Geometry.of(plan.info),
                                       config.attention_products, plan.measures)
    log.info("attention products: beside bf16 linears %s; beside int8 linears %s", choice.reasons["bf16"],
             choice.reasons["int8"])
    return choice


def plan_int8_linears(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                      reference: torch.nn.Module, progress: Progress) -> Arithmetic:
    """`arithmetic` with the int8 plan, simulated with attention's products as chosen. int8 products
    stay only where every linear group keeps its int8 beside them (a kept linear costs more than they
    save); else fp32 products, and the plan keeps out what the gate needs."""
    attention = arithmetic.attention

    def planned(products: str, keep_out: bool = True) -> Int8Plan | None:
        return plan_for(imported.mod, plan.target, reference, plan.info.tokenizer_file, plan.info.max_seq,
                        config.model_task, config.min_cosine, progress.note, bf16_pays=attention.bf16_pays,
                        attention_products=products, keep_out=keep_out)

    if attention.for_precision("int8") == "int8":
        int8 = planned("int8", keep_out=False)
        if int8 is not None:
            return arithmetic.but(int8=int8)
        attention = attention.without_int8()
        log.info("attention products: %s", attention.reasons["int8"])
        progress.note(attention.reasons["int8"])
    return arithmetic.but(attention=attention, int8=planned(attention.for_precision("int8")))


def check_int8_plan(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                    reference: torch.nn.Module, staging: Path, progress: Progress) -> Arithmetic:
    """`--precision int8`: fail before anything is built where the plan keeps no linear in int8;
    where its library can be measured here (`plan.checks_int8`), build the plan's generic library
    first and measure it, planned again where it misses (`checked_int8_candidate`), so that a plan
    the library cannot keep fails (or is mended) before every bucket is built."""
    refused = arithmetic.int8.refusal(config.min_cosine)
    if refused:
        raise ValidationError(f"--precision int8: {refused}; use --precision auto, bf16 or fp32")
    if not plan.checks_int8:
        return arithmetic
    with progress.step("int8: the plan's generic library against the fp32 model"):
        _, arithmetic, accuracy = checked_int8_candidate(config, plan, arithmetic, imported, reference,
                                                         staging / "int8-plan",
                                                         [Workload.full(1, min(16, plan.info.max_seq))], progress)
        shutil.rmtree(staging / "int8-plan")
    precision.refuse_missed_gate("int8", accuracy, config.min_cosine)
    return arithmetic


def build_candidate(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                    reference: torch.nn.Module, directory: Path,
                    workloads: list[Workload]) -> tuple[LibraryBuilder, str, dict]:
    """`arithmetic` built as a generic library in `directory`, in the plan's candidate strategy: (its
    builder, the library, its accuracy against the fp32 model on the shipped sentences)."""
    strategy = plan.candidate_strategy
    (directory / "lib").mkdir(parents=True)
    variants = transform(config, plan, arithmetic, imported, (strategy,)).models
    weights = {strategy: save_weights(directory, strategy, variants[strategy])}
    builder = LibraryBuilder(config, plan, arithmetic, directory, variants, weights, reference)
    library = builder.build("generic", lambda m: m, workloads, plan.generic_shapes, static=False).libraries[strategy]
    return builder, library, builder.agreement(library, strategy)


def checked_int8_candidate(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                           reference: torch.nn.Module, directory: Path, workloads: list[Workload],
                           progress: Progress) -> tuple[LibraryBuilder, Arithmetic, dict]:
    """The int8 candidate, built and measured as `build_candidate`. Where it misses the gate (or
    --min-cosine) that its plan kept in simulation, the simulation was off by more than the plan's
    margin: the plan is admitted again with the margin that library showed it needs
    (`Int8Plan.replanned`) and built again, up to REPLANS times. Returns (the last library's builder
    and name, the arithmetic with the last plan built, its accuracy)."""
    arithmetic = arithmetic.but(precision="int8")
    builder, library, accuracy = build_candidate(config, plan, arithmetic, imported, reference,
                                                 directory / "plan-0", workloads)
    for attempt in range(1, REPLANS + 1):
        if not precision.accuracy_failures("int8", accuracy, config.min_cosine):
            break
        replanned = arithmetic.int8.replanned(accuracy)
        if replanned is None or replanned.refusal(config.min_cosine):
            break
        line = (f"int8: its library reached least cosine {accuracy['cosine_min']:.5f} where the plan simulated "
                f"{arithmetic.int8.simulated['cosine_min']:.5f}; planned again with {replanned.margin:.0%} of the "
                f"loss to spare: {len(replanned.fallback)}/{replanned.units} linear groups kept out")
        log.info(line)
        progress.note(line)
        arithmetic = arithmetic.but(int8=replanned)
        builder, library, accuracy = build_candidate(config, plan, arithmetic, imported, reference,
                                                     directory / f"plan-{attempt}", workloads)
    return (builder, library), arithmetic, accuracy


def unmeasured_precision(plan: Plan) -> str | None:
    """Why `auto` ships fp32 without measuring anything, or None where it measures its candidates."""
    if len(plan.precision_candidates) == 1:
        return "fp32: the only precision this target runs"
    if plan.token_outputs:
        return "fp32: token outputs have no sentence vector to measure a precision by"
    if not plan.measures:
        return "fp32: the candidates cannot be measured here (not validated, or the libraries cannot run here)"
    return None


def choose_precision(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                     reference: torch.nn.Module, staging: Path,
                     progress: Progress) -> tuple[Arithmetic, PrecisionEntry]:
    """`--precision auto`: build the generic library in every precision the target runs, measure
    each against the fp32 model on the shipped sentences, time each (interleaved, at a few shapes),
    and keep the fastest that passes its gate and `min_cosine` (compile/precision.py). Where the
    libraries cannot run here, nothing can be measured and fp32 ships. Returns the arithmetic with
    the chosen precision, and auto's record of the choice."""
    why = unmeasured_precision(plan)
    if why is not None:
        return arithmetic.but(precision="fp32"), PrecisionEntry(precision="fp32", requested="auto", reason=why)
    workloads = [Workload.full(min(b, config.max_batch), min(s, plan.info.max_seq)) for b, s in AUTO_PRECISION_SHAPES]
    measured, calls, chosen_int8 = [], {}, arithmetic
    for name in plan.precision_candidates:
        refused = arithmetic.int8.refusal(config.min_cosine) if name == "int8" else None
        if refused:  # nothing to build: every linear would stay out of int8
            measured.append(Measured(name, arithmetic.int8.simulated, {}, config.min_cosine, refused))
            continue
        directory = staging / "precision" / name
        if name == "int8":
            (builder, library), chosen_int8, accuracy = checked_int8_candidate(
                config, plan, arithmetic, imported, reference, directory, workloads, progress)
        else:
            builder, library, accuracy = build_candidate(config, plan, arithmetic.but(precision=name), imported,
                                                         reference, directory, workloads)
        measured.append(Measured(name, accuracy, {}, config.min_cosine))
        runner = builder.runner(library, plan.candidate_strategy)
        for w in workloads:
            calls[(name, f"{w.batch}x{w.seq}")] = (lambda r=runner, x=builder.inputs(w): r(*x))
    _time_candidates(measured, calls, config.strategy_repeats)
    shutil.rmtree(staging / "precision")
    chosen, reason = precision.choose(measured)
    log.info("precision auto: %s", reason)
    entry = PrecisionEntry(precision=chosen.precision, requested="auto", reason=reason, candidates=[
        PrecisionCandidate(precision=m.precision, times_ms=m.times_ms, gate_failures=m.failures, **m.accuracy)
        for m in measured])
    return chosen_int8.but(precision=chosen.precision), entry


def _time_candidates(measured: list[Measured], calls: dict, repeats: int) -> None:
    """Each candidate's median ms per shape into its `times_ms`, interleaved per shape (the same
    machine state for each)."""
    for shape in dict.fromkeys(key[1] for key in calls):
        same_shape = {name: call for (name, s), call in calls.items() if s == shape}
        stats = interleaved_medians(same_shape, repeats=repeats)
        for m in measured:
            if m.precision in stats:
                m.times_ms[shape] = round(stats[m.precision]["median_s"] * 1e3, 3)
