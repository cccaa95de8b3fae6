"""Request-level inference: tokenise, queue, and turn batch outputs into embeddings or predictions.

One `ModelService` per loaded artifact. Timings follow TEI's response headers: for a request
of several inputs, queue and inference times are averaged over its inputs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from artifact.embedding_dtypes import CALIBRATED_DTYPES, l2_normalize, quantize
from artifact.manifest import EmbeddingRangesEntry

from .batcher import Batcher
from .errors import InvalidInput, NotSupported, TooLarge
from .inputs import (
    DEFAULT_HYPOTHESIS_TEMPLATE,
    TextInput,
    TokenIds,
    Truncation,
    hypotheses,
    no_empty_pair,
    ranked_labels,
    ranked_texts,
    rerank_pairs,
    valid_dimensions,
)
from .tokenization import Prompts, TextTokenizer

if TYPE_CHECKING:
    from .tracing import Tracing

# Cosine similarities lie in [-1, 1]; scaled by 20 (sentence-transformers' contrastive-loss
# scale) before the softmax, the labels' probabilities are neither uniform nor one-hot.
ZERO_SHOT_SCALE = 20.0
# Requests up to this many characters are tokenised on the event loop (tens of microseconds, less
# than handing them to the tokenizer thread and back); longer ones off it, so a large request
# never stalls the loop.
INLINE_TOKENIZE_CHARS = 2048
# Why a model answers no int8 / uint8 embeddings
UNCALIBRATED = ("records no calibration ranges (compiled before they were recorded, or where its libraries could not "
                "run); recompile it with bert-compile")


@dataclass(frozen=True)
class Computed:
    rows: list[np.ndarray]  # per input: [dim], or [seq, hidden] token states (padding rows past `lengths`)
    lengths: list[int]  # per input: its tokens
    paths: list[str]  # distinct compute paths that served the request, in order of first use
    tokens: int
    characters: int
    tokenization_seconds: float
    queue_seconds: float
    inference_seconds: float

    @property
    def outputs(self) -> np.ndarray:
        """[n, dim]: one pooled row per input."""
        return np.stack(self.rows)

    def token_states(self) -> list[np.ndarray]:
        """Per input, [tokens, hidden]: the states of its own tokens."""
        return [row[:length] for row, length in zip(self.rows, self.lengths)]


class ModelService:
    """One artifact's tokenizer and batcher, and what the routes ask of it."""

    def __init__(self, name: str, task: str, labels: list[str], tokenizer: TextTokenizer, batcher: Batcher,
                 tokenizer_pool: ThreadPoolExecutor, max_client_batch_size: int, output_dim: int,
                 problem_type: str | None = None, prompts: Prompts | None = None, tracing: Tracing | None = None,
                 embedding_ranges: EmbeddingRangesEntry | None = None):
        self.name = name
        self.embedding_ranges = embedding_ranges  # int8 / uint8 embeddings' calibration (None: not recorded)
        self.tracing = tracing  # with --otlp-endpoint: each request's stages become spans
        self.prompts = prompts or Prompts({}, "")
        self.output_dim = output_dim
        self.problem_type = problem_type
        self.task = task
        self.labels = labels
        # a classifier one of whose labels is entailment scores zero-shot labels as NLI (`nli_scores`)
        self.entailment = entailment_index(labels) if task == "classify" else None
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.max_client_batch_size = max_client_batch_size
        self._tokenizer_pool = tokenizer_pool

    def check_batch_size(self, count: int, detail: str = "") -> None:
        """TEI's limit of inputs per request (`detail` says what was counted, where not just the inputs)."""
        if count > self.max_client_batch_size:
            raise TooLarge(f"batch size {count}{detail} > maximum allowed batch size {self.max_client_batch_size}")

    def check_zero_shot_size(self, texts: int, labels: int) -> None:
        """Zero-shot runs more than the request's texts, and all of it counts: each label is embedded
        beside the texts, or (NLI) each (text, hypothesis) pair is one input."""
        inputs = f"{texts} input{'s' * (texts != 1)}"
        if self.entailment is None:
            self.check_batch_size(texts + labels, f" ({inputs} and {labels} zero-shot labels, each embedded)")
        else:
            self.check_batch_size(texts * labels, f" ({inputs} x {labels} zero-shot labels, each pair run)")

    async def compute(self, inputs: list[TextInput | TokenIds], truncation: Truncation,
                      premise_first: bool = False) -> Computed:
        """Tokenize, batch and run `inputs` (a pair may have one empty side: `inputs.no_empty_pair`);
        `premise_first`: an over-long pair loses tokens of its first text only (`TextTokenizer.encode`)."""
        no_empty_pair(inputs)
        started = time.perf_counter()
        characters = sum(map(_characters, inputs))
        encoded = await self._tokenizing(characters, self.tokenizer.encode, inputs, truncation, premise_first)
        tokenized = time.perf_counter()
        results = await self.batcher.submit(encoded)
        if self.tracing is not None:
            self.tracing.record_stages(started, tokenized, results, {"inputs": len(inputs),
                                                                     "tokens": sum(map(len, encoded))})
        return Computed(
            rows=[result.output for result in results],
            lengths=[len(item) for item in encoded],
            paths=list(dict.fromkeys(result.path for result in results)),
            tokens=sum(len(item) for item in encoded),
            characters=characters,
            tokenization_seconds=tokenized - started,
            queue_seconds=statistics.fmean(result.queue_seconds for result in results),
            inference_seconds=statistics.fmean(result.inference_seconds for result in results),
        )

    async def tokens(self, texts: list[str], add_special_tokens: bool,
                     prompt_name: str | None = None) -> list[list[dict]]:
        """TEI's /tokenize (`TextTokenizer.tokens`) of the texts as they run: their prompt (named, else the
        default) prepended, the offsets into the prompted text."""
        texts = self.prompts.apply(texts, prompt_name)
        return await self._tokenizing(sum(map(len, texts)), self.tokenizer.tokens, texts, add_special_tokens)

    async def decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's /decode (`TextTokenizer.decode`)."""
        return await self._tokenizing(sum(map(len, ids)), self.tokenizer.decode, ids, skip_special_tokens)

    async def _tokenizing(self, size: int, work, *args):
        """`work(*args)` on the event loop for up to INLINE_TOKENIZE_CHARS characters (or ids), on the
        tokenizer thread beyond, so that a large request never stalls every other answer."""
        if size <= INLINE_TOKENIZE_CHARS:
            return work(*args)  # tens of microseconds: cheaper than a thread hop
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work, *args)

    async def embed(self, inputs: list[str | TokenIds], normalize: bool, truncation: Truncation,
                    dimensions: int | None = None, prompt_name: str | None = None,
                    embedding_dtype: str = "float32") -> tuple[np.ndarray, Computed]:
        """Embeddings of texts or token ids; with `dimensions`, the first d components (Matryoshka),
        normalised after the cut, then quantized to `embedding_dtype` (sentence-transformers' order);
        `prompt_name` (else the default prompt) is prepended to every text."""
        valid_dimensions(dimensions, self.output_dim)
        ranges = self.quantization_ranges(embedding_dtype, normalize, dimensions)
        computed = await self.compute(self.prompts.apply(inputs, prompt_name), truncation)
        vectors = computed.outputs[:, :dimensions]
        return quantize(l2_normalize(vectors) if normalize else vectors, embedding_dtype, ranges), computed

    def quantization_ranges(self, embedding_dtype: str, normalize: bool, dimensions: int | None) -> np.ndarray | None:
        """The `[2, dim]` ranges int8 / uint8 embeddings are bucketed by (None for the other dtypes):
        the calibration recorded at compile time of the full vectors, normalized or not; unnormalized
        ones hold for their first d components too. Refused where the model has none that fit."""
        if embedding_dtype not in CALIBRATED_DTYPES:
            return None
        ranges = self.embedding_ranges
        if ranges is None:
            raise NotSupported(f"embedding_dtype {embedding_dtype}: model {self.name!r} {UNCALIBRATED}, "
                               f"or ask binary or ubinary")
        if normalize and dimensions not in (None, self.output_dim):
            raise NotSupported(f"embedding_dtype {embedding_dtype} of normalized embeddings cut to {dimensions} "
                               f"dimensions: the model's calibration ranges are of its full {self.output_dim}-"
                               f"dimension vectors; ask normalize false, all {self.output_dim} dimensions, or "
                               f"binary or ubinary")
        return np.asarray(ranges.normalized if normalize else ranges.raw, dtype=np.float32)[:, :dimensions]

    async def embed_all(self, inputs: list[str | TokenIds], truncation: Truncation,
                        prompt_name: str | None = None) -> tuple[list[np.ndarray], Computed]:
        """Per input, every token's final hidden state (special tokens included, as
        transformers' `last_hidden_state`): a model compiled with `--pooling none`."""
        computed = await self.compute(self.prompts.apply(inputs, prompt_name), truncation)
        return computed.token_states(), computed

    async def embed_sparse(self, inputs: list[str | TokenIds], truncation: Truncation,
                           prompt_name: str | None = None) -> tuple[list[list[dict]], Computed]:
        """Per input, its SPLADE weights as TEI gives them: the non-zero `{"index", "value"}` pairs,
        by vocabulary index (a model compiled with `--task sparse`)."""
        computed = await self.compute(self.prompts.apply(inputs, prompt_name), truncation)
        return [sparse_pairs(row) for row in computed.rows], computed

    async def classify(self, texts: list[TextInput], scoring: str,
                       truncation: Truncation) -> tuple[list[list[dict]], Computed]:
        """Labels ranked by score, per text or (query, passage) pair; `scoring` is "auto" (as the head
        was trained), or "none" (raw logits), "softmax" or "sigmoid" (the HF pipeline's `function_to_apply`)."""
        computed = await self.compute(texts, truncation)
        logits = computed.outputs
        scores = {"auto": lambda: probabilities(logits, self.problem_type), "none": lambda: logits,
                  "softmax": lambda: softmax(logits), "sigmoid": lambda: sigmoid(logits)}[scoring]()
        return [ranked_labels(self.labels, row) for row in scores], computed

    async def rerank(self, query: str, texts: list[str], raw_scores: bool, truncation: Truncation,
                     return_text: bool = False) -> tuple[list[dict], Computed]:
        """`texts` ranked by a cross-encoder's score of each (query, text) pair: its logit, or the sigmoid
        of it (`inputs.ranked_texts`)."""
        computed = await self.compute(rerank_pairs(query, texts), truncation)
        logits = computed.outputs[:, 0]
        return ranked_texts(logits if raw_scores else sigmoid(logits), texts, return_text), computed

    async def zero_shot(self, texts: list[str], labels: list[str], raw_scores: bool, truncation: Truncation,
                        template: str | None = None, multi_label: bool = False) -> tuple[list[list[dict]], Computed]:
        """Candidate labels ranked per text: by an NLI classifier as transformers' zero-shot-classification
        pipeline ranks them (`nli_zero_shot`), else by an embedding model's cosine similarity of each
        label's embedding to the text's, softmaxed over labels."""
        self.check_zero_shot_size(len(texts), len(labels))
        if self.entailment is not None:
            return await self.nli_zero_shot(texts, labels, raw_scores, truncation, template, multi_label)
        if template is not None or multi_label:
            raise InvalidInput(f"`hypothesis_template` and `multi_label` apply to an NLI classifier (one whose labels "
                               f"include entailment); model {self.name!r} is an embedding model, which scores labels "
                               "by the cosine similarity of their embeddings")
        vectors, computed = await self.embed(texts + labels, normalize=True, truncation=truncation)
        similarity = vectors[: len(texts)] @ vectors[len(texts):].T
        scores = similarity if raw_scores else softmax(similarity * ZERO_SHOT_SCALE)
        return [ranked_labels(labels, row) for row in scores], computed

    async def nli_zero_shot(self, texts: list[str], labels: list[str], raw_scores: bool, truncation: Truncation,
                            template: str | None, multi_label: bool) -> tuple[list[list[dict]], Computed]:
        """Each (text, hypothesis) pair, the label put in `template` (the pipeline's "This example is {}."),
        run as one input of one request, truncated as the pipeline truncates (the text only); scored by
        `nli_scores`, or with `raw_scores` each pair's entailment logit."""
        filled = hypotheses(DEFAULT_HYPOTHESIS_TEMPLATE if template is None else template, labels)
        computed = await self.compute([(text, hypothesis) for text in texts for hypothesis in filled], truncation,
                                      premise_first=True)
        logits = computed.outputs.reshape(len(texts), len(labels), -1)
        scores = logits[..., self.entailment] if raw_scores else nli_scores(logits, self.entailment, multi_label)
        return [ranked_labels(labels, row) for row in scores], computed


