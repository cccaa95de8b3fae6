"""The decisions that need the loaded model: attention's products, the int8 plan (checked against its
own library), and `--precision auto`'s choice. Each returns a new `Arithmetic`; none changes the plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from artifact.manifest import PrecisionCandidate, PrecisionEntry

from .. import attention_products, precision
from ..config import CompileConfig
from ..errors import ValidationError
from ..int8_plan import Int8Plan, plan_for, simulation_for, start_calibration
from ..plan import Arithmetic, Plan
from ..precision import Measured
from ..progress import Progress
from ..timing import budgeted_medians_ms, use_all_cores
from ..workers import Computed, Workers
from .libraries import LibraryBuilder, Workload, remember_reference_outputs, unshaped
from .transform import Variants, transform

# (batch, seq) `--precision auto` times each candidate at: one short query, one passage, a batch.
AUTO_PRECISION_SHAPES = ((1, 16), (1, 128), (8, 128))
REPLANS = 2  # times an int8 plan is admitted again after its library missed what the plan kept
log = logging.getLogger(__name__)


def start_attention_kernels(config: CompileConfig, plan: Plan, workers: Workers,
                            staging: Path) -> attention_products.StartedKernels | None:
    """The attention kernels `choose_attention` times, their builds started before the model is loaded
    (its load and import leave a core idle); None where nothing will be timed."""
    if not (plan.chooses_attention and plan.measures):
        return None
    return attention_products.start_kernels(plan.target, attention_products.Geometry.of(plan.info),
                                            config.attention_products, workers, staging / "attention")


def choose_attention(config: CompileConfig, plan: Plan,
                     kernels: attention_products.StartedKernels | None) -> attention_products.AttentionChoice:
    """The arithmetic of attention's products beside bf16 / int8 linears: timed on this CPU where
    the libraries run here and are validated (as the strategies are; `kernels` built already), else
    as asked or the rule."""
    if plan.measures:
        use_all_cores()
    choice = attention_products.choose(plan.target, attention_products.Geometry.of(plan.info),
                                       config.attention_products, plan.measures, kernels)
    log.info("attention products: beside bf16 linears %s; beside int8 linears %s", choice.reasons["bf16"],
             choice.reasons["int8"])
    return choice


def start_int8_calibration(config: CompileConfig, plan: Plan, reference: torch.nn.Module,
                           workers: Workers) -> Computed | None:
    """The int8 plan's calibration, started beside the export (None: no plan)."""
    return start_calibration(workers, reference, plan.info, config.model_task) if plan.plans_int8 else None


def plan_int8_linears(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                      reference: torch.nn.Module, progress: Progress, calibration: Computed | None = None
                      ) -> Arithmetic:
    """`arithmetic` with the int8 plan, simulated with attention's products as chosen. int8 products
    stay only where every linear group keeps its int8 beside them (a kept linear costs more than they
    save); else the products bf16 linears have, and the plan keeps out what the gate needs. Where int8
    products were timed faster, the plan beside the others comes first: where it keeps a linear out,
    int8 products, which round more, cannot keep every one in, and their passes are not run; where it
    keeps none, int8 products are simulated at its smoothing only (the smoothing balances the
    linears' rounding, not attention's: a 12 x 768 BERT's sweep chose the same with either)."""
    attention = arithmetic.attention
    taken = calibration.result() if calibration is not None else None
    if taken is not None:  # its pass over the accuracy rows is every candidate library's reference too
        remember_reference_outputs(reference, taken.rows, taken.outputs)
    simulation = simulation_for(imported.mod, plan.target, reference, plan.info, config.model_task,
                                bf16_pays=attention.bf16_pays, taken=taken)

    def planned(products: str, **options) -> Int8Plan | None:
        return plan_for(simulation, config.min_cosine, progress.note, attention_products=products, **options)

    if attention.for_precision("int8") != "int8":
        return arithmetic.but(int8=planned(attention.for_precision("int8")))
    beside_others = planned(attention.without_int8().for_precision("int8"))
    if not beside_others.fallback:
        int8 = planned("int8", keep_out=False, alphas=(beside_others.alpha,))
        if int8 is not None:
            return arithmetic.but(int8=int8)
    attention = attention.without_int8(measured=not beside_others.fallback)
    log.info("attention products: %s", attention.reasons["int8"])
    progress.note(attention.reasons["int8"])
    return arithmetic.but(attention=attention, int8=beside_others)


