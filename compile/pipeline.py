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
    QuantizationEntry,
    SparsityEntry,
    StrategyChoice,
    StrategyPasses,
    TargetEntry,
    WeightsEntry,
)

from .build import build_library, check_mcpu, make_target, specialize
from .checkpoint import TOKENIZER_FILES, CheckpointInfo, example_inputs, inspect_checkpoint, load_wrapper
from .config import CompileConfig
from .errors import CompileError, ValidationError
from .importer import export_and_import
from .kernels import int8
from .kernels.common import vector_lanes
from .opcount import tracked_counts
from .passes import quantize
from .passes.fuse_attention import fuse_attention_in
from .passes.lift import LiftedModel, lift_and_transform
from .passes.packing import pack_linear_weights
from .passes.precision import to_precision
from .passes.quantize import quantize_linears, sentence_rows
from .passes.sparsity import prune_model, sparsify
from .passes.strategy import PASSES, STRATEGIES, apply_strategy
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
                    ", ".join(missing), (target.host or target).attrs["mcpu"])
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
                 vocab_size: int, can_run: bool | None = None):
        self.config = config
        self.staging = staging
        self.variants = variants
        self.wrapper = wrapper
        self.vocab_size = vocab_size
        self.target = target
        self.device = device_for(config.target)
        self.can_run = bool(self.device.exist) if can_run is None else can_run
        self.layout = config.layout
        self.validate = config.validate_artifacts and self.can_run
        # Libraries are timed (for the server's batch planner) when validated, with every core:
        # as a server runs them. `validate: false` skips both.
        self.timed = self.validate
        # --tune times kernels, so it runs only where the libraries can run
        self.tuner = Tuner(target) if config.tune and self.can_run else None
        if config.tune and not self.can_run:
            log.warning("--tune skipped: the libraries for mcpu %s cannot run on this machine to be timed",
                        (target.host or target).attrs["mcpu"])
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
                          tuned=self.tuner.database if self.tuner is not None else None)
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

    def _runner(self, library: str, strategy: str) -> LibraryRunner:
        return LibraryRunner(self.staging / library, self.device, self.weights[strategy])

    def _time_strategies(self, libraries: dict[str, str], workload: Workload) -> dict[str, float] | None:
        if len(libraries) == 1:
            return None
        inputs = self._inputs(workload)
        runners = {s: self._runner(library, s) for s, library in libraries.items()}
        stats = interleaved_medians({s: (lambda r=r: r(*inputs)) for s, r in runners.items()},
                                    repeats=self.config.strategy_repeats)
        return {s: round(v["median_s"] * 1e3, 3) for s, v in stats.items()}

    def _inputs(self, workload: Workload) -> tuple[np.ndarray, ...]:
        rows = example_inputs(workload.batch, workload.width, self.vocab_size, seed=self.config.seed)
        return library_inputs(self.layout, tuple(x.numpy() for x in rows), workload.seq, workload.tokens)

    def _latencies(self, record: BuildRecord, workloads: list[Workload]) -> dict[Workload, float]:
        """Median ms of the chosen library per workload; `auto`'s timing of the first is reused."""
        measured = {}
        if record.strategy_ms is not None:
            measured[workloads[0]] = record.strategy_ms[record.strategy]
        runner = self._runner(record.library, record.strategy)
        todo = {str(index): w for index, w in enumerate(workloads) if w not in measured}
        calls = {key: (lambda x=self._inputs(w): runner(*x)) for key, w in todo.items()}
        if calls:
            measured.update({todo[key]: ms for key, ms in budgeted_medians_ms(calls).items()})
        return {w: round(ms, 4) for w, ms in measured.items()}

    def quantization_report(self, generic: BuildRecord, info: CheckpointInfo, linears: int,
                            kernel: int8.Int8Kernel) -> QuantizationEntry:
        """The int8 generic library against the fp32 wrapper on real sentences; an embedding model
        under `min_cosine` fails the compile (what the quantization costs is unknown when not run)."""
        entry = QuantizationEntry(scheme=quantize.SCHEME, kernel=kernel.description, linears=linears,
                                  sentences=len(ACCURACY_SENTENCES))
        if not self.validate:
            return entry
        rows = sentence_rows(info.path / "tokenizer.json", info.max_seq)
        runner = self._runner(generic.library, generic.strategy)
        step = self.config.max_batch  # the generic library's bound
        chunks = [tuple(x[i:i + step] for x in rows) for i in range(0, len(rows[0]), step)]
        actual = np.concatenate([runner(*library_inputs(self.layout, chunk, chunk[0].shape[1])) for chunk in chunks])
        with torch.no_grad():
            expected = self.wrapper(*(torch.from_numpy(x) for x in rows)).float().numpy()
        if self.config.model_task == "classify":
            return entry.model_copy(update=quantize.classifier_agreement(actual, expected))
        entry = entry.model_copy(update=quantize.embedding_agreement(actual, expected))
        if entry.cosine_min < self.config.min_cosine:
            raise ValidationError(f"int8 embeddings reach cosine {entry.cosine_min:.6f} to the fp32 model's on "
                                  f"the shipped sentences, under --min-cosine {self.config.min_cosine:g}")
        return entry

    def _check(self, record: BuildRecord, shape: AnyBucket, seed: int) -> float | None:
        if not self.validate:
            return None
        return checked_diff(record.name, self._runner(record.library, record.strategy), self.wrapper, shape,
                            self.vocab_size, seed, self.config.effective_tolerance, self.layout,
                            relative=self.config.quantize == "int8")


