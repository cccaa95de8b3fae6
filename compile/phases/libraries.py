"""The libraries' phases: each bucket's library and the generic one built once per candidate strategy,
the strategy chosen by time, then the shipped one validated against PyTorch and timed."""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import tvm

from artifact.bucketing import AnyBucket, Bucket
from artifact.embedding_dtypes import calibration_ranges
from artifact.loader import LibraryRunner, device_for, load_weights, weight_tensors
from artifact.manifest import (
    CostModel,
    EmbeddingRangesEntry,
    PrecisionCandidate,
    PrecisionEntry,
    QuantizationEntry,
    WeightsEntry,
)

from .. import precision
from ..build import build_library, specialize
from ..capabilities import cpu_name
from ..checkpoint import example_inputs
from ..config import RELATIVE_TOLERANCES, CompileConfig
from ..passes import quantize
from ..passes.lift import LiftedModel
from ..passes.quantize import sentence_rows
from ..plan import Arithmetic, Plan
from ..progress import Progress
from ..sentences import ACCURACY_SENTENCES
from ..timing import (
    OTHER_LOAD_WARNING_CORES,
    OtherLoad,
    budgeted_medians_ms,
    fit_cost_model,
    interleaved_medians,
    use_all_cores,
)
from ..tuning import Tuner
from ..validate import checked_diff, library_inputs
from ..workers import Workers

# (batch, seq) the generic library is timed at for its cost model, clipped to its bounds.
COST_MODEL_SHAPES = ((1, 16), (1, 64), (1, 128), (4, 64), (8, 16), (8, 128))
# and, for a long-context model (ModernBERT's 8192 positions), one long sequence at each of these that fits: from
# short shapes alone, the quadratic term (its global layers' attention) would be extrapolated 64-fold
LONG_COST_MODEL_SHAPES = ((1, 1024), (1, 4096))
SHORT_QUERY_TOKENS = 16  # a packed bound's shortest timed input: one query
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
    workloads: list[Workload]
    validation_shapes: list[AnyBucket]
    builds: list[str]  # the builds started in the workers (a reused library's is not)
    strategy_ms: dict[str, float] | None = None  # None: one strategy, nothing to time (or not yet timed)
    seconds: float = 0.0  # the builds' time, once built
    latency_ms: dict[Workload, float] = field(default_factory=dict)  # a reused library's, timed before


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
    long = tuple((b, s) for b, s in LONG_COST_MODEL_SHAPES if s <= max_seq)
    shapes = sorted({(min(b, max_batch), min(s, max_seq)) for b, s in COST_MODEL_SHAPES + long})
    return [Workload.full(b, s) for b, s in shapes]


