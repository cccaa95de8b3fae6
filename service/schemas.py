"""Request and response models of the HTTP API (TEI's /embed, /predict, /rerank, /tokenize, /decode
and /similarity, OpenAI's embeddings). Every request may name its `model` (GET /v1/models);
without one, the first model of the route's task serves it.

Requests are strict: JSON of the wrong type (a number for `inputs`, a string for `normalize`)
is a 422, not silently coerced. Unknown fields are ignored, as TEI's serde models do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator


def _texts(value: object) -> object:
    """A string or a list of strings passes; anything else is refused in one line (not as the
    union's error per branch, `inputs.str: Input should be a valid string`), token ids by name."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(text, str) for text in value)):
        return value
    if isinstance(value, list) and value and all(_token_id(item) or _token_ids(item) for item in value):
        raise ValueError("token ids are not accepted here: send the text, a string or a list of strings")
    raise ValueError("expected a string or a list of strings")


def _texts_or_ids(value: object) -> object:
    """What TEI's embedding routes and OpenAI's take: a string, one input's token ids, or a list whose
    items are each a string or a list of token ids; anything else is refused in one line."""
    if isinstance(value, str) or _token_ids(value):
        return value
    if isinstance(value, list) and all(isinstance(item, str) or _token_ids(item) for item in value):
        return value
    raise ValueError("expected a string, a list of token ids, or a list of strings and lists of token ids")


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: object) -> bool:
    """One input's token ids: a list of them (an empty one is refused later, by name)."""
    return isinstance(value, list) and all(_token_id(item) for item in value)


def _non_empty(value: str | list) -> str | list:
    """The messages leave the field unnamed: the error's location names it (`input: cannot be empty`)."""
    if value == "" or value == []:
        raise ValueError("cannot be empty")
    items = [value] if isinstance(value, str) or _token_id(value[0]) else value
    if "" in items:
        raise ValueError("cannot contain an empty string")
    if [] in items:
        raise ValueError("cannot contain an empty list of token ids")
    return value


def _sequences(value: object) -> object:
    """/predict's inputs: texts, or TEI's batch of sequences, each a list of one text or of a pair."""
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        if not all(len(item) in (1, 2) and all(isinstance(text, str) for text in item) for item in value):
            raise ValueError("a batch of sequences holds lists of one text or of a pair of texts")
        return value
    return _texts(value)


def _non_empty_sequences(value: str | list) -> str | list:
    """No empty text; a (text, text) pair may have one empty side, as in TEI (two: `ModelService.compute`).
    A flat list of two is TEI's pair (zero-shot reads it as two texts: the route refuses an empty one)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [sequence if len(sequence) == 2 else _non_empty(sequence) for sequence in value]
    if isinstance(value, list) and len(value) == 2:
        return value
    return _non_empty(value)


# Texts only (classification, tokenization): one string or several, none empty
Inputs = Annotated[str | list[str], BeforeValidator(_texts), AfterValidator(_non_empty)]
# /predict's: a text, a flat list (TEI: one text or a pair; zero-shot: texts), or TEI's batch [[text], [text, text]]
PredictInputs = Annotated[str | list[str] | list[list[str]], BeforeValidator(_sequences),
                          AfterValidator(_non_empty_sequences)]
# The embedding routes': texts or token ids (run as given: no special tokens or prompt added), none empty
EmbeddingInputs = Annotated[str | list[int] | list[str | list[int]], BeforeValidator(_texts_or_ids),
                            AfterValidator(_non_empty)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Request(_Strict):
    model: str | None = None


# TEI's: an over-long input loses tokens at its end (Right) or its start (Left); special tokens stay.
# TEI's enum takes "Left" and "Right", its documentation shows "right": both are taken
TruncationDirection = Literal["Left", "Right", "left", "right"]


class _Truncating(_Request):
    truncate: bool | None = None  # None: the server's --auto-truncate
    truncation_direction: TruncationDirection = "Right"


class EmbedRequest(_Truncating):
    inputs: EmbeddingInputs
    normalize: bool = True
    dimensions: int | None = Field(None, ge=1, description="Matryoshka: keep the first d components")
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")


class EmbedAllRequest(_Truncating):
    """TEI's /embed_all (every token's vector) and /embed_sparse (SPLADE weights) bodies."""

    inputs: EmbeddingInputs
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")


class PipelineParameters(_Strict):
    """The Hugging Face Inference API's text-classification `parameters` (what
    `huggingface_hub.InferenceClient.text_classification` sends)."""

    top_k: int | None = Field(None, ge=1)
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None


class ClassifyRequest(_Truncating):
    inputs: PredictInputs
    raw_scores: bool = False
    labels: list[str] | None = Field(None, description="zero-shot candidate labels (uses the embed model)")
    parameters: PipelineParameters | None = Field(
        None, description="the HF Inference API's payload: answers take its shape, a list per input")

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(label == "" for label in value)):
            raise ValueError("`labels` must be a non-empty list of non-empty strings")
        return value


class RerankRequest(_Truncating):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False

    # an empty query or text is scored (TEI's rule: not both of a pair, `ModelService.compute`)


class TokenizeRequest(_Request):
    inputs: Inputs
    add_special_tokens: bool = True
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")


class DecodeRequest(_Request):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True

    @field_validator("ids")
    @classmethod
    def _check_ids(cls, value: list[int] | list[list[int]]) -> list[int] | list[list[int]]:
        if not value:
            raise ValueError("`ids` cannot be empty")
        return value


class SimilarityInputs(_Strict):
    source_sentence: str
    sentences: list[str]

    @field_validator("sentences")
    @classmethod
    def _check_sentences(cls, value: list[str]) -> list[str]:
        return _non_empty(value)

    @field_validator("source_sentence")
    @classmethod
    def _check_source(cls, value: str) -> str:
        return _non_empty(value)


class SimilarityParameters(_Strict):
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: str | None = None


class SimilarityRequest(_Truncating):
    inputs: SimilarityInputs
    prompt_name: str | None = None
    parameters: SimilarityParameters | None = Field(
        None, description="TEI's (and the HF Inference API's) place for truncate, truncation_direction and prompt_name")

    @model_validator(mode="after")
    def _take_parameters(self) -> "SimilarityRequest":
        """`parameters`' fields as if given at the top level (where this API also takes them); one given
        in both places is refused rather than one of them ignored."""
        if self.parameters is not None:
            for name in sorted(self.parameters.model_fields_set):
                if name in self.model_fields_set:
                    raise ValueError(f"`{name}` is given twice: at the top level and in `parameters`")
                setattr(self, name, getattr(self.parameters, name))
        return self


class OpenAIEmbeddingRequest(_Request):
    input: EmbeddingInputs
    # null: OpenAI's default, float (clients may send the field unset as null)
    encoding_format: Annotated[Literal["float", "base64"],
                               BeforeValidator(lambda value: "float" if value is None else value)] = "float"
    user: str | None = None
    dimensions: int | None = Field(None, ge=1, description="Matryoshka: keep the first d components")
    prompt_name: str | None = None


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
