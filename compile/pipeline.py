"""The compile pipeline: checkpoint -> Relax -> passes -> per-bucket + generic libraries -> artifact."""

from __future__ import annotations

import copy
import logging
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import transformers
import tvm

from artifact.bucketing import AnyBucket, Bucket, PackedBucket
from artifact.cpu_features import missing_on_host, target_features
from artifact.hashing import file_sha256
from artifact.loader import LibraryRunner, device_for, device_name, load_weights
from artifact.manifest import (
    BucketEntry,
    CostModel,
    GenericEntry,
    Manifest,
    ModelEntry,
    PassCounts,
    PassesEntry,
    PrecisionCandidate,
    PrecisionEntry,
    QuantizationEntry,
    SparsityEntry,
    StrategyChoice,
    StrategyPasses,
    TargetEntry,
    WeightsEntry,
)

from . import attention_products, precision
from .build import build_library, check_mcpu, make_target, specialize
from .capabilities import Capabilities, KernelConfig, cpu_name
from .checkpoint import TOKENIZER_FILES, CheckpointInfo, example_inputs, inspect_checkpoint, load_wrapper
from .config import RELATIVE_TOLERANCES, CompileConfig
from .errors import CompileError, ValidationError
from .importer import export_and_import
from .int8_plan import Int8Plan, plan_for
from .opcount import tracked_counts
from .passes import quantize
from .passes.bf16 import linears_to_bf16
from .passes.fuse_attention import fuse_attention_in
from .passes.lift import LiftedModel, lift_and_transform
from .passes.packing import pack_linear_weights
from .passes.precision import to_precision
from .passes.quantize import quantize_linears, sentence_rows
from .passes.smooth import smooth_linears
from .passes.sparsity import prune_model, sparsify
from .passes.strategy import PASSES, STRATEGIES, apply_strategy
from .precision import Measured
from .progress import Progress
from .sentences import ACCURACY_SENTENCES
from .staging import atomic_directory
from .timing import (
    OTHER_LOAD_WARNING_CORES,
    OtherLoad,
    budgeted_medians_ms,
    fit_cost_model,
    interleaved_medians,
    use_all_cores,
)
from .tuning import Tuner
from .validate import checked_diff, cosine_drift, library_inputs

TOKENIZER_DIR = "tokenizer"
UNTIMED_AUTO_STRATEGY = "concat"  # what `auto` builds when it cannot time (CUDA without a GPU)
# (batch, seq) the generic library is timed at for its cost model, clipped to its bounds.
COST_MODEL_SHAPES = ((1, 16), (1, 64), (1, 128), (4, 64), (8, 16), (8, 128))
# (batch, seq) `--precision auto` times each candidate at: one short query, one passage, a batch.
AUTO_PRECISION_SHAPES = ((1, 16), (1, 128), (8, 128))
REPLANS = 2  # times an int8 plan is admitted again after its library missed what the plan kept
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """A timed call: `batch` random rows of up to `width` tokens, padded to `seq` for attention,
    `tokens` rows computed by the linear layers (what a cost model is fitted over)."""

    batch: int
    width: int
    seq: int
    tokens: int

    @classmethod
    def full(cls, batch: int, seq: int) -> "Workload":
        return cls(batch, seq, seq, batch * seq)


@dataclass
class Candidates:
    """One library built once per strategy, before the strategy is chosen."""

    name: str
    libraries: dict[str, str]  # strategy -> library file in the staging directory
    strategy_ms: dict[str, float] | None  # None: one strategy, nothing to time
    workloads: list[Workload]
    validation_shapes: list[AnyBucket]
    seconds: float


def choose_strategies(pending: list[Candidates], margin: float) -> tuple[dict[str, str], str]:
    """({library: strategy}, shared strategy). Every strategy in use ships a full weight set, so
    one shared strategy (the least total time over all libraries) runs everything, except a library
    whose own fastest strategy beats it by more than `margin` (0.03: 3%)."""
    strategies = list(pending[0].libraries)
    timed = [c for c in pending if c.strategy_ms is not None]
    shared = min(strategies, key=lambda s: sum(c.strategy_ms[s] for c in timed)) if timed else strategies[0]
    chosen = {}
    for candidates in pending:
        times = candidates.strategy_ms
        fastest = min(times, key=times.get) if times else shared
        chosen[candidates.name] = fastest if times and times[shared] > times[fastest] * (1 + margin) else shared
    return chosen, shared


@dataclass
class BuildRecord:
    """One shipped library: where it is, how it was chosen, how close it is to PyTorch."""

    name: str
    library: str
    seconds: float
    strategy: str
    strategy_ms: dict[str, float] | None
    diffs: dict[str, float | None] = field(default_factory=dict)
    latency_ms: dict[Workload, float] = field(default_factory=dict)  # measured median ms per workload

    def cost_model(self) -> CostModel | None:
        """The library's latency fitted over its timed workloads; None when not timed."""
        if not self.latency_ms:
            return None
        fixed, per_token, per_attention = fit_cost_model(
            {(w.batch, w.seq, w.tokens): ms for w, ms in self.latency_ms.items()})
        return CostModel(fixed_ms=fixed, per_token_ms=per_token, per_attention_ms=per_attention)