@dataclass
class Candidate:
    """A generic library of one arithmetic, built in the plan's candidate strategy in `directory` (its
    build started in the workers: `measured` waits for it): what auto measures a precision by, and
    what the int8 plan is checked with. The chosen one ships as the artifact's generic library
    (`LibraryBuilder.reuse`), its passes and weights too."""

    arithmetic: Arithmetic
    builder: LibraryBuilder
    variants: Variants  # its weights are written when it ships (measured from memory until then)
    directory: Path
    library: str
    strategy: str
    accuracy: dict | None = None  # against the fp32 model on `accuracy_rows`, once measured
    latency_ms: dict[Workload, float] = field(default_factory=dict)  # median ms, once timed

    def measured(self) -> dict:
        if self.accuracy is None:
            self.builder.workers.wait(str(self.directory / self.library))
            self.accuracy = self.builder.agreement(self.library, self.strategy)
        return self.accuracy


def start_candidate(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported, reference: torch.nn.Module,
                    directory: Path, workers: Workers) -> Candidate:
    """`arithmetic`'s passes run here, and its generic library's build started in the workers."""
    strategy = plan.candidate_strategy
    (directory / "lib").mkdir(parents=True)
    variants = transform(config, plan, arithmetic, imported, (strategy,))
    builder = LibraryBuilder(config, plan, arithmetic, directory, variants.models, None, reference, workers)
    with workers.beside_the_compile():  # the int8 plan's simulation, or auto's measuring, runs beside it
        library = builder.start("generic", unshaped, [], plan.generic_shapes, static=False).libraries[strategy]
    return Candidate(arithmetic, builder, variants, directory, library, strategy)


def check_int8_plan(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                    reference: torch.nn.Module, staging: Path, progress: Progress,
                    workers: Workers) -> tuple[Arithmetic, Candidate | None]:
    """`--precision int8`: fail before anything is built where the plan keeps no linear in int8;
    where its library can be measured here (`plan.checks_int8`), build the plan's generic library
    first and measure it, planned again where it misses (`checked_int8_candidate`), so that a plan
    the library cannot keep fails (or is mended) before every bucket is built. Returns the
    arithmetic and the checked library (None: not checked)."""
    refused = arithmetic.int8.refusal(config.min_cosine)
    if refused:
        raise ValidationError(f"--precision int8: {refused}; use --precision auto, bf16 or fp32")
    if not plan.checks_int8:
        return arithmetic, None
    with progress.step("int8: the plan's generic library against the fp32 model", "int8-check"):
        candidate = checked_int8_candidate(config, plan, arithmetic, imported, reference, staging / "int8-plan",
                                           progress, workers)
    precision.refuse_missed_gate("int8", candidate.measured(), config.min_cosine)
    return candidate.arithmetic, candidate


def checked_int8_candidate(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                           reference: torch.nn.Module, directory: Path, progress: Progress,
                           workers: Workers, meanwhile: Callable[[], object] = lambda: None) -> Candidate:
    """The int8 candidate, built and measured (`start_candidate`; `meanwhile` runs while its first
    build is under way: auto's other candidates measured). Where it misses the gate (or
    --min-cosine) that its plan kept in simulation, the simulation was off by more than the plan's
    margin: the plan is admitted again with the margin that library showed it needs
    (`Int8Plan.replanned`) and built again, up to REPLANS times. Returns the last one built (its
    arithmetic holds the last plan)."""
    arithmetic = arithmetic.but(precision="int8")
    candidate = start_candidate(config, plan, arithmetic, imported, reference, directory / "plan-0", workers)
    meanwhile()
    for attempt in range(1, REPLANS + 1):
        accuracy = candidate.measured()
        if not precision.accuracy_failures("int8", accuracy, config.min_cosine):
            break
        replanned = candidate.arithmetic.int8.replanned(accuracy)
        if replanned is None or replanned.refusal(config.min_cosine):
            break
        line = (f"int8: its library reached least cosine {accuracy['cosine_min']:.5f} where the plan simulated "
                f"{candidate.arithmetic.int8.simulated['cosine_min']:.5f}; planned again with {replanned.margin:.0%} "
                f"of the loss to spare: {len(replanned.fallback)}/{replanned.units} linear groups kept out")
        log.info(line)
        progress.note(line)
        candidate = start_candidate(config, plan, arithmetic.but(int8=replanned), imported, reference,
                                    directory / f"plan-{attempt}", workers)
    candidate.measured()
    return candidate


