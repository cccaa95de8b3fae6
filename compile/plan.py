"""What a compile will build, decided and refused before anything is loaded or written: a frozen `Plan`.

Every fact the phases read more than once is computed here, once: the target and what its CPU
offers, whether this machine can run (and so validate and time) its libraries, which precisions
`auto` measures, which strategies are built. Decisions that need the loaded model (attention's
products, the int8 plan, auto's precision) are values the phases return (phases/decisions.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import tvm

from artifact.bucketing import AnyBucket, Bucket
from artifact.cpu_features import missing_on_host, target_features
from artifact.loader import device_for

from . import attention_products
from .build import check_mcpu, make_target
from .capabilities import Capabilities, KernelConfig, cpu_name
from .checkpoint import CheckpointInfo, inspect_checkpoint
from .config import CompileConfig
from .errors import CompileError
from .passes.strategy import STRATEGIES

if TYPE_CHECKING:
    from .int8_plan import Int8Plan

UNTIMED_AUTO_STRATEGY = "concat"  # what `auto` builds when it cannot time (CUDA without a GPU)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What a compile will build, checked before anything is written; never changed afterwards."""

    info: CheckpointInfo
    target: tvm.target.Target
    buckets: tuple[AnyBucket, ...]
    generic_shapes: tuple[Bucket, ...]
    capabilities: Capabilities  # what the target's CPU runs, asked once
    cpu_features: tuple[str, ...]  # the manifest's record of the features its code may use
    runs_here: bool  # this machine can run the libraries (device present, every CPU feature here)
    measures: bool  # and they are validated and timed here (`validate_artifacts`)
    requested_precision: str  # `--precision` as asked ("auto" included); the chosen one is a decision
    token_outputs: bool  # no sentence vector: no precision can be measured by one
    strategies: tuple[str, ...]

    @property
    def precision_candidates(self) -> list[str]:
        """The precisions this target runs: what `auto` measures."""
        return self.capabilities.precisions

    @property
    def measures_precisions(self) -> bool:
        """Whether a reduced precision's library is measured against the fp32 model here."""
        return self.measures and not self.token_outputs

    @property
    def chooses_attention(self) -> bool:
        """Attention's products are chosen beside bf16 / int8 linears (CPU, a reduced precision asked)."""
        return self.target.kind.name == "llvm" and self.requested_precision != "fp32"

    @property
    def plans_int8(self) -> bool:
        """int8 is asked, or is one of the candidates `auto` measures."""
        return self.requested_precision == "int8" or (
            self.requested_precision == "auto" and self.measures_precisions and "int8" in self.precision_candidates)

    @property
    def checks_int8(self) -> bool:
        """`--precision int8`: its plan's library is built and measured before the buckets (auto checks its own)."""
        return self.requested_precision == "int8" and self.measures_precisions

    @property
    def candidate_strategy(self) -> str:
        """The strategy a candidate library is built in: the one planned, or `auto`'s untimed default."""
        return self.strategies[0] if len(self.strategies) == 1 else UNTIMED_AUTO_STRATEGY


@dataclass(frozen=True)
class Arithmetic:
    """What the libraries compute in, decided once the model is loaded: the linears' precision (the
    chosen one, where `Plan.requested_precision` is what was asked), attention's products beside
    them (None: fp32 only) and int8's plan (which linears it smooths and keeps out)."""

    precision: str
    attention: attention_products.AttentionChoice | None = None
    int8: Int8Plan | None = None

    @property
    def products(self) -> str:
        """The arithmetic of the fused attention kernel's products in these libraries."""
        return self.attention.for_precision(self.precision) if self.attention is not None else "fp32"

    def kernels(self, capabilities: Capabilities) -> KernelConfig:
        """What the kernels of these libraries are written for."""
        return KernelConfig(capabilities, linears=self.precision, products=self.products)

    def but(self, **changes) -> "Arithmetic":
        """A new value with `changes` (this one stays as it is)."""
        return replace(self, **changes)


def libraries_run_here(kind: str, target: tvm.target.Target, features: tuple[str, ...]) -> bool:
    """Whether this machine can run the target's libraries: its device is present and its CPU has
    every feature the (host) code may use. Cross-compiled ones are built, not validated or timed."""
    if not device_for(kind).exist:
        return False
    missing = missing_on_host(list(features))
    if missing:
        log.warning("this CPU lacks %s, which code for %s may use: the libraries are built but neither "
                    "validated nor timed here (run `python -m compile.verify` where they will run)",
                    ", ".join(missing), cpu_name(target))
        return False
    return True


def check_shapes(config: CompileConfig, info: CheckpointInfo) -> tuple[list[AnyBucket], list[Bucket]]:
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


def check_model(config: CompileConfig, info: CheckpointInfo) -> None:
    """Refuse a task or layout the checkpoint cannot take."""
    if config.task == "rerank" and len(info.labels) != 1:
        raise CompileError(f"--task rerank needs a cross-encoder with one label; {info.path.name} has "
                           f"{len(info.labels)} ({', '.join(info.labels)}): use --task classify")
    if config.layout == "packed" and info.config.get("position_embedding_type", "absolute") != "absolute":
        raise CompileError("layout packed needs absolute position embeddings; this checkpoint has "
                           f"{info.config['position_embedding_type']}")


def check_target(config: CompileConfig) -> tuple[tvm.target.Target, Capabilities]:
    """The target and what its CPU runs, refused where it cannot run the precision or attention's
    products asked for."""
    check_mcpu(config.mcpu)
    target = make_target(config.target, config.cuda_arch, config.mcpu)
    capabilities = Capabilities.of(target)
    if config.precision != "auto" and (problem := capabilities.refusal(config.precision)):
        raise CompileError(problem)
    if problem := attention_products.refusal(config.attention_products, capabilities):
        raise CompileError(problem)
    return target, capabilities


def plan_compile(config: CompileConfig) -> Plan:
    """Refuse what cannot be built (shapes, layout, CPU, precision) and decide what will be."""
    info = inspect_checkpoint(config.model_dir(), config.model_task, config.pooling)
    check_model(config, info)
    buckets, generic_shapes = check_shapes(config, info)
    target, capabilities = check_target(config)
    cpu_features = tuple(target_features(target))
    here = libraries_run_here(config.target, target, cpu_features)
    strategies = (config.strategy,)
    if config.strategy == "auto":  # timing needs to run the libraries; where they cannot, build one strategy only
        strategies = STRATEGIES if here else (UNTIMED_AUTO_STRATEGY,)
    return Plan(info=info, target=target, buckets=tuple(buckets), generic_shapes=tuple(generic_shapes),
                capabilities=capabilities, cpu_features=cpu_features,
                runs_here=here, measures=here and config.validate_artifacts, requested_precision=config.precision,
                token_outputs=config.token_outputs, strategies=tuple(strategies))
