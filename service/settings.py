"""Server settings: defaults < TEI's environment variables < BERT_SERVE_* environment variables < command-line flags;
the model (`artifacts` or `model_id`) comes whole from the last of these that names one.

pydantic-settings is not a dependency, so the environment is read here: every field `x_y` is
settable as `BERT_SERVE_X_Y`, and those TEI reads also by TEI's name (TEI_VARIABLES); list fields
(`artifacts`, `served_names`, `cors_allow_origin`) take comma-separated values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from artifact.embedding_dtypes import EmbeddingDtype

ENV_PREFIX = "BERT_SERVE_"
# A TEI container's environment carries over: the variables TEI reads for the flags both servers have (not
# HOSTNAME and PORT, which shells and orchestrators set for other reasons).
TEI_VARIABLES = {name: name.upper() for name in (
    "model_id", "revision", "huggingface_hub_cache", "tokenization_workers", "dtype", "pooling",
    "max_concurrent_requests", "max_batch_tokens", "max_batch_requests", "max_client_batch_size", "auto_truncate",
    "default_prompt_name", "default_prompt", "payload_limit", "api_key", "otlp_endpoint", "otlp_service_name",
    "cors_allow_origin", "uds_path", "prometheus_port")}
# What names the model: taken together from the first of flags, BERT_SERVE_* and TEI's variables that names one, so
# that `--model-id` on the command line replaces artifacts a container's environment names.
MODEL_SOURCE = ("artifacts", "model_id")


class Settings(BaseModel):
    """Everything the server can be told; defaults follow text-embeddings-inference where it has one."""

    model_config = ConfigDict(extra="forbid")

    artifacts: list[Path] = Field([], description="artifact directories; the first is what `/` serves")
    # A Hub model instead (service/model_cache.py): compiled for this CPU on first start, from the cache after
    model_id: str | None = Field(None, description="Hugging Face Hub model ORG/NAME, compiled once and cached")
    revision: str | None = Field(None, description="--model-id's branch, tag or commit (default: main)")
    hf_token: str | None = Field(None, description="a token that can read a private or gated --model-id "
                                 "(default: HF_TOKEN)")
    huggingface_hub_cache: Path | None = Field(None, description="where Hub downloads are cached "
                                               "(default: HF_HUB_CACHE)")
    artifact_cache: Path | None = Field(None, description="where --model-id's compiled artifacts are cached "
                                        "(default: $XDG_CACHE_HOME/bert-tvm-serve)")
    config: Path | None = Field(None, description="compile config (YAML) for --model-id "
                                "(default: configs/default.yaml)")
    served_names: list[str] | None = Field(None, description="the models' names, in --artifacts order "
                                           "(default: each directory's name); requests select one by `model`")
    default_prompt_name: str | None = Field(None, description="a prompt of the checkpoint's sentence-transformers "
                                            "`prompts` prepended to every input that names none")
    default_prompt: str | None = Field(None, description="a text prepended to every input that names no prompt")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535, description="also serve TEI's gRPC API (tei.v1) and our "
                                  "retrieval methods (bertserve.v1) on this port")
    backend: Literal["tvm", "torch"] = "tvm"
    cores: int | None = Field(None, ge=1, description="cores to use; default: the affinity mask capped by the cgroup quota")
    workers: int | None = Field(None, ge=1, description="batches run side by side per model; default: see service.topology")
    threads_per_worker: int | None = Field(None, ge=1, description="intra-op threads of each worker")
    wide_worker: bool | None = Field(None, description="run a lone batch on every core when idle (tvm; default on)")
    queue_ahead: bool = Field(True, description="a busy worker holds the next batch and starts it as soon as it is done")
    request_timeout: float = Field(60.0, gt=0, description="seconds a request may wait for its answer; beyond: 504")
    # 4096, not TEI's 16384: a worker's activations grow with its batch's tokens (~5 KB a token on
    # MiniLM), and two 16384-token batches in flight took RSS past 1.5x its idle size
    # (docs/soak/README.md). On CPU the bigger batch gains nothing: past ~1 ms of fixed cost a packed
    # batch costs the same per token, and the default padded grid's largest bucket holds 4096.
    max_batch_tokens: int = Field(4096, ge=1, description="padded tokens (bucket batch x seq) per batch")
    max_batch_requests: int | None = Field(None, ge=1, description="inputs per batch; default: bucket bounds")
    max_wait_ms: float = Field(2.0, ge=0, description="how long the oldest queued input waits for company")
    sort_window: int = Field(4, ge=1, description="batches' worth of queued inputs sorted by length together")
    max_concurrent_requests: int = Field(512, ge=1, description="inputs admitted at once; beyond: 429 (413 if more in one request)")
    max_client_batch_size: int = Field(32, ge=1, description="inputs per request; beyond: 413")
    payload_limit: int = Field(2_000_000, ge=1, description="request body bytes; beyond: 413")
    auto_truncate: bool = Field(True, description="HTTP: default of `truncate`, and what /v1/embeddings does "
                                "(TEI's default); gRPC requests truncate only when they ask")
    embedding_dtype: EmbeddingDtype = Field(
        "float32", description="what the embedding routes answer in where a request names no `embedding_dtype`")
    api_key: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    # The rest of TEI's command line
    # one is enough: tokenizers' Rust encoder parallelises a batch itself
    tokenization_workers: int = Field(1, ge=1, description="threads tokenizing large requests off the event loop")
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="TEI's: with --model-id, what the compile computes in; else what every model must compute "
        "in (chosen when compiling)")
    pooling: Literal["cls", "mean", "splade", "last-token"] | None = Field(
        None, description="TEI's: with --model-id, how the compile pools; else the pooling every embedding model "
        "must have (chosen when compiling)")
    otlp_endpoint: str | None = Field(None, description="export request traces over OTLP/HTTP to this collector")
    otlp_service_name: str = "bert-serve"
    cors_allow_origin: list[str] | None = Field(None, description="origins browsers may call from (`*`: any)")
    uds_path: Path | None = Field(None, description="also serve HTTP on this unix socket")
    prometheus_port: int | None = Field(None, ge=0, le=65535, description="also serve /metrics on this port")

    @field_validator("artifacts", "served_names", "cors_allow_origin", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _one_model_source(self) -> "Settings":
        if bool(self.artifacts) == (self.model_id is not None):
            raise ValueError("give --artifacts DIR (compiled artifacts) or --model-id ORG/NAME (a Hub model), "
                             "one of the two")
        return self

    @model_validator(mode="after")
    def _one_default_prompt(self) -> "Settings":
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise ValueError("give --default-prompt-name or --default-prompt, not both")
        return self

    @classmethod
    def load(cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "Settings":
        """Merge environment and flags (flags given as None do not override)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for level in ({name: environ[variable] for name, variable in TEI_VARIABLES.items() if variable in environ},
                      {name: environ[ENV_PREFIX + name.upper()] for name in cls.model_fields
                       if ENV_PREFIX + name.upper() in environ},
                      {name: value for name, value in flags.items() if value is not None}):
            if any(name in level for name in MODEL_SOURCE):
                values = {name: value for name, value in values.items() if name not in MODEL_SOURCE}
            values.update(level)
        return cls.model_validate(values)
