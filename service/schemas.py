"""Request and response models of the HTTP API (TEI's /embed, /predict, /rerank, /tokenize, /decode
and /similarity, OpenAI's embeddings). Every request may name its `model` (GET /v1/models);
without one, the first model of the route's task serves it.

Requests are strict: JSON of the wrong type (a number for `inputs`, a string for `normalize`)
is a 422, not silently coerced. Unknown fields are ignored, as TEI's serde models do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from artifact.embedding_dtypes import EmbeddingDtype

from .inputs import HYBRID_OUTPUTS, HybridOutput, no_empty_input, no_empty_sequence, non_empty, predict_inputs, texts_only, texts_or_ids

# Texts only (classification, tokenization): one string or several, none empty
Inputs = Annotated[str | list[str], BeforeValidator(texts_only), AfterValidator(no_empty_input)]
# /predict's: a text, a flat list (TEI: one text or a pair; zero-shot: texts), or TEI's batch [[text], [text, text]]
PredictInputs = Annotated[str | list[str] | list[list[str]], BeforeValidator(predict_inputs),
                          AfterValidator(no_empty_sequence)]
# The embedding routes': texts or token ids (run as given: no special tokens or prompt added), none empty
EmbeddingInputs = Annotated[str | list[int] | list[str | list[int]], BeforeValidator(texts_or_ids),
                            AfterValidator(no_empty_input)]
# Texts none of which is empty (zero-shot labels, /similarity's sentences)
Texts = Annotated[list[str], AfterValidator(no_empty_input)]

EMBEDDING_DTYPE_DOC = ("int8 / uint8 (by the model's calibration ranges), binary / ubinary (signs packed 8 to a "
                       "byte) as sentence-transformers' quantize_embeddings; default: the server's --embedding-dtype")


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
    embedding_dtype: EmbeddingDtype | None = Field(None, description=EMBEDDING_DTYPE_DOC)


class EmbedAllRequest(_Truncating):
    """TEI's /embed_all (every token's vector) and /embed_sparse (SPLADE weights) bodies."""

    inputs: EmbeddingInputs
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")
    embedding_dtype: EmbeddingDtype | None = Field(None, description="float32 only (quantized: /embed)")


class EmbedMultiRequest(_Truncating):
    """/embed_multi's body: a ColBERT model's token vectors of queries or documents."""

    inputs: EmbeddingInputs
    is_query: bool = Field(True, description="queries (prefix, [MASK] expansion) or documents (prefix, skip-list): "
                                             "PyLate's `encode(is_query=...)`, whose default is a query")
    embedding_dtype: EmbeddingDtype = Field("float32", description="float32, binary or ubinary (token vectors have "
                                            "no calibration ranges for int8 / uint8)")


class EmbedHybridRequest(_Truncating):
    """/embed_hybrid's body: any of bge-m3's three outputs, from one pass per input."""

    inputs: EmbeddingInputs
    outputs: list[HybridOutput] = Field(
        list(HYBRID_OUTPUTS), min_length=1, description="which outputs each answer holds")
    normalize: bool = True
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")


class PipelineParameters(_Strict):
    """The Hugging Face Inference API's text-classification and zero-shot-classification `parameters`
    (what `huggingface_hub.InferenceClient.text_classification` and `.zero_shot_classification` send)."""

    top_k: int | None = Field(None, ge=1)
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    candidate_labels: Texts | None = None  # zero-shot's `labels`
    hypothesis_template: str | None = None
    multi_label: bool | None = None


class ClassifyRequest(_Truncating):
    inputs: PredictInputs
    raw_scores: bool = False
    labels: Texts | None = Field(None, description="zero-shot candidate labels: scored by an NLI classifier (one "
                                 "whose labels include entailment) as transformers' zero-shot pipeline, or by an "
                                 "embedding model's similarity")
    hypothesis_template: str | None = Field(None, description="NLI zero-shot: each label's hypothesis, the label "
                                            "at {} (default \"This example is {}.\")")
    multi_label: bool = Field(False, description="NLI zero-shot: score each label on its own (entailment against "
                              "contradiction) rather than softmax over the labels")
    parameters: PipelineParameters | None = Field(
        None, description="the HF Inference API's payload: answers take its shape, a list per input (zero-shot's: "
        "as without it); its candidate_labels, hypothesis_template and multi_label are zero-shot's fields")

    @model_validator(mode="after")
    def _take_zero_shot_parameters(self) -> "ClassifyRequest":
        """The Inference API's zero-shot `parameters` as the fields they are here (`candidate_labels`:
        `labels`); one given in both places is refused rather than one of them ignored."""
        if self.parameters is None:
            return self
        for given, name in (("candidate_labels", "labels"), ("hypothesis_template", "hypothesis_template"),
                            ("multi_label", "multi_label")):
            if given in self.parameters.model_fields_set and getattr(self.parameters, given) is not None:
                if name in self.model_fields_set:
                    raise ValueError(f"`{name}` is given twice: at the top level and in `parameters` ({given})")
                setattr(self, name, getattr(self.parameters, given))
        return self


class RerankRequest(_Truncating):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False  # an empty query or text is scored (TEI's rule: not both of a pair, `inputs.py`)


class TokenizeRequest(_Request):
    inputs: Inputs
    add_special_tokens: bool = True
    prompt_name: str | None = Field(None, description="one of the checkpoint's sentence-transformers prompts")


class DecodeRequest(_Request):
    ids: Annotated[list[int] | list[list[int]], AfterValidator(non_empty)]
    skip_special_tokens: bool = True


class SimilarityInputs(_Strict):
    source_sentence: Annotated[str, AfterValidator(no_empty_input)]
    sentences: Texts


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
    embedding_dtype: EmbeddingDtype | None = Field(None, description=EMBEDDING_DTYPE_DOC)


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[int] | list[float] | str  # int: a quantized embedding_dtype
    index: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage
