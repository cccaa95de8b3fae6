"""Request and response models of the HTTP API (TEI's /embed and /predict, OpenAI's embeddings).

Requests are strict: JSON of the wrong type (a number for `inputs`, a string for `normalize`)
is a 422, not silently coerced. Unknown fields are ignored, as TEI's serde models do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Inputs = str | list[str]


def _non_empty(value: Inputs) -> Inputs:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ValueError("`inputs` cannot be empty")
    if any(text == "" for text in texts):
        raise ValueError("`inputs` cannot contain an empty string")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class EmbedRequest(_Request):
    inputs: Inputs
    normalize: bool = True
    truncate: bool | None = None  # None: the server's --auto-truncate

    _check_inputs = field_validator("inputs")(_non_empty)


class ClassifyRequest(_Request):
    inputs: Inputs
    raw_scores: bool = False
    truncate: bool | None = None
    labels: list[str] | None = Field(None, description="zero-shot candidate labels (uses the embed model)")

    _check_inputs = field_validator("inputs")(_non_empty)

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(label == "" for label in value)):
            raise ValueError("`labels` must be a non-empty list of non-empty strings")
        return value


class OpenAIEmbeddingRequest(_Request):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Inputs) -> Inputs:
        return _non_empty(value)


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage
