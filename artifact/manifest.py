"""The artifact manifest: the one description of a compiled artifact directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bucketing import AnyBucket, Bucket, PackedBucket
from .errors import ArtifactError

SCHEMA_VERSION = 1
# SPLADE: max (SPLADE v2 on) or sum over the real tokens of log(1 + relu(MLM logits)), [batch, vocab]
SPLADE_POOLINGS = ("splade", "splade-sum")
MANIFEST_FILE = "manifest.json"
# The BERT family members compile/families.py compiles, by their config.json `model_type`: known here, without
# torch, so that a Hub model of another family is refused before anything is downloaded or compiled.
MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "modernbert", "deberta-v2")
# huggingface_hub's cache holds a repository's commit as models--ORG--NAME/snapshots/COMMIT
HUB_SNAPSHOT = re.compile(r"/models--(?P<folder>[\w.-]+)/snapshots/(?P<sha>[0-9a-f]{40})$")


def remote_code_refusal(config: dict, name: str) -> str | None:
    """Why the checkpoint `name` of this config.json is not compiled, where its `auto_map` names code of its
    own (what transformers runs only with trust_remote_code: NomicBERT, GTE's "new", Jina's BERT with
    ALiBi under model_type bert), in one line; None where transformers implements it itself."""
    auto_map = config.get("auto_map")
    if not auto_map:
        return None
    code = sorted({(target[0] if isinstance(target, list) else str(target)).rsplit(".", 1)[-1]
                   for target in auto_map.values() if target})
    return (f"{name} needs trust_remote_code: its config.json maps model_type {config.get('model_type')!r} to code of "
            f"its own ({', '.join(code)}), which is not compiled; supported: {', '.join(MODEL_TYPES)}, as "
            "transformers implements them")


def hub_snapshot(path: str | Path) -> tuple[str, str] | None:
    """(repository, commit) of a checkpoint in huggingface_hub's cache, by its path; None for another directory."""
    found = HUB_SNAPSHOT.search(Path(str(path)).as_posix())
    return None if found is None else (found["folder"].replace("--", "/"), found["sha"])


def write_json_atomically(model: BaseModel, path: Path) -> None:
    """Write `model` as JSON through a temporary file and a rename, so a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(model.model_dump_json(indent=2) + "\n")
    partial.replace(path)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TargetEntry(_Strict):
    kind: Literal["cpu", "cuda"]
    tvm_target: str
    mcpu: str | None = None
    cuda_arch: str | None = None
    cuda_graph: bool = False
    # x86 features (LLVM names, artifact/cpu_features.py) the CPU code needs: the CPU libraries', or a
    # CUDA artifact's host code. The loader refuses the artifact on a CPU that lacks one (else SIGILL).
    cpu_features: list[str] = Field(default_factory=list)


class ModelEntry(_Strict):
    path: str
    weights_sha256: str
    model_type: str = "bert"  # the family: one of MODEL_TYPES
    architecture: str
    hidden_size: int
    max_position_embeddings: int
    vocab_size: int
    pad_token_id: int
    # the Hub repository and commit the checkpoint was downloaded at (None: a checkpoint of a local directory)
    repo_id: str | None = None
    sha: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _hub_source(cls, data: dict) -> dict:
        """A checkpoint in huggingface_hub's cache names its repository and commit by its path."""
        found = hub_snapshot(data.get("path", "")) if isinstance(data, dict) else None
        if found is None or data.get("repo_id") is not None:
            return data
        return {**data, "repo_id": found[0], "sha": found[1]}


class LibraryEntry(_Strict):
    library: str
    sha256: str
    strategy: str  # how parallel matmuls are combined in this library; selects its weight set
    strategy_ms: dict[str, float] | None = None  # per-strategy median ms when chosen by `auto`


class CostModel(_Strict):
    """A library's measured latency, fitted over a few shapes (non-negative terms):
    ms = fixed_ms + per_token_ms * tokens + per_attention_ms * batch * seq^2, where tokens are the
    rows the linear layers compute (batch * seq when padded) and seq is what attention pads to."""

    fixed_ms: float
    per_token_ms: float
    per_attention_ms: float

    def predicted_ms(self, batch: int, seq: int, tokens: int | None = None) -> float:
        tokens = batch * seq if tokens is None else tokens
        return self.fixed_ms + self.per_token_ms * tokens + self.per_attention_ms * batch * seq * seq