def unmeasured_precision(plan: Plan) -> str | None:
    """Why `auto` ships fp32 without measuring anything, or None where it measures its candidates."""
    if len(plan.precision_candidates) == 1:
        return "fp32: the only precision this target runs"
    if plan.token_outputs:
        return "fp32: token outputs have no sentence vector to measure a precision by"
    if not plan.measures:
        return "fp32: the candidates cannot be measured here (not validated, or the libraries cannot run here)"
    return None


def start_candidates(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                     reference: torch.nn.Module, staging: Path, workers: Workers) -> dict[str, Candidate]:
    """`--precision auto`: the candidates the int8 plan does not decide (fp32, bf16), their builds
    started before it, to run beside its simulation. None where auto measures nothing."""
    if plan.requested_precision != "auto" or unmeasured_precision(plan) is not None:
        return {}
    return {name: start_candidate(config, plan, arithmetic.but(precision=name), imported, reference,
                                  staging / "precision" / name, workers)
            for name in plan.precision_candidates if name != "int8"}


def choose_precision(config: CompileConfig, plan: Plan, arithmetic: Arithmetic, imported,
                     reference: torch.nn.Module, staging: Path, progress: Progress, workers: Workers,
                     started: dict[str, Candidate]) -> tuple[Arithmetic, PrecisionEntry, Candidate | None]:
    """`--precision auto`: the generic library in every precision the target runs (`started`: those
    built already, `start_candidates`), each measured against the fp32 model on `accuracy_rows`,
    timed (interleaved, at a few shapes, on an idle machine), and the fastest that passes its gate and
    `min_cosine` kept (compile/precision.py). Where the libraries cannot run here, nothing can be
    measured and fp32 ships. Returns the arithmetic with the chosen precision, auto's record of the
    choice, and the chosen candidate (None: nothing built)."""
    why = unmeasured_precision(plan)
    if why is not None:
        entry = PrecisionEntry(precision="fp32", requested="auto", reason=why)
        return arithmetic.but(precision="fp32"), entry, None
    workloads = [Workload.full(min(b, config.max_batch), min(s, plan.info.max_seq)) for b, s in AUTO_PRECISION_SHAPES]
    measured, candidates = [], dict(started)
    refused = arithmetic.int8.refusal(config.min_cosine) if "int8" in plan.precision_candidates else None
    if "int8" in plan.precision_candidates and not refused:
        candidates["int8"] = checked_int8_candidate(
            config, plan, arithmetic, imported, reference, staging / "precision" / "int8", progress, workers,
            meanwhile=lambda: [candidate.measured() for candidate in started.values()])
    calls = {}
    for name in plan.precision_candidates:
        if name not in candidates:  # nothing to build: every linear would stay out of int8
            measured.append(Measured(name, arithmetic.int8.simulated, {}, config.min_cosine, refused))
            continue
        candidate = candidates[name]
        measured.append(Measured(name, candidate.measured(), {}, config.min_cosine))
        runner = candidate.builder.runner(candidate.library, candidate.strategy)
        for w in workloads:
            calls[(name, w)] = (lambda r=runner, x=candidate.builder.inputs(w): r(*x))
    workers.idle()
    for name, times in _time_candidates(calls, config.strategy_repeats).items():
        candidates[name].latency_ms = times
        next(m for m in measured if m.precision == name).times_ms.update(
            {f"{w.batch}x{w.seq}": round(ms, 3) for w, ms in times.items()})
    chosen, reason = precision.choose(measured)
    log.info("precision auto: %s", reason)
    entry = PrecisionEntry(precision=chosen.precision, requested="auto", reason=reason, candidates=[
        PrecisionCandidate(precision=m.precision, times_ms=m.times_ms, gate_failures=m.failures, **m.accuracy)
        for m in measured])
    shipped = candidates.get(chosen.precision)
    int8_plan = candidates["int8"].arithmetic.int8 if "int8" in candidates else arithmetic.int8
    return arithmetic.but(precision=chosen.precision, int8=int8_plan), entry, shipped


def _time_candidates(calls: dict[tuple[str, Workload], Callable[[], object]],
                     repeats: int) -> dict[str, dict[Workload, float]]:
    """Each candidate's median ms per workload, interleaved per workload (the same machine state for
    each), in fewer rounds where a workload's round is slow (`budgeted_medians_ms`: a 12 x 768 BERT's
    fp32 takes 0.85 s at 8x128, where the precisions differ by 1.6-3x)."""
    times: dict[str, dict[Workload, float]] = {}
    for workload in dict.fromkeys(w for _, w in calls):
        same = {name: call for (name, w), call in calls.items() if w == workload}
        for name, ms in budgeted_medians_ms(same, repeats=repeats).items():
            times.setdefault(name, {})[workload] = ms
    return times
