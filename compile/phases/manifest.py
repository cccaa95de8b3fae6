"""The last phase: the artifact's manifest, what was built, for which CPU, how it was chosen and validated."""

from __future__ import annotations

from datetime import datetime, timezone

import torch
import transformers
import tvm

from artifact.bucketing import Bucket, PackedBucket
from artifact.hashing import file_sha256
from artifact.loader import device_name
from artifact.manifest import (
    BucketEntry,
    EmbeddingRangesEntry,
    GenericEntry,
    Manifest,
    ModelEntry,
    PassesEntry,
    PrecisionEntry,
    QuantizationEntry,
    SparsityEntry,
    StrategyChoice,
    TargetEntry,
    WeightsEntry,
)

from ..checkpoint import CheckpointInfo
from ..config import CompileConfig
from ..plan import Plan
from .libraries import BuildRecord, LibraryBuilder, bucket_workloads
from .load import TOKENIZER_DIR
from .transform import Variants

SPARSE_REPORT = ("density", "rewritten", "kept_dense", "choice", "choices")  # the sparse pass's manifest fields


def target_entry(config: CompileConfig, plan: Plan) -> TargetEntry:
    return TargetEntry(kind=config.target, tvm_target=str(plan.target),
                       mcpu=str((plan.target.host or plan.target).attrs["mcpu"]),
                       cuda_arch=config.cuda_arch if config.target == "cuda" else None,
                       cuda_graph=config.cuda_graph, cpu_features=list(plan.cpu_features))


def model_entry(info: CheckpointInfo) -> ModelEntry:
    return ModelEntry(path=str(info.path), weights_sha256=info.weights_sha256(), model_type=info.config["model_type"],
                      architecture=(info.config.get("architectures") or ["BertModel"])[0],
                      hidden_size=info.hidden_size, max_position_embeddings=info.max_seq,
                      vocab_size=int(info.config["vocab_size"]), pad_token_id=int(info.config.get("pad_token_id") or 0))


def sparsity_entry(loaded: dict | None, variants: Variants) -> SparsityEntry | None:
    """What pruning recorded at load, and what the sparse pass rewrote."""
    if loaded is None:
        return None
    report = variants.sparsity or {}
    return SparsityEntry(**{**loaded, **{key: report[key] for key in SPARSE_REPORT if key in report}})


def assemble_manifest(config: CompileConfig, plan: Plan, builder: LibraryBuilder, variants: Variants,
                      records: list[BuildRecord], weight_files: dict[str, WeightsEntry], shared_strategy: str,
                      sparsity: dict | None, precision_entry: PrecisionEntry,
                      quantization: QuantizationEntry | None,
                      embedding_ranges: EmbeddingRangesEntry | None) -> Manifest:
    """The artifact's manifest: what was built, for which CPU, how it was chosen and validated."""
    info, staging, generic = plan.info, builder.staging, records[-1]

    def library_fields(record: BuildRecord) -> dict:
        return {"library": record.library, "sha256": file_sha256(staging / record.library),
                "strategy": record.strategy, "strategy_ms": record.strategy_ms}

    return Manifest(
        task=config.model_task,
        target=target_entry(config, plan),
        model=model_entry(info),
        dtype=config.dtype,
        layout=config.layout,
        pooling=info.pooling,
        labels=info.labels,
        problem_type=info.config.get("problem_type") if config.model_task == "classify" else None,
        output_dim=info.output_dim,
        token_dim=info.token_dim,
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
                             cost_model=generic.cost_model(), **library_fields(generic),
                             takes_bounded_batches=config.layout == "packed" and info.family.bias_at_bound),
        passes=PassesEntry(before=variants.before, strategies=variants.passes),
        strategy_choice=(StrategyChoice(shared=shared_strategy, margin=config.strategy_margin)
                         if len(plan.strategies) > 1 else None),
        sparsity=sparsity_entry(sparsity, variants),
        quantization=quantization,
        precision=precision_entry,
        tuning=builder.tuner.save(staging, config.tune) if builder.tuner is not None else None,
        embedding_ranges=embedding_ranges,
        validated=builder.validate,
        validated_on=device_name(builder.device) if builder.validate else None,
        tolerance=config.tolerance_for(builder.arithmetic.precision),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