class BucketEntry(LibraryEntry):
    batch: int | None  # None: a packed library (any number of sequences of up to `seq` tokens)
    seq: int
    max_abs_diff: float | None
    latency_ms: float | None = None  # median ms of one call at the bucket's shape, measured at compile time
    cost_model: CostModel | None = None  # a packed library's latency over token and sequence counts

    @property
    def bucket(self) -> AnyBucket:
        return PackedBucket(self.seq) if self.batch is None else Bucket.of(self.batch, self.seq)


class GenericEntry(LibraryEntry):
    max_batch: int
    max_seq: int
    max_abs_diff: dict[str, float | None]
    cost_model: CostModel | None = None  # None: not timed (not validated, or no device to run on)
    # packed: the family's bounds compute a score bias at the bound (DeBERTa's disentangled terms), so a
    # short input costs a bound nearly what a full one does, and the planner may run a batch a bound
    # holds here instead (artifact/costs.py's GENERIC_MARGIN); else the tightest bound runs it
    takes_bounded_batches: bool = False


class WeightsEntry(_Strict):
    file: str
    sha256: str
    names: list[str]


class PassCounts(_Strict):
    matmul: int
    concat: int
    permute_dims: int


class StrategyPasses(_Strict):
    pipeline: list[str]
    after: PassCounts
    main_after_lift: PassCounts
    attention_fused: int | None = None  # attention cores on the fused CPU kernel, per library (None: not CPU)


class StrategyChoice(_Strict):
    """How `auto` traded memory for speed: `shared` runs every library except those whose own
    fastest strategy beat it by more than `margin` (each strategy in use loads its own weight set)."""

    shared: str
    margin: float


class PassesEntry(_Strict):
    before: PassCounts
    strategies: dict[str, StrategyPasses]


class LinearSensitivity(_Strict):
    """A unit of linears (Q, K and V read one input: one unit) and the simulated agreement with
    the fp32 model when it alone is in int8, the rest in the higher precision (compile/int8_plan.py)."""

    unit: str
    cosine_min: float | None = None
    cosine_mean: float | None = None
    top1_agreement: float | None = None
    max_probability_diff: float | None = None


class KeptLinear(_Strict):
    """A unit of linears int8 leaves in a higher precision, and why."""

    unit: str
    precision: Literal["bf16", "fp32"]
    reason: str


class QuantizationEntry(_Strict):
    """How an int8 artifact was quantized, and how close it stays to the fp32 model on the shipped
    sentences (compile/sentences.py): cosine for embeddings, top-1 agreement for a classifier."""

    scheme: str
    kernel: str
    linears: int  # linear layers on int8 weights
    sentences: int
    cosine_min: float | None = None
    cosine_mean: float | None = None
    worst_sentence: str | None = None  # the sentence with the least cosine
    top1_agreement: float | None = None
    max_probability_diff: float | None = None
    smoothing_alpha: float | None = None  # SmoothQuant strength (0: none; compile/passes/smooth.py)
    smoothed: int = 0  # linears whose input channels are rescaled
    # the fraction of its simulated loss of cosine the plan kept to spare (compile/int8_plan.py): 0.1,
    # more where a library built on a narrower margin missed the gate and the plan was admitted again
    plan_margin: float | None = None
    kept: list[KeptLinear] = []  # linears left out of int8 ("mixed int8")
    sensitivity: list[LinearSensitivity] = []  # most lost per multiply-add first; measured where a fallback was needed


class PrecisionCandidate(_Strict):
    """One precision the compile measured: its agreement with the fp32 model on the shipped
    sentences, its median ms per call at each timed shape, and whether it kept its gate."""

    precision: Literal["fp32", "bf16", "int8"]
    cosine_min: float | None = None
    cosine_mean: float | None = None
    worst_sentence: str | None = None
    top1_agreement: float | None = None
    max_probability_diff: float | None = None
    times_ms: dict[str, float] = {}
    gate_failures: list[str] = []


class AttentionProductsEntry(_Strict):
    """The arithmetic of attention's two products beside bf16 or int8 linears (fp32 libraries keep
    fp32): `requested` auto timed the fused kernel in each candidate on the compiling CPU
    (compile/attention_products.py), `times_ms` per candidate and sequence length."""

    products: Literal["fp32", "bf16", "amx", "int8"]
    requested: Literal["auto", "fp32", "bf16"]
    reason: str
    times_ms: dict[str, dict[str, float]] = {}


class PrecisionEntry(_Strict):
    """What the linear layers compute in, and how it was chosen: `requested` auto measured every
    candidate this CPU runs and shipped the fastest that kept its gate (compile/precision.py)."""

    precision: Literal["fp32", "bf16", "int8"]
    requested: Literal["fp32", "bf16", "int8", "auto"]
    kernel: str | None = None  # the micro-kernel of the linear layers (None: the fp32 kernel)
    linears: int = 0  # linear layers in this precision (the rest, if any, stay fp32)
    candidates: list[PrecisionCandidate] = []  # empty: nothing measured (not validated, or one precision asked)
    reason: str | None = None
    attention: AttentionProductsEntry | None = None  # None: fp32 asked (attention's products are fp32)


class EmbeddingRangesEntry(_Strict):
    """Per output dimension, the least and greatest value of the artifact's own embeddings of the
    shipped sentences (compile/sentences.py), as they come from the libraries (`raw`) and
    L2-normalized (`normalized`): `[[min, ...], [max, ...]]`, the `ranges` of sentence-transformers'
    `quantize_embeddings`, with which the server answers int8 and uint8 embeddings."""

    sentences: int
    raw: list[list[float]]
    normalized: list[list[float]]


class SparseCandidate(_Strict):
    """One kernel a sparse-enough weight could run on, timed on the compiling CPU."""

    name: str  # "dense" (at the weight's precision) or "bsr-<storage>" (compile/kernels/bsr.py)
    ms: float
    error: float  # relative error of its output against x @ W^T in float64
    holds: bool  # loses no more than the dense kernel of the weight's precision


class LinearChoice(_Strict):
    """One weight's dense and sparse kernels, timed on the compiling CPU, and the one it runs on."""

    weight: str
    density: float
    dense_ms: float
    sparse_ms: float  # the fastest sparse candidate's
    bsr: bool  # whether it runs on a sparse kernel
    precision: str = "fp32"  # the dense kernel's: the library's, or what the int8 plan kept it in
    candidates: list[SparseCandidate] = []
    chosen: str | None = None


class SparsityEntry(_Strict):
    # pruned: magnitude block pruning changed the model (see cosine_vs_dense); from-checkpoint: the
    # checkpoint's own zero blocks, the model unchanged
    mode: Literal["pruned", "from-checkpoint"] = "pruned"
    density: float | None  # mean block density of the rewritten weights
    block: list[int]
    layers: list[str]  # the layers pruned (none from a checkpoint: every linear sparse enough is rewritten)
    pruned: int  # weights pruned in the checkpoint before export
    rewritten: int  # matmuls rewritten to the BSR kernel (per strategy variant)
    kept_dense: int
    cosine_vs_dense: float | None  # mean cosine of pruned vs dense outputs on fixed sentences (None: not pruned)
    # the pruned model against the dense one on the shipped sentences (compile/sentences.py), as a reduced
    # precision is measured: cosine_min / cosine_mean / worst_sentence, or top1_agreement /
    # max_probability_diff for a classifier (None: not pruned)
    sentences_vs_dense: dict | None = None
    choice: str | None = None  # how a sparse-enough weight was sent to the BSR kernel: timed here, or by density
    choices: list[LinearChoice] = []  # per weight, when timed


class KernelTuning(_Strict):
    """One kernel of one bucket library under `--tune`: the hand schedule's time and MetaSchedule's
    best, timed interleaved on the compiling CPU; `kept` ones ship (tuned_ms None: none agreed)."""

    library: str
    kernel: str
    trials: int
    hand_ms: float
    tuned_ms: float | None
    kept: bool


class TuningEntry(_Strict):
    seconds_per_bucket: float
    database: str | None  # MetaSchedule JSON database of the kept schedules (None: none kept)
    kernels: list[KernelTuning]


class Manifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    task: Literal["embed", "classify"]
    target: TargetEntry
    model: ModelEntry
    dtype: Literal["float32", "float16"]
    # padded: each library takes [batch, seq] token rows; packed: the real tokens only (artifact/packed_batch.py)
    layout: Literal["padded", "packed"] = "padded"
    pooling: str
    labels: list[str]
    # how a classifier's logits become scores: the checkpoint's `problem_type` (None: single-label)
    problem_type: Literal["single_label_classification", "multi_label_classification", "regression"] | None = None
    output_dim: int
    # the width of every token's output, the libraries' second output (ColBERT: its projection; else
    # the hidden state); None: none (a classifier, `--pooling none`, or an artifact from before)
    token_dim: int | None = None
    tvm_version: str
    torch_version: str
    transformers_version: str
    tokenizer: str
    weights: dict[str, WeightsEntry]  # one transformed weight set per strategy in use
    buckets: list[BucketEntry]
    generic: GenericEntry
    passes: PassesEntry
    strategy_choice: StrategyChoice | None = None  # None: one strategy was built
    sparsity: SparsityEntry | None = None
    quantization: QuantizationEntry | None = None  # None: fp32 (or the `dtype`) throughout
    precision: PrecisionEntry | None = None  # None: an artifact from before precisions were chosen
    tuning: TuningEntry | None = None  # None: hand schedules only (no --tune)
    # None: not a pooled embedding model, its libraries not run at compile time, or compiled before
    # ranges were recorded; such a model answers no int8 / uint8 embeddings
    embedding_ranges: EmbeddingRangesEntry | None = None
    validated: bool
    validated_on: str | None = None  # the device validation ran on ("cpu", or the GPU's name)
    tolerance: float
    created_at: str

    @property
    def linear_precision(self) -> str:
        """What the linear layers compute in: fp32, bf16 or int8 (the CUDA dtype for CUDA builds)."""
        if self.precision is not None:
            return self.precision.precision if self.target.kind == "cpu" else self.dtype
        return "int8" if self.quantization is not None else ("fp32" if self.dtype == "float32" else self.dtype)

    @property
    def is_reranker(self) -> bool:
        """A cross-encoder: a classifier with one label, whose logit scores a (query, text) pair;
        served on /rerank as TEI does (`bert-compile --task rerank` checks for the one label)."""
        return self.task == "classify" and len(self.labels) == 1

    @property
    def token_outputs(self) -> bool:
        """Whether the libraries return every token's final hidden state (pooling none) rather
        than one row per sequence: padded `[batch, seq, hidden]`, packed `[tokens, hidden]`."""
        return self.task == "embed" and self.pooling == "none"

    @property
    def token_states(self) -> bool:
        """Whether every token's output can be asked of the libraries beside the pooled rows."""
        return self.token_dim is not None

    @property
    def colbert(self) -> bool:
        """A ColBERT model: its token output is its projection of each token (served on /embed_multi)."""
        return self.pooling == "colbert"

    @property
    def bge_m3(self) -> bool:
        """bge-m3: the pooled row is its dense vector, the token output its ColBERT vector and lexical
        weight of each token (served on /embed, /embed_sparse, /embed_multi and /embed_hybrid)."""
        return self.pooling == "bge-m3"

    @property
    def sparse_outputs(self) -> bool:
        """Whether the libraries return SPLADE weights over the vocabulary (a sparse embedding model)."""
        return self.task == "embed" and self.pooling in SPLADE_POOLINGS

    def hashed_files(self) -> dict[str, str]:
        """Every file whose sha256 the manifest records (weights, libraries), by its path in the artifact."""
        libraries = {entry.library: entry.sha256 for entry in [*self.buckets, self.generic]}
        return {**{weights.file: weights.sha256 for weights in self.weights.values()}, **libraries}

    def write(self, directory: Path) -> None:
        write_json_atomically(self, Path(directory) / MANIFEST_FILE)

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise ArtifactError(f"{directory} is not an artifact directory: no {MANIFEST_FILE}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{path} has schema_version {data.get('schema_version')!r}; this build reads {SCHEMA_VERSION}"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ArtifactError(f"{path} is not a valid manifest: {exc.errors()[0]['msg']}") from None