def _characters(item: TextInput | TokenIds) -> int:
    """An input's size as TEI counts it (`x-compute-characters`): its characters, or its token ids."""
    return len(item[0]) + len(item[1]) if isinstance(item, tuple) else len(item)


def sparse_pairs(weights: np.ndarray) -> list[dict]:
    indices = np.flatnonzero(weights)
    return [{"index": int(i), "value": float(v)} for i, v in zip(indices, weights[indices])]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits))


def probabilities(logits: np.ndarray, problem_type: str | None = None) -> np.ndarray:
    """Scores as the checkpoint's head was trained (and as TEI gives them): a sigmoid per label for
    multi-label classification or a single logit, else a softmax over labels."""
    if problem_type == "multi_label_classification" or logits.shape[1] == 1:
        return sigmoid(logits)
    return softmax(logits)


def entailment_index(labels: list[str]) -> int | None:
    """The entailment class of an NLI classifier, found as transformers' zero-shot pipeline finds it: the
    first label that starts with "entail" in any case; None for a classifier of anything else."""
    return next((i for i, label in enumerate(labels) if label.lower().startswith("entail")), None)


def nli_scores(logits: np.ndarray, entailment: int, multi_label: bool) -> np.ndarray:
    """[texts, labels] scores from [texts, labels, classes] NLI logits, as transformers'
    zero-shot-classification pipeline computes them: one label, or `multi_label`, each label on its own
    (a softmax of its entailment logit against its contradiction's, the contradiction class being the
    first, or the last where entailment is the first); otherwise a softmax over the labels' entailment logits."""
    if multi_label or logits.shape[1] == 1:
        contradiction = -1 if entailment == 0 else 0
        return softmax(logits[..., [contradiction, entailment]])[..., 1]
    return softmax(logits[..., entailment])