def cost_model_workloads(max_batch: int, max_seq: int) -> list[Workload]:
    """The generic library's: full rows at a few (batch, seq) within its bounds."""
    shapes = sorted({(min(b, max_batch), min(s, max_seq)) for b, s in COST_MODEL_SHAPES})
    return [Workload.full(b, s) for b, s in shapes]


def bucket_workloads(bucket: AnyBucket) -> list[Workload]:
    """A bucket's timing: its full shape first (its `latency_ms`); a packed one also one sequence
    and a batch of short sequences, so that its cost model tells tokens from attention."""
    first = Workload.full(bucket.rows, bucket.seq)
    if isinstance(bucket, Bucket):
        return [first]
    rows, seq = bucket.rows, bucket.seq
    shorter = [Workload(rows, width, seq, rows * width) for width in {max(1, seq // 4), max(1, seq // 2)}]
    return [first, *{Workload.full(1, seq), Workload.full(max(1, rows // 2), seq)}, *shorter]


def runs_here(kind: str, target: tvm.target.Target, features: list[str]) -> bool:
    """Whether this machine can run the target's libraries: its device is present and its CPU has
    every feature the (host) code may use. Cross-compiled ones are built, not validated or timed."""
    if not device_for(kind).exist:
        return False
    missing = missing_on_host(features)
    if missing:
        log.warning("this CPU lacks %s, which code for %s may use: the libraries are built but neither "
                    "validated nor timed here (run `python -m compile.verify` where they will run)",
                    ", ".join(missing), cpu_name(target))
        return False
    return True


def check_shapes(config: CompileConfig, info: CheckpointInfo) -> tuple[list[Bucket], list[Bucket]]:
    """Refuse buckets and validation shapes the model or the generic bounds cannot take."""
    buckets = config.bucket_list()
    for bucket in buckets:
        if bucket.seq > info.max_seq:
            raise CompileError(
                f"bucket {bucket.name} is longer than the model's max_position_embeddings ({info.max_seq})"
            )
    generic_shapes = config.generic_shape_list(info.max_seq)
    for shape in generic_shapes:
        if shape in buckets:
            raise CompileError(f"generic validation shape {shape.name} equals a bucket; pick a non-bucket shape")
        if shape.seq > info.max_seq or shape.batch > config.max_batch:
            raise CompileError(
                f"generic validation shape {shape.name} exceeds the generic bounds {config.max_batch}x{info.max_seq}"
            )
    return buckets, generic_shapes


class LibraryBuilder:
    """Builds each library once per candidate strategy, keeps the fastest, validates it."""

    def __init__(self, config: CompileConfig, target: tvm.target.Target, staging: Path,
                 variants: dict[str, LiftedModel], weight_files: dict[str, WeightsEntry], wrapper: torch.nn.Module,
                 vocab_size: int, can_run: bool, kernels: KernelConfig):
        self.config = config
        self.kernels = kernels  # what the libraries' kernels are written for
        self.staging = staging
        self.variants = variants
        self.wrapper = wrapper
        self.vocab_size = vocab_size
        self.target = target
        self.device = device_for(config.target)
        self.can_run = can_run
        self.layout = config.layout
        self.validate = config.validate_artifacts and self.can_run
        # Libraries are timed (for the server's batch planner) when validated, with every core:
        # as a server runs them. `validate: false` skips both.
        self.timed = self.validate
        # --tune times kernels, so it runs only where the libraries can run
        self.tuner = Tuner(target) if config.tune and self.can_run else None
        if config.tune and not self.can_run:
            log.warning("--tune skipped: the libraries for mcpu %s cannot run on this machine to be timed",
                        cpu_name(target))
        if self.can_run:
            use_all_cores()
        # Validate what ships: the weights as read back from the artifact's files.
        self.weights = (
            {s: load_weights(staging / entry.file, entry.names, self.device) for s, entry in weight_files.items()}
            if self.can_run else {}
        )

    def build(self, name: str, shape_module: Callable[[tvm.IRModule], tvm.IRModule],
              workloads: list[Workload], validation_shapes: list[AnyBucket], static: bool = True) -> Candidates:
        """Build the library once per strategy and time each on the first workload (when `auto`)."""
        started = time.perf_counter()
        libraries = {}
        for strategy, variant in self.variants.items():
            library = f"lib/{name}.{strategy}.so"
            module = shape_module(variant.mod)
            if self.tuner is not None and static:
                self.tuner.tune(name, module, self.config.tune / len(self.variants))
            build_library(module, self.target, self.staging / library, cuda_graph=self.config.cuda_graph and static,
                          tuned=self.tuner.database if self.tuner is not None else None,
                          kernels=self.kernels)
            libraries[strategy] = library
        strategy_ms = self._time_strategies(libraries, workloads[0])
        return Candidates(name, libraries, strategy_ms, workloads, validation_shapes, time.perf_counter() - started)

    def finish(self, candidates: Candidates, strategy: str) -> BuildRecord:
        """Ship `strategy`'s library (the others are deleted), validate it, time it on every workload."""
        library = f"lib/{candidates.name}.so"
        (self.staging / candidates.libraries[strategy]).rename(self.staging / library)
        for other in set(candidates.libraries) - {strategy}:
            (self.staging / candidates.libraries[other]).unlink()
        record = BuildRecord(candidates.name, library, candidates.seconds, strategy, candidates.strategy_ms)
        for index, shape in enumerate(candidates.validation_shapes):
            record.diffs[shape.name] = self._check(record, shape, seed=self.config.seed + index)
        if self.timed:
            record.latency_ms = self._latencies(record, candidates.workloads)
        return record

    def runner(self, library: str, strategy: str) -> LibraryRunner:
        return LibraryRunner(self.staging / library, self.device, self.weights[strategy])

    def _time_strategies(self, libraries: dict[str, str], workload: Workload) -> dict[str, float] | None:
        if len(libraries) == 1:
            return None
        inputs = self.inputs(workload)
        runners = {s: self.runner(library, s) for s, library in libraries.items()}
        stats = interleaved_medians({s: (lambda r=r: r(*inputs)) for s, r in runners.items()},
                                    repeats=self.config.strategy_repeats)
        return {s: round(v["median_s"] * 1e3, 3) for s, v in stats.items()}

    def inputs(self, workload: Workload) -> tuple[np.ndarray, ...]:
        rows = example_inputs(workload.batch, workload.width, self.vocab_size, seed=self.config.seed)
        return library_inputs(self.layout, tuple(x.numpy() for x in rows), workload.seq, workload.tokens)

    def _latencies(self, record: BuildRecord, workloads: list[Workload]) -> dict[Workload, float]:
        """Median ms of the chosen library per workload; `auto`'s timing of the first is reused."""
        measured = {}
        if record.strategy_ms is not None:
            measured[workloads[0]] = record.strategy_ms[record.strategy]
        runner = self.runner(record.library, record.strategy)
        todo = {str(index): w for index, w in enumerate(workloads) if w not in measured}
        calls = {key: (lambda x=self.inputs(w): runner(*x)) for key, w in todo.items()}
        if calls:
            measured.update({todo[key]: ms for key, ms in budgeted_medians_ms(calls).items()})
        return {w: round(ms, 4) for w, ms in measured.items()}

    def agreement(self, library: str, strategy: str, info: CheckpointInfo) -> dict:
        """A library against the fp32 wrapper on the shipped sentences: cosine (min, mean) of each
        embedding, or a classifier's top-1 agreement and largest probability difference."""
        rows = sentence_rows(info.path / "tokenizer.json", info.max_seq)
        runner = self.runner(library, strategy)
        step = self.config.max_batch  # the generic library's bound
        chunks = [tuple(x[i:i + step] for x in rows) for i in range(0, len(rows[0]), step)]
        actual = np.concatenate([runner(*library_inputs(self.layout, chunk, chunk[0].shape[1])) for chunk in chunks])
        with torch.no_grad():
            expected = self.wrapper(*(torch.from_numpy(x) for x in rows)).float().numpy()
        if self.config.model_task == "classify":
            return quantize.classifier_agreement(actual, expected)
        return quantize.embedding_agreement(actual, expected)

    def precision_report(self, generic: BuildRecord, info: CheckpointInfo, linears: int,
                         chosen: PrecisionEntry | None,
                         int8_plan: Int8Plan | None = None) -> tuple[PrecisionEntry, QuantizationEntry | None]:
        """What the linear layers compute in and how close the generic library stays to the fp32
        model; under `min_cosine`, or int8 under its gate, the compile fails (what a precision
        costs is unknown when not run)."""
        name = self.config.precision
        kernel = self.kernels.capabilities.linears_kernel(self.kernels.linears)
        entry = (chosen or PrecisionEntry(precision=name, requested=name)).model_copy(
            update={"kernel": kernel, "linears": linears})
        measured_here = self.validate and kernel is not None and not self.config.token_outputs
        accuracy = self.agreement(generic.library, generic.strategy, info) if measured_here else {}
        if entry.requested != "auto" and accuracy:
            failures = precision.gate_failures(name, accuracy)
            entry = entry.model_copy(update={"candidates": [PrecisionCandidate(
                precision=name, gate_failures=failures, **accuracy)]})
            if failures and name != "int8":
                log.warning("%s misses its accuracy gate on the shipped sentences: %s", name, "; ".join(failures))
        refuse_missed_gate(name, accuracy, self.config.min_cosine)
        quantization = None
        if name == "int8":
            quantization = QuantizationEntry(scheme=quantize.SCHEME, kernel=kernel, linears=linears,
                                             sentences=len(ACCURACY_SENTENCES), **accuracy,
                                             **(int8_plan.manifest_fields(linears) if int8_plan else {}))
        return entry, quantization

    def _check(self, record: BuildRecord, shape: AnyBucket, seed: int) -> float | None:
        if not self.validate:
            return None
        return checked_diff(record.name, self.runner(record.library, record.strategy), self.wrapper, shape,
                            self.vocab_size, seed, self.config.effective_tolerance, self.layout,
                            relative=self.config.precision in RELATIVE_TOLERANCES)


def refuse_missed_gate(name: str, accuracy: dict, min_cosine: float | None) -> None:
    """Fail the compile (one line) where int8's measured `accuracy` misses its gate, or a rounded
    precision's misses `min_cosine`; an unmeasured precision (`accuracy` empty) passes."""
    failures = precision.gate_failures(name, accuracy) if accuracy else []
    if failures and name == "int8":
        raise ValidationError(precision.gate_refusal(name, accuracy, failures))
    if precision.under_cosine_floor(name, accuracy, min_cosine):
        raise ValidationError(f"{name} embeddings reach cosine {accuracy['cosine_min']:.6f} to the fp32 model's "
                              f"on the shipped sentences, under {precision.min_cosine_flag(min_cosine)}")


@dataclass
class Plan:
    """What a compile will build, checked before anything is written."""

    info: CheckpointInfo
    target: tvm.target.Target
    capabilities: Capabilities  # what the target's CPU runs
    buckets: list[AnyBucket]
    generic_shapes: list[Bucket]
    cpu_features: list[str]
    can_run: bool
    strategies: list[str]
    int8: Int8Plan | None = None  # which linears int8 smooths and keeps out (measured once the model loads)
    attention: attention_products.AttentionChoice | None = None  # beside bf16 / int8 linears (None: fp32 only)


def plan_compile(config: CompileConfig) -> Plan:
    """Refuse what cannot be built (shapes, layout, CPU, precision) and decide what will be."""
    info = inspect_checkpoint(config.model_dir(), config.model_task, config.pooling)
    if config.task == "rerank" and len(info.labels) != 1:
        raise CompileError(f"--task rerank needs a cross-encoder with one label; {info.path.name} has "
                           f"{len(info.labels)} ({', '.join(info.labels)}): use --task classify")
    buckets, generic_shapes = check_shapes(config, info)
    if config.layout == "packed" and info.config.get("position_embedding_type", "absolute") != "absolute":
        raise CompileError("layout packed needs absolute position embeddings; this checkpoint has "
                           f"{info.config['position_embedding_type']}")
    check_mcpu(config.mcpu)
    target = make_target(config.target, config.cuda_arch, config.mcpu)
    capabilities = Capabilities.of(target)
    if config.precision != "auto" and (problem := capabilities.refusal(config.precision)):
        raise CompileError(problem)
    if problem := attention_products.refusal(config.attention_products, capabilities):
        raise CompileError(problem)
    cpu_features = target_features(target)
    can_run = runs_here(config.target, target, cpu_features)
    strategies = [config.strategy]
    if config.strategy == "auto":  # timing needs to run the libraries; where they cannot, build one strategy only
        strategies = list(STRATEGIES) if can_run else [UNTIMED_AUTO_STRATEGY]
    return Plan(info, target, capabilities, buckets, generic_shapes, cpu_features, can_run, strategies)


def load_model(config: CompileConfig, info: CheckpointInfo) -> tuple[torch.nn.Module, torch.nn.Module, dict | None]:
    """(wrapper, the PyTorch oracle, sparsity fields): the checkpoint, pruned when asked."""
    wrapper = load_wrapper(info, config.model_task)
    sparsity = None
    if config.prunes:
        sparsity = _prune(wrapper, info, config)
    elif config.sparsity == "from-checkpoint":  # the weights as they are: nothing to prune or drift
        sparsity = {"mode": "from-checkpoint", "block": list(config.block_shape()), "layers": [],
                    "pruned": 0, "cosine_vs_dense": None}
    # The oracle runs in the artifact's precision, on the same (possibly pruned) weights.
    reference = wrapper if config.dtype == "float32" else copy.deepcopy(wrapper).to(getattr(torch, config.dtype))
    return wrapper, reference, sparsity


def transform(config: CompileConfig, plan: Plan, imported, strategies: list[str],
              sparsity: dict | None) -> tuple[dict[str, LiftedModel], dict[str, StrategyPasses], int]:
    """Per strategy: the graph passes, the linears in the configured precision, weights lifted.
    Returns the variants, their pass records and how many linears the precision pass rewrote."""
    target = plan.target
    variants, passes, rewritten = {}, {}, 0
    for strategy in strategies:
        combined, params = apply_strategy(imported.mod, strategy), imported.params
        if sparsity is not None:
            combined, params, report = sparsify(combined, params, config.block_shape(),
                                                config.sparse_max_density, target,
                                                timed=config.sparse_choice == "timed" and plan.can_run
                                                and config.target == "cpu")
            sparsity.update(density=report["density"], rewritten=report["rewritten"],
                            kept_dense=report["kept_dense"], choice=report["choice"], choices=report["choices"])
        combined = to_precision(combined, config.dtype)
        packed, pipeline = combined, list(PASSES[strategy])
        if config.precision == "int8":  # int8 panels, smoothed; what the plan keeps out: bf16 or fp32
            packed, _ = smooth_linears(packed, plan.int8.scales)
            packed, rewritten = quantize_linears(packed, target, frozenset(plan.int8.fallback_keys),
                                                 keep_in_bf16=plan.int8.fallback_precision == "bf16")
            pipeline[-1:-1] = ["SmoothLinears", "QuantizeLinearsInt8"]
        elif config.precision == "bf16":  # bf16 panels; what is left (if any) stays fp32
            packed, rewritten = linears_to_bf16(packed)
            pipeline.insert(-1, "LinearsToBF16")
        if config.target == "cpu":  # weights in the CPU kernel's panel layout, packed at load
            packed, _ = pack_linear_weights(packed, plan.capabilities.lanes)
            pipeline.insert(-1, "PackLinearWeights")
        variants[strategy] = lift_and_transform(packed, params)
        attention_fused = None
        if config.target == "cpu":  # what each library's build will fuse (FuseAttention runs there)
            attention_fused = fuse_attention_in(variants[strategy].mod, KernelConfig(plan.capabilities))[1]
            pipeline.append("FuseAttention")
        passes[strategy] = StrategyPasses(
            pipeline=pipeline,
            after=PassCounts(**tracked_counts(combined)),
            main_after_lift=PassCounts(**tracked_counts(variants[strategy].mod)),
            attention_fused=attention_fused,
        )
    return variants, passes, rewritten


def choose_precision(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module,
                     staging: Path, progress: Progress) -> tuple[CompileConfig, PrecisionEntry]:
    """`--precision auto`: build the generic library in every precision the target runs, measure
    each against the fp32 model on the shipped sentences, time each (interleaved, at a few shapes),
    and keep the fastest that passes its gate and `min_cosine` (compile/precision.py). Where the libraries cannot
    run here, nothing can be measured and fp32 ships."""
    candidates = plan.capabilities.precisions
    why = None
    if len(candidates) == 1:
        why = "fp32: the only precision this target runs"
    elif config.token_outputs:
        why = "fp32: token outputs have no sentence vector to measure a precision by"
    elif not (plan.can_run and config.validate_artifacts):
        why = "fp32: the candidates cannot be measured here (not validated, or the libraries cannot run here)"
    if why is not None:
        return config.model_copy(update={"precision": "fp32"}), PrecisionEntry(precision="fp32", requested="auto",
                                                                               reason=why)
    workloads = [Workload.full(min(b, config.max_batch), min(s, plan.info.max_seq)) for b, s in AUTO_PRECISION_SHAPES]
    strategy = candidate_strategy(plan)
    measured, calls = [], {}
    for name in candidates:
        refused = plan.int8.refusal(config.min_cosine) if name == "int8" else None
        if refused:  # nothing to build: every linear would stay out of int8
            measured.append(Measured(name, plan.int8.simulated, {}, config.min_cosine, refused))
            continue
        candidate = config.model_copy(update={"precision": name})
        directory = staging / "precision" / name
        if name == "int8":
            built = checked_int8_candidate(candidate, plan, imported, reference, directory, workloads, strategy,
                                           progress)
        else:
            built = build_candidate(candidate, plan, imported, reference, directory, workloads, strategy)
        builder, library, accuracy = built
        measured.append(Measured(name, accuracy, {}, config.min_cosine))
        runner = builder.runner(library, strategy)
        for w in workloads:
            calls[(name, f"{w.batch}x{w.seq}")] = (lambda r=runner, x=builder.inputs(w): r(*x))
    for shape in dict.fromkeys(key[1] for key in calls):  # interleaved per shape: same machine state for each
        same_shape = {name: call for (name, s), call in calls.items() if s == shape}
        stats = interleaved_medians(same_shape, repeats=config.strategy_repeats)
        for m in measured:
            if m.precision in stats:
                m.times_ms[shape] = round(stats[m.precision]["median_s"] * 1e3, 3)
    shutil.rmtree(staging / "precision")
    chosen, reason = precision.choose(measured)
    log.info("precision auto: %s", reason)
    entry = PrecisionEntry(precision=chosen.precision, requested="auto", reason=reason, candidates=[
        PrecisionCandidate(precision=m.precision, times_ms=m.times_ms, gate_failures=m.failures, **m.accuracy)
        for m in measured])
    return config.model_copy(update={"precision": chosen.precision}), entry


def kernel_config(plan: Plan, linears: str) -> KernelConfig:
    """What the kernels of a library whose linears are in `linears` are written for: attention's
    products as chosen beside them (fp32 where nothing was chosen)."""
    products = plan.attention.for_precision(linears) if plan.attention is not None else "fp32"
    return KernelConfig(plan.capabilities, linears=linears, products=products)


def candidate_strategy(plan: Plan) -> str:
    """The strategy a candidate library is built in: the one planned, or `auto`'s untimed default."""
    return plan.strategies[0] if len(plan.strategies) == 1 else UNTIMED_AUTO_STRATEGY


def build_candidate(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module, directory: Path,
                    workloads: list[Workload], strategy: str) -> tuple[LibraryBuilder, str, dict]:
    """`config`'s precision built as a generic library in `directory`: (its builder, the library, its
    accuracy against the fp32 model on the shipped sentences)."""
    (directory / "lib").mkdir(parents=True)
    variants, _, _ = transform(config, plan, imported, [strategy], None)
    weights = {strategy: save_weights(directory, strategy, variants[strategy])}
    builder = LibraryBuilder(config, plan.target, directory, variants, weights, reference,
                             int(plan.info.config["vocab_size"]), plan.can_run, kernel_config(plan, config.precision))
    library = builder.build("generic", lambda m: m, workloads, plan.generic_shapes, static=False).libraries[strategy]
    return builder, library, builder.agreement(library, strategy, plan.info)


def checked_int8_candidate(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module,
                           directory: Path, workloads: list[Workload], strategy: str,
                           progress: Progress) -> tuple[LibraryBuilder, str, dict]:
    """The int8 candidate, built and measured as `build_candidate`. Where it misses the gate (or
    --min-cosine) that its plan kept in simulation, the simulation was off by more than the plan's
    margin: the plan is admitted again with the margin that library showed it needs
    (`Int8Plan.replanned`) and built again, up to REPLANS times; `plan.int8` is the last plan built."""
    built = build_candidate(config, plan, imported, reference, directory / "plan-0", workloads, strategy)
    for attempt in range(1, REPLANS + 1):
        accuracy = built[2]
        if not precision.accuracy_failures("int8", accuracy, config.min_cosine):
            break
        replanned = plan.int8.replanned(accuracy)
        if replanned is None or replanned.refusal(config.min_cosine):
            break
        line = (f"int8: its library reached least cosine {accuracy['cosine_min']:.5f} where the plan simulated "
                f"{plan.int8.simulated['cosine_min']:.5f}; planned again with {replanned.margin:.0%} of the loss to "
                f"spare: {len(replanned.fallback)}/{replanned.units} linear groups kept out")
        log.info(line)
        progress.note(line)
        plan.int8 = replanned
        built = build_candidate(config, plan, imported, reference, directory / f"plan-{attempt}", workloads, strategy)
    return built


def choose_attention(config: CompileConfig, plan: Plan) -> attention_products.AttentionChoice:
    """The arithmetic of attention's products beside bf16 / int8 linears: timed on this CPU where
    the libraries run here and are validated (as the strategies are), else as asked or the rule."""
    timed = plan.can_run and config.validate_artifacts
    if timed:
        use_all_cores()
    choice = attention_products.choose(plan.target, attention_products.Geometry.of(plan.info),
                                       config.attention_products, timed)
    log.info("attention products: beside bf16 linears %s; beside int8 linears %s", choice.reasons["bf16"],
             choice.reasons["int8"])
    return choice


def plan_int8_linears(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module,
                      progress: Progress) -> None:
    """The int8 plan (`plan.int8`), simulated with attention's products as chosen. int8 products stay
    only where every linear group keeps its int8 beside them (a kept linear costs more than they
    save); else fp32 products (`plan.attention`), and the plan keeps out what the gate needs."""
    def planned(products: str, keep_out: bool = True) -> Int8Plan | None:
        return plan_for(imported.mod, plan.target, reference, plan.info.path / "tokenizer.json", plan.info.max_seq,
                        config.model_task, config.min_cosine, progress.note, bf16_pays=plan.attention.bf16_pays,
                        attention_products=products, keep_out=keep_out)

    if plan.attention.for_precision("int8") == "int8":
        plan.int8 = planned("int8", keep_out=False)
        if plan.int8 is not None:
            return
        plan.attention = plan.attention.without_int8()
        log.info("attention products: %s", plan.attention.reasons["int8"])
        progress.note(plan.attention.reasons["int8"])
    plan.int8 = planned(plan.attention.for_precision("int8"))


def check_int8_plan(config: CompileConfig, plan: Plan, imported, reference: torch.nn.Module, staging: Path,
                    progress: Progress, measurable: bool) -> None:
    """`--precision int8`: fail before anything is built where the plan keeps no linear in int8;
    `measurable` (its library can run here and be validated), build the plan's generic library
    first and measure it, planned again where it misses (`checked_int8_candidate`), so that a plan
    the library cannot keep fails (or is mended) before every bucket is built."""
    refused = plan.int8.refusal(config.min_cosine)
    if refused:
        raise ValidationError(f"--precision int8: {refused}; use --precision auto, bf16 or fp32")
    if not measurable:
        return
    with progress.step("int8: the plan's generic library against the fp32 model"):
        _, _, accuracy = checked_int8_candidate(config, plan, imported, reference, staging / "int8-plan",
                                                [Workload.full(1, min(16, plan.info.max_seq))],
                                                candidate_strategy(plan), progress)
        shutil.rmtree(staging / "int8-plan")
    refuse_missed_gate("int8", accuracy, config.min_cosine)


def build_libraries(builder: LibraryBuilder, config: CompileConfig, plan: Plan,
                    progress: Progress) -> tuple[list[BuildRecord], str]:
    """Every bucket's library and the generic one, built per strategy, the strategy chosen,
    then validated and timed: (records, generic last; the shared strategy)."""
    with OtherLoad() as timing:  # the libraries are timed in here (strategies, then each finish)
        pending = []
        for bucket in plan.buckets:
            with progress.step(f"build bucket {bucket.name}"):
                pending.append(builder.build(f"bucket_{bucket.name}", lambda m, b=bucket: specialize(m, b),
                                             bucket_workloads(bucket), [bucket]))
        with progress.step("build generic library"):
            generic_workloads = cost_model_workloads(config.max_batch, plan.info.max_seq)
            first = Workload.full(plan.generic_shapes[0].batch, plan.generic_shapes[0].seq)  # `auto` chooses on it
            workloads = [first] + [w for w in generic_workloads if w != first]
            pending.append(builder.build("generic", lambda m: m, workloads, plan.generic_shapes, static=False))
        chosen, shared_strategy = choose_strategies(pending, config.strategy_margin)
        records = []
        for candidates in pending:
            shapes = ", ".join(shape.name for shape in candidates.validation_shapes)
            with progress.step(f"validate + time {candidates.name} ({chosen[candidates.name]}) on {shapes}"):
                records.append(builder.finish(candidates, chosen[candidates.name]))
    if timing.cores > OTHER_LOAD_WARNING_CORES:
        log.warning("other work kept %.1f cores busy while the libraries were timed: the manifest's "
                    "latencies and cost models, which the server's batch planner uses, are too high; "
                    "compile on an otherwise idle machine", timing.cores)
    return records, shared_strategy


def compile_model(config: CompileConfig, progress: Progress | None = None) -> tuple[Manifest, list[BuildRecord]]:
    """Compile `config.model` into an artifact directory at `config.out`, atomically."""
    plan = plan_compile(config)
    info = plan.info
    progress = progress or Progress(0, quiet=True)
    plans_int8 = config.precision == "int8" or (  # auto's int8 candidate, where auto measures candidates
        config.precision == "auto" and not config.token_outputs and plan.can_run and config.validate_artifacts
        and "int8" in plan.capabilities.precisions)
    chooses_attention = config.target == "cpu" and config.precision != "fp32"
    checks_int8 = (config.precision == "int8" and plan.can_run and config.validate_artifacts  # auto checks its own
                   and not config.token_outputs)
    progress.set_total(5 + 2 * (len(plan.buckets) + 1) + (config.precision == "auto") + plans_int8
                       + chooses_attention + checks_int8)
    vocab_size = int(info.config["vocab_size"])

    with atomic_directory(config.out) as staging:
        with progress.step(f"load {info.path.name} ({config.task})"):
            wrapper, reference, sparsity = load_model(config, info)
        with progress.step("torch.export + Relax import (dynamic batch, seq)"):
            imported = export_and_import(wrapper, config.max_batch, info.max_seq, vocab_size, config.layout)
        chosen_precision = None
        if chooses_attention:
            with progress.step(f"attention's products beside bf16 / int8 linears ({config.attention_products})"):
                plan.attention = choose_attention(config, plan)
        if plans_int8:
            with progress.step("int8: smoothing, sensitivity and fallback, simulated on the shipped sentences"):
                plan_int8_linears(config, plan, imported, reference, progress)
            if config.precision == "int8":
                check_int8_plan(config, plan, imported, reference, staging, progress, measurable=checks_int8)
        if config.precision == "auto":
            with progress.step(f"precision auto: measure {', '.join(plan.capabilities.precisions)}"):
                config, chosen_precision = choose_precision(config, plan, imported, reference, staging, progress)
        with progress.step(f"passes for strategy {', '.join(plan.strategies)}; lift weights"):
            variants, passes, rewritten = transform(config, plan, imported, plan.strategies, sparsity)
        with progress.step("copy tokenizer"):
            _copy_tokenizer(info.path, staging / TOKENIZER_DIR)
        (staging / "lib").mkdir()
        weight_files = {strategy: save_weights(staging, strategy, variant) for strategy, variant in variants.items()}
        builder = LibraryBuilder(config, plan.target, staging, variants, weight_files, reference, vocab_size,
                                 plan.can_run, kernel_config(plan, config.precision))
        records, shared_strategy = build_libraries(builder, config, plan, progress)
        with progress.step(f"{config.precision} accuracy against the fp32 model on the shipped sentences"):
            precision_entry, quantization = builder.precision_report(records[-1], info, rewritten, chosen_precision,
                                                                     plan.int8)
        if plan.attention is not None and config.precision in precision.ROUNDED:  # auto may have shipped fp32
            precision_entry = precision_entry.model_copy(update={"attention": plan.attention.entry(config.precision)})
        used = {r.strategy for r in records}
        for strategy in set(weight_files) - used:
            (staging / weight_files.pop(strategy).file).unlink()
        manifest = assemble_manifest(config, plan, builder, imported, records, weight_files, passes, shared_strategy,
                                     sparsity, precision_entry, quantization)
        manifest.write(staging)
    return manifest, records


def assemble_manifest(config: CompileConfig, plan: Plan, builder: LibraryBuilder, imported,
                      records: list[BuildRecord], weight_files: dict[str, WeightsEntry],
                      passes: dict[str, StrategyPasses], shared_strategy: str, sparsity: dict | None,
                      precision_entry: PrecisionEntry, quantization: QuantizationEntry | None) -> Manifest:
    """The artifact's manifest: what was built, for which CPU, how it was chosen and validated."""
    info, staging, generic = plan.info, builder.staging, records[-1]

    def library_fields(record: BuildRecord) -> dict:
        return {"library": record.library, "sha256": file_sha256(staging / record.library),
                "strategy": record.strategy, "strategy_ms": record.strategy_ms}

    return Manifest(
        task=config.model_task,
        target=TargetEntry(
            kind=config.target,
            tvm_target=str(builder.target),
            mcpu=str((builder.target.host or builder.target).attrs["mcpu"]),
            cuda_arch=config.cuda_arch if config.target == "cuda" else None,
            cuda_graph=config.cuda_graph,
            cpu_features=plan.cpu_features,
        ),
        model=ModelEntry(
            path=str(info.path),
            weights_sha256=info.weights_sha256(),
            model_type=info.config["model_type"],
            architecture=(info.config.get("architectures") or ["BertModel"])[0],
            hidden_size=info.hidden_size,
            max_position_embeddings=info.max_seq,
            vocab_size=int(info.config["vocab_size"]),
            pad_token_id=int(info.config.get("pad_token_id") or 0),
        ),
        dtype=config.dtype,
        layout=config.layout,
        pooling=info.pooling,
        labels=info.labels,
        problem_type=info.config.get("problem_type") if config.model_task == "classify" else None,
        output_dim=info.output_dim,
        tvm_version=tvm.__version__,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        tokenizer=TOKENIZER_DIR,
        weights=weight_files,
        buckets=[
            BucketEntry(batch=b.batch if isinstance(b, Bucket) else None, seq=b.seq, max_abs_diff=r.diffs[b.name],
                        latency_ms=r.latency_ms.get(bucket_workloads(b)[0]),
                        cost_model=r.cost_model() if isinstance(b, PackedBucket) else None, **library_fields(r))
            for b, r in zip(plan.buckets, records)
        ],
        generic=GenericEntry(max_batch=config.max_batch, max_seq=info.max_seq, max_abs_diff=generic.diffs,
                             cost_model=generic.cost_model(), **library_fields(generic)),
        passes=PassesEntry(before=PassCounts(**tracked_counts(imported.mod)), strategies=passes),
        strategy_choice=(StrategyChoice(shared=shared_strategy, margin=config.strategy_margin)
                         if len(plan.strategies) > 1 else None),
        sparsity=SparsityEntry(**sparsity) if sparsity is not None else None,
        quantization=quantization,
        precision=precision_entry,
        tuning=builder.tuner.save(staging, config.tune) if builder.tuner is not None else None,
        validated=builder.validate,
        validated_on=device_name(builder.device) if builder.validate else None,
        tolerance=config.effective_tolerance,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _prune(wrapper: torch.nn.Module, info: CheckpointInfo, config: CompileConfig) -> dict:
    """Block-prune the checkpoint's chosen linears in place, before export: PyTorch validation and
    TVM then see the same weights. Returns the manifest's sparsity fields known so far."""
    dense = load_wrapper(info, config.model_task)
    try:
        pruned = prune_model(wrapper.bert, 1.0 - config.sparsity, config.block_shape(), tuple(config.sparse_layers))
    except ValueError as exc:
        raise CompileError(f"cannot prune with block {config.block}: {exc}") from None
    return {"block": list(config.block_shape()), "layers": list(config.sparse_layers), "pruned": pruned,
            "cosine_vs_dense": cosine_drift(dense, wrapper, info)}


def save_weights(staging: Path, strategy: str, variant: LiftedModel) -> WeightsEntry:
    """One safetensors file per strategy; keys are prefixed with the parameter's position,
    because lifted parameter names (lv12, ...) are not unique."""
    from safetensors.numpy import save_file

    name = f"weights-{strategy}.safetensors"
    keys = [f"{index:04d}.{weight_name}" for index, weight_name in enumerate(variant.weight_names)]
    save_file(dict(zip(keys, (np.ascontiguousarray(w) for w in variant.weights))), str(staging / name))
    return WeightsEntry(file=name, sha256=file_sha256(staging / name), names=keys)


def _copy_tokenizer(model_dir: Path, destination: Path) -> None:
    destination.mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, destination / name)