def compile_model(config: CompileConfig, progress: Progress | None = None) -> tuple[Manifest, list[BuildRecord]]:
    """Compile `config.model` into an artifact directory at `config.out`, atomically."""
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
    int8_kernel = int8.kernel_for(target) if config.quantize == "int8" else None
    if config.quantize == "int8" and int8_kernel is None:
        raise CompileError(f"--quantize int8 needs a CPU with AVX2; mcpu {target.attrs['mcpu']} has none")
    cpu_features = target_features(target)
    can_run = runs_here(config.target, target, cpu_features)
    strategies = [config.strategy]
    if config.strategy == "auto":  # timing needs to run the libraries; where they cannot, build one strategy only
        strategies = list(STRATEGIES) if can_run else [UNTIMED_AUTO_STRATEGY]
    progress = progress or Progress(0, quiet=True)
    progress.set_total(4 + 2 * (len(buckets) + 1))
    vocab_size = int(info.config["vocab_size"])

    with atomic_directory(config.out) as staging:
        with progress.step(f"load {info.path.name} ({config.task})"):
            wrapper = load_wrapper(info, config.model_task)
            sparsity = None
            if config.prunes:
                sparsity = _prune(wrapper, info, config)
            elif config.sparsity == "from-checkpoint":  # the weights as they are: nothing to prune or drift
                sparsity = {"mode": "from-checkpoint", "block": list(config.block_shape()), "layers": [],
                            "pruned": 0, "cosine_vs_dense": None}
            # The oracle runs in the artifact's precision, on the same (possibly pruned) weights.
            reference = wrapper if config.dtype == "float32" else copy.deepcopy(wrapper).to(getattr(torch, config.dtype))
        with progress.step("torch.export + Relax import (dynamic batch, seq)"):
            imported = export_and_import(wrapper, config.max_batch, info.max_seq, vocab_size, config.layout)
        with progress.step(f"passes for strategy {', '.join(strategies)}; lift weights"):
            variants, passes = {}, {}
            for strategy in strategies:
                combined, params = apply_strategy(imported.mod, strategy), imported.params
                if sparsity is not None:
                    combined, params, report = sparsify(combined, params, config.block_shape(),
                                                        config.sparse_max_density, target,
                                                        timed=config.sparse_choice == "timed" and can_run
                                                        and config.target == "cpu")
                    sparsity.update(density=report["density"], rewritten=report["rewritten"],
                                    kept_dense=report["kept_dense"], choice=report["choice"],
                                    choices=report["choices"])
                combined = to_precision(combined, config.dtype)
                packed, pipeline = combined, list(PASSES[strategy])
                if config.quantize == "int8":  # int8 panels; what is left (if any) stays fp32
                    packed, quantized_linears = quantize_linears(packed, int8_kernel)
                    pipeline.insert(-1, "QuantizeLinearsInt8")
                if config.target == "cpu":  # weights in the CPU kernel's panel layout, packed at load
                    packed, _ = pack_linear_weights(packed, vector_lanes(target))
                    pipeline.insert(-1, "PackLinearWeights")
                variants[strategy] = lift_and_transform(packed, params)
                attention_fused = None
                if config.target == "cpu":  # what each library's build will fuse (FuseAttention runs there)
                    attention_fused = fuse_attention_in(variants[strategy].mod, vector_lanes(target))[1]
                    pipeline.append("FuseAttention")
                passes[strategy] = StrategyPasses(
                    pipeline=pipeline,
                    after=PassCounts(**tracked_counts(combined)),
                    main_after_lift=PassCounts(**tracked_counts(variants[strategy].mod)),
                    attention_fused=attention_fused,
                )
        with progress.step("copy tokenizer"):
            _copy_tokenizer(info.path, staging / TOKENIZER_DIR)
        (staging / "lib").mkdir()
        weight_files = {strategy: save_weights(staging, strategy, variant) for strategy, variant in variants.items()}
        builder = LibraryBuilder(config, target, staging, variants, weight_files, reference, vocab_size, can_run)
        with OtherLoad() as timing:  # the libraries are timed in here (strategies, then each finish)
            pending = []
            for bucket in buckets:
                with progress.step(f"build bucket {bucket.name}"):
                    pending.append(builder.build(f"bucket_{bucket.name}", lambda m, b=bucket: specialize(m, b),
                                                 bucket_workloads(bucket), [bucket]))
            with progress.step("build generic library"):
                generic_workloads = cost_model_workloads(config.max_batch, info.max_seq)
                first = Workload.full(generic_shapes[0].batch, generic_shapes[0].seq)  # `auto` chooses on it
                workloads = [first] + [w for w in generic_workloads if w != first]
                pending.append(builder.build("generic", lambda m: m, workloads, generic_shapes, static=False))
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
        generic = records[-1]
        quantization = None
        if config.quantize == "int8":
            with progress.step("int8 accuracy against the fp32 model on the shipped sentences"):
                quantization = builder.quantization_report(generic, info, quantized_linears, int8_kernel)
        used = {r.strategy for r in records}
        for strategy in set(weight_files) - used:
            (staging / weight_files.pop(strategy).file).unlink()

        def library_fields(record: BuildRecord) -> dict:
            return {"library": record.library, "sha256": file_sha256(staging / record.library),
                    "strategy": record.strategy, "strategy_ms": record.strategy_ms}

        manifest = Manifest(
            task=config.model_task,
            target=TargetEntry(
                kind=config.target,
                tvm_target=str(builder.target),
                mcpu=str((builder.target.host or builder.target).attrs["mcpu"]),
                cuda_arch=config.cuda_arch if config.target == "cuda" else None,
                cuda_graph=config.cuda_graph,
                cpu_features=cpu_features,
            ),
            model=ModelEntry(
                path=str(info.path),
                weights_sha256=info.weights_sha256(),
                model_type=info.config["model_type"],
                architecture=(info.config.get("architectures") or ["BertModel"])[0],
                hidden_size=info.hidden_size,
                max_position_embeddings=info.max_seq,
                vocab_size=vocab_size,
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
                for b, r in zip(buckets, records)
            ],
            generic=GenericEntry(max_batch=config.max_batch, max_seq=info.max_seq, max_abs_diff=generic.diffs,
                                 cost_model=generic.cost_model(), **library_fields(generic)),
            passes=PassesEntry(before=PassCounts(**tracked_counts(imported.mod)), strategies=passes),
            strategy_choice=(StrategyChoice(shared=shared_strategy, margin=config.strategy_margin)
                             if len(strategies) > 1 else None),
            sparsity=SparsityEntry(**sparsity) if sparsity is not None else None,
            quantization=quantization,
            tuning=builder.tuner.save(staging, config.tune) if builder.tuner is not None else None,
            validated=builder.validate,
            validated_on=device_name(builder.device) if builder.validate else None,
            tolerance=config.effective_tolerance,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.write(staging)
    return manifest, records


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
