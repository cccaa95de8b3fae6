"""The compile pipeline: checkpoint -> Relax -> passes -> per-bucket + generic libraries -> artifact."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
import tvm

from .artifact import atomic_directory
from .bucketing import Bucket
from .build import build_library, make_target, specialize
from .canonicalize import canonicalize
from .checkpoint import TOKENIZER_FILES, CheckpointInfo, file_sha256, inspect_checkpoint, load_wrapper
from .combine import combine_parallel_matmuls
from .config import CompileConfig
from .errors import CompileError, ValidationError
from .importer import export_and_import
from .lift import lift_and_transform
from .loader import LibraryRunner, device_for
from .manifest import (
    BucketEntry,
    GenericEntry,
    Manifest,
    ModelEntry,
    PassCounts,
    PassesEntry,
    TargetEntry,
    WeightsEntry,
)
from .opcount import tracked_counts
from .progress import Progress
from .validate import max_abs_diff

PASS_PIPELINE = ["CanonicalizeForCombine", "CombineParallelMatmuls", "LiftTransformParams"]
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"


@dataclass
class BuildRecord:
    """One built library, for the summary table."""

    name: str
    library: str
    seconds: float
    diffs: dict[str, float | None] = field(default_factory=dict)


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


def compile_model(config: CompileConfig, progress: Progress | None = None) -> tuple[Manifest, list[BuildRecord]]:
    """Compile `config.model` into an artifact directory at `config.out`, atomically."""
    info = inspect_checkpoint(config.model_dir(), config.task, config.pooling)
    buckets, generic_shapes = check_shapes(config, info)
    target = make_target(config.target, config.cuda_arch, config.mcpu)
    device = device_for(config.target)
    validate = config.validate_artifacts and device.exist
    progress = progress or Progress(0, quiet=True)
    progress.set_total(4 + len(buckets) + 1)
    vocab_size = int(info.config["vocab_size"])
    records: list[BuildRecord] = []

    with atomic_directory(config.out) as staging:
        with progress.step(f"load {info.path.name} ({config.task})"):
            wrapper = load_wrapper(info, config.task)
        with progress.step("torch.export + Relax import (dynamic batch, seq)"):
            imported = export_and_import(wrapper, config.max_batch, info.max_seq, vocab_size)
        with progress.step("passes: canonicalise, combine parallel matmuls, lift weights"):
            before = tracked_counts(imported.mod)
            mod = combine_parallel_matmuls()(canonicalize()(imported.mod))
            after = tracked_counts(mod)
            lifted = lift_and_transform(mod, imported.params)
            main_after_lift = tracked_counts(lifted.mod)
        with progress.step("write weights and tokenizer"):
            weights_path = staging / WEIGHTS_FILE
            _save_weights(weights_path, lifted.weight_names, lifted.weights)
            _copy_tokenizer(info.path, staging / TOKENIZER_DIR)
            device_weights = [tvm.runtime.tensor(w, device) for w in lifted.weights] if validate else []
        (staging / "lib").mkdir()

        def build_and_check(name: str, module: tvm.IRModule, shapes: list[Bucket]) -> BuildRecord:
            library = f"lib/{name}.so"
            started = time.perf_counter()
            build_library(module, target, staging / library)
            record = BuildRecord(name, library, time.perf_counter() - started)
            for index, shape in enumerate(shapes):
                diff = None
                if validate:
                    runner = LibraryRunner(staging / library, device, device_weights)
                    diff = max_abs_diff(runner, wrapper, shape, vocab_size, seed=config.seed + index)
                    if not diff <= config.tolerance:
                        raise ValidationError(
                            f"{name} at {shape.name}: max |tvm - torch| = {diff:.3g} exceeds tolerance {config.tolerance:g}"
                        )
                record.diffs[shape.name] = diff
            records.append(record)
            return record

        bucket_entries = []
        for bucket in buckets:
            with progress.step(f"build + validate bucket {bucket.name}"):
                record = build_and_check(f"bucket_{bucket.name}", specialize(lifted.mod, bucket), [bucket])
            bucket_entries.append(
                BucketEntry(
                    batch=bucket.batch,
                    seq=bucket.seq,
                    library=record.library,
                    sha256=file_sha256(staging / record.library),
                    max_abs_diff=record.diffs[bucket.name],
                )
            )
        with progress.step(f"build + validate generic library on {', '.join(s.name for s in generic_shapes)}"):
            record = build_and_check("generic", lifted.mod, generic_shapes)
        manifest = Manifest(
            task=config.task,
            target=TargetEntry(
                kind=config.target,
                tvm_target=str(target),
                mcpu=str(target.host.attrs["mcpu"]) if target.host else str(target.attrs["mcpu"]),
                cuda_arch=config.cuda_arch if config.target == "cuda" else None,
            ),
            model=ModelEntry(
                path=str(info.path),
                weights_sha256=info.weights_sha256(),
                architecture=(info.config.get("architectures") or ["BertModel"])[0],
                hidden_size=info.hidden_size,
                max_position_embeddings=info.max_seq,
                vocab_size=vocab_size,
                pad_token_id=int(info.config.get("pad_token_id") or 0),
            ),
            pooling=info.pooling,
            labels=info.labels,
            output_dim=len(info.labels) if config.task == "classify" else info.hidden_size,
            tvm_version=tvm.__version__,
            torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            tokenizer=TOKENIZER_DIR,
            weights=WeightsEntry(file=WEIGHTS_FILE, sha256=file_sha256(weights_path), names=lifted.weight_names),
            buckets=bucket_entries,
            generic=GenericEntry(
                library=record.library,
                sha256=file_sha256(staging / record.library),
                max_batch=config.max_batch,
                max_seq=info.max_seq,
                max_abs_diff=record.diffs,
            ),
            passes=PassesEntry(
                pipeline=PASS_PIPELINE,
                before=PassCounts(**before),
                after=PassCounts(**after),
                main_after_lift=PassCounts(**main_after_lift),
            ),
            validated=validate,
            tolerance=config.tolerance,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.write(staging)
    return manifest, records


def _save_weights(path: Path, names: list[str], weights: list) -> None:
    from safetensors.numpy import save_file

    save_file(dict(zip(names, weights)), str(path))


def _copy_tokenizer(model_dir: Path, destination: Path) -> None:
    destination.mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, destination / name)