def bucket_workloads(bucket: AnyBucket) -> list[Workload]:
    """A bucket's timing: its full shape first (its `latency_ms`); a packed one also one sequence,
    a batch of short sequences, so that its cost model tells tokens from attention, and one short
    query, which a bound that computes more than its sequences (DeBERTa's score bias) runs slowly
    (artifact/costs.py's GENERIC_MARGIN)."""
    first = Workload.full(bucket.rows, bucket.seq)
    if isinstance(bucket, Bucket):
        return [first]
    rows, seq = bucket.rows, bucket.seq
    shorter = [Workload(rows, width, seq, rows * width) for width in {max(1, seq // 4), max(1, seq // 2)}]
    query = min(SHORT_QUERY_TOKENS, seq)
    return list(dict.fromkeys([first, Workload.full(1, seq), Workload.full(max(1, rows // 2), seq), *shorter,
                               Workload(1, query, seq, query)]))


def _build(shape_module: Callable[[tvm.IRModule], tvm.IRModule], mod: tvm.IRModule, target: tvm.target.Target,
           path: Path, **options) -> None:
    """One library, in a build worker: `mod` shaped (a bucket's bounds bound), then built."""
    build_library(shape_module(mod), target, path, **options)


class LibraryBuilder:
    """Builds each library once per candidate strategy, keeps the fastest, validates it."""

    def __init__(self, config: CompileConfig, plan: Plan, arithmetic: Arithmetic, staging: Path,
                 variants: dict[str, LiftedModel], weight_files: dict[str, WeightsEntry] | None,
                 wrapper: torch.nn.Module, workers: Workers):
        self.config = config
        self.workers = workers  # where the libraries are built
        self.reused_seconds = 0.0  # the build time of a reused generic library (`reuse`)
        self.reused_latency_ms: dict[Workload, float] = {}  # and its times, where measured before
        self.plan = plan
        self.arithmetic = arithmetic  # what the libraries compute in (the chosen precision)
        self.staging = staging
        self.variants = variants
        self.wrapper = wrapper
        self.vocab_size = int(plan.info.config["vocab_size"])
        self.target = plan.target
        self.device = device_for(config.target)
        self.layout = config.layout
        # Libraries are validated and timed (for the server's batch planner) where they run here, with
        # every core: as a server runs them. `validate: false` skips both.
        self.validate = plan.measures
        # --tune times kernels, so it runs only where the libraries can run
        self.tuner = Tuner(plan.target) if config.tune and plan.runs_here else None
        if config.tune and not plan.runs_here:
            log.warning("--tune skipped: the libraries for mcpu %s cannot run on this machine to be timed",
                        cpu_name(plan.target))
        if plan.runs_here:
            use_all_cores()
        # Validate what ships: the weights as read back from the artifact's files (`weight_files` None: a
        # candidate of `auto` or the int8 plan, none chosen to ship yet, its weights the arrays the files
        # are written from once it is).
        self.weights = {}
        if plan.runs_here:
            self.weights = ({s: weight_tensors(variant.weights, self.device) for s, variant in variants.items()}
                            if weight_files is None else
                            {s: load_weights(staging / entry.file, entry.names, self.device)
                             for s, entry in weight_files.items()})

    def start(self, name: str, shape_module: Callable[[tvm.IRModule], tvm.IRModule],
              workloads: list[Workload], validation_shapes: list[AnyBucket], static: bool = True) -> Candidates:
        """Start the library's build once per strategy in the workers (`built` waits for them). A
        library already in the staging directory (auto's chosen candidate, `reuse`) is not built again."""
        libraries, builds = {}, []
        for strategy, variant in self.variants.items():
            library = libraries[strategy] = f"lib/{name}.{strategy}.so"
            if (self.staging / library).is_file():
                continue
            tuned = None
            if self.tuner is not None and static:  # tuning times kernels: alone on the machine
                self.workers.idle()
                self.tuner.tune(name, shape_module(variant.mod), self.config.tune / len(self.variants))
                tuned = self.tuner.database
            builds.append(str(self.staging / library))
            self.workers.submit(builds[-1], functools.partial(
                _build, shape_module, variant.mod, self.target, self.staging / library,
                cuda_graph=self.config.cuda_graph and static, tuned=tuned,
                kernels=self.arithmetic.kernels(self.plan.capabilities)))
        timed = self.reused_latency_ms if not builds else {}
        return Candidates(name, libraries, workloads, validation_shapes, builds, latency_ms=dict(timed))

    def reuse(self, directory: Path, library: str, strategy: str, latency_ms: dict[Workload, float]) -> None:
        """`directory`'s `library` (a generic library built and measured before, of this arithmetic
        and strategy) as this builder's generic library: moved in, and not built again, nor timed
        again on the workloads of `latency_ms` (its median ms there)."""
        (directory / library).rename(self.staging / f"lib/generic.{strategy}.so")
        self.reused_seconds = self.workers.seconds.get(str(directory / library), 0.0)
        self.reused_latency_ms = latency_ms

    def built(self, candidates: Candidates) -> Candidates:
        """`candidates` once their builds are done (a failed one raises its error), with their time."""
        candidates.seconds = sum(self.workers.wait(*candidates.builds).values()) if candidates.builds else \
            self.reused_seconds
        return candidates

    def time_strategies(self, candidates: Candidates) -> None:
        """Each strategy's library timed on the first workload, on an idle machine (`Workers.idle`)."""
        self.workers.idle()
        candidates.strategy_ms = self._time_strategies(candidates.libraries, candidates.workloads[0])

    def finish(self, candidates: Candidates, strategy: str) -> BuildRecord:
        """Ship `strategy`'s library (the others are deleted), validate it, time it on every workload."""
        library = f"lib/{candidates.name}.so"
        (self.staging / candidates.libraries[strategy]).rename(self.staging / library)
        for other in set(candidates.libraries) - {strategy}:
            (self.staging / candidates.libraries[other]).unlink()
        record = BuildRecord(candidates.name, library, candidates.seconds, strategy, candidates.strategy_ms)
        for index, shape in enumerate(candidates.validation_shapes):
            record.diffs[shape.name] = self._check(record, shape, seed=self.config.seed + index)
        if self.validate:
            record.latency_ms = self._latencies(record, candidates.workloads, candidates.latency_ms)
        return record

    def runner(self, library: str, strategy: str) -> LibraryRunner:
        return LibraryRunner(self.staging / library, self.device, self.weights[strategy])

    def _time_strategies(self, libraries: dict[str, str], workload: Workload) -> dict[str, float]:
        inputs = self.inputs(workload)
        runners = {s: self.runner(library, s) for s, library in libraries.items()}
        stats = interleaved_medians({s: (lambda r=r: r(*inputs)) for s, r in runners.items()},
                                    repeats=self.config.strategy_repeats)
        return {s: round(v["median_s"] * 1e3, 3) for s, v in stats.items()}

    def inputs(self, workload: Workload) -> tuple[np.ndarray, ...]:
        rows = example_inputs(workload.batch, workload.width, self.vocab_size, seed=self.config.seed)
        return library_inputs(self.layout, tuple(x.numpy() for x in rows), workload.seq, workload.tokens)

    def _latencies(self, record: BuildRecord, workloads: list[Workload],
                   timed_before: dict[Workload, float]) -> dict[Workload, float]:
        """Median ms of the chosen library per workload; `auto`'s timing of the first and the times
        `timed_before` (a reused library's) are reused."""
        measured = {w: ms for w, ms in timed_before.items() if w in workloads}
        if record.strategy_ms is not None:
            measured[workloads[0]] = record.strategy_ms[record.strategy]
        runner = self.runner(record.library, record.strategy)
        todo = {str(index): w for index, w in enumerate(workloads) if w not in measured}
        calls = {key: (lambda x=self.inputs(w): runner(*x)) for key, w in todo.items()}
        if calls:
            measured.update({todo[key]: ms for key, ms in budgeted_medians_ms(calls).items()})
        return {w: round(ms, 4) for w, ms in measured.items()}

    def row_outputs(self, library: str, strategy: str, rows: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
        """A generic library's outputs on `rows` (`sentence_rows`' inputs; the shipped sentences unless
        given), an output row per input row."""
        info = self.plan.info
        rows = sentence_rows(info.tokenizer_file, info.max_seq) if rows is None else rows
        runner = self.runner(library, strategy)
        step = self.config.max_batch  # the generic library's bound
        chunks = [tuple(x[i:i + step] for x in rows) for i in range(0, len(rows[0]), step)]
        return np.concatenate([runner(*library_inputs(self.layout, chunk, chunk[0].shape[1])) for chunk in chunks])

    def agreement(self, library: str, strategy: str) -> dict:
        """A library against the fp32 wrapper on the rows a precision is measured on (`accuracy_rows`:
        the shipped sentences, and an embedder's random token rows): cosine (min, mean) of each
        embedding, or a classifier's top-1 agreement and largest probability difference."""
        rows = quantize.accuracy_rows(self.plan.info, self.config.model_task)
        actual = self.row_outputs(library, strategy, rows)
        expected = reference_outputs(self.wrapper, rows)
        if self.config.model_task == "classify":
            return quantize.classifier_agreement(actual, expected)
        return quantize.embedding_agreement(actual, expected)

    def precision_report(self, generic: BuildRecord, linears: int, chosen: PrecisionEntry | None,
                         measured_before: dict | None = None) -> tuple[PrecisionEntry, QuantizationEntry | None]:
        """What the linear layers compute in (`chosen`: auto's record of how) and how close the generic
        library stays to the fp32 model (`measured_before`: its accuracy, where it was measured as a
        candidate); under `min_cosine`, or int8 under its gate, the compile fails (what a precision
        costs is unknown when not run)."""
        name, attention, int8_plan = self.arithmetic.precision, self.arithmetic.attention, self.arithmetic.int8
        kernel = self.plan.capabilities.linears_kernel(name)
        entry = (chosen or PrecisionEntry(precision=name, requested=name)).model_copy(
            update={"kernel": kernel, "linears": linears})
        if attention is not None and name in precision.ROUNDED:  # auto may have shipped fp32
            entry = entry.model_copy(update={"attention": attention.entry(name)})
        measured = self.plan.measures_precisions and kernel is not None
        accuracy = (measured_before or self.agreement(generic.library, generic.strategy)) if measured else {}
        if entry.requested != "auto" and accuracy:
            failures = precision.gate_failures(name, accuracy)
            entry = entry.model_copy(update={"candidates": [PrecisionCandidate(
                precision=name, gate_failures=failures, **accuracy)]})
            if failures and name != "int8":
                log.warning("%s misses its accuracy gate on the shipped sentences: %s", name, "; ".join(failures))
        precision.refuse_missed_gate(name, accuracy, self.config.min_cosine)
        quantization = None
        if name == "int8":
            quantization = QuantizationEntry(scheme=quantize.SCHEME, kernel=kernel, linears=linears,
                                             sentences=len(ACCURACY_SENTENCES), **accuracy,
                                             **(int8_plan.manifest_fields(linears) if int8_plan else {}))
        return entry, quantization

    def embedding_ranges(self, generic: BuildRecord) -> EmbeddingRangesEntry | None:
        """The calibration of int8 / uint8 embeddings: the shipped generic library's own embeddings of
        the shipped sentences (a pooled embedding model whose libraries run here; else None)."""
        if not (self.validate and self.config.task == "embed" and not self.config.token_outputs):
            return None
        return calibration_ranges(self.row_outputs(generic.library, generic.strategy))

    def _check(self, record: BuildRecord, shape: AnyBucket, seed: int) -> float | None:
        if not self.validate:
            return None
        return checked_diff(record.name, self.runner(record.library, record.strategy), self.wrapper, shape,
                            self.vocab_size, seed, self.config.tolerance_for(self.arithmetic.precision), self.layout,
                            relative=self.arithmetic.precision in RELATIVE_TOLERANCES)


_REFERENCE_OUTPUTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def reference_outputs(wrapper: torch.nn.Module, rows: tuple[np.ndarray, ...]) -> np.ndarray:
    """The fp32 wrapper's outputs on `rows`, computed once per wrapper and rows: every candidate
    library of a compile (auto's, the int8 plan's, the shipped one) is measured against them."""
    cached = _REFERENCE_OUTPUTS.get(wrapper)
    if cached is None or not all(np.array_equal(a, b) for a, b in zip(cached[0], rows)):
        with torch.no_grad():
            remember_reference_outputs(wrapper, rows, wrapper(*(torch.from_numpy(x) for x in rows)).float().numpy())
    return _REFERENCE_OUTPUTS[wrapper][1]


def remember_reference_outputs(wrapper: torch.nn.Module, rows: tuple[np.ndarray, ...], outputs: np.ndarray) -> None:
    """`reference_outputs` of `wrapper` on `rows`, computed already (by the int8 plan's calibration)."""
    _REFERENCE_OUTPUTS[wrapper] = (rows, outputs)


def build_libraries(builder: LibraryBuilder, config: CompileConfig, plan: Plan,
                    progress: Progress) -> tuple[list[BuildRecord], str]:
    """Every bucket's library and the generic one, built per strategy in the workers, the strategy
    chosen, then validated and timed: (records, generic last; the shared strategy)."""
    with progress.step(f"build {len(plan.buckets) + 1} libraries x {len(builder.variants)} strategies in "
                       f"{builder.workers.limit} worker processes", "build"):
        pending = [builder.start(f"bucket_{bucket.name}", functools.partial(specialize, bucket=bucket),
                                 bucket_workloads(bucket), [bucket]) for bucket in plan.buckets]
        generic_workloads = cost_model_workloads(config.max_batch, plan.info.max_seq)
        first = Workload.full(plan.generic_shapes[0].batch, plan.generic_shapes[0].seq)  # `auto` chooses on it
        workloads = [first] + [w for w in generic_workloads if w != first]
        pending.append(builder.start("generic", unshaped, workloads, plan.generic_shapes, static=False))
        builder.workers.idle()
        for candidates in pending:
            progress.note(f"{candidates.name}: built in {builder.built(candidates).seconds:.1f} s")
    with OtherLoad() as timing:  # the libraries are timed in here (strategies, then each finish)
        for candidates in pending:
            if len(candidates.libraries) > 1:
                builder.time_strategies(candidates)
        chosen, shared_strategy = choose_strategies(pending, config.strategy_margin)
        records = []
        for candidates in pending:
            shapes = ", ".join(shape.name for shape in candidates.validation_shapes)
            with progress.step(f"validate + time {candidates.name} ({chosen[candidates.name]}) on {shapes}",
                               "validate+time"):
                records.append(builder.finish(candidates, chosen[candidates.name]))
    if timing.cores > OTHER_LOAD_WARNING_CORES:
        log.warning("other work kept %.1f cores busy while the libraries were timed: the manifest's "
                    "latencies and cost models, which the server's batch planner uses, are too high; "
                    "compile on an otherwise idle machine", timing.cores)
    return records, shared_strategy


def unshaped(mod: tvm.IRModule) -> tvm.IRModule:
    """The generic library's module: its batch and seq stay symbolic."""
    return mod
