"""The input rules HTTP and gRPC share, each in one place: what may be empty, what a pair is (TEI's
/predict shapes), token ids, truncation, embedding dtypes and bge-m3's outputs, and ranking best first.

A rule refuses with InvalidInput (NotSupported, a 400, for what a model cannot answer), which each
transport answers with its own status: HTTP with a JSON 422 (`errors.py`), gRPC with INVALID_ARGUMENT.
The HTTP schemas run the shape rules as pydantic validators while they parse: InvalidInput is a
ValueError, so pydantic reports it at the field it refuses (`inputs: cannot be empty`). So the
messages leave the field unnamed, unless the caller names it (`field`) where no parser's location
does, as gRPC's must.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import numpy as np

from artifact.embedding_dtypes import CALIBRATED_DTYPES, EMBEDDING_DTYPES

from .errors import InvalidInput, NotSupported

TextInput = str | tuple[str, str]  # one text, or a (query, passage) pair for a cross-encoder
TokenIds = list[int]  # one input already tokenized: the model's input ids, run as given
# Where over-long inputs lose tokens (TEI's truncation_direction): at their end or their start; None:
# they are refused (413, `TextTokenizer`)
Truncation = Literal["right", "left"] | None


# --- emptiness: no empty text, token ids or list of inputs; a pair may have one empty side, not two


def _subject(field: str | None) -> str:
    return f"`{field}` " if field else ""


def non_empty(value: str | list, *, field: str | None = None) -> str | list:
    """`value` (a text, or a list of anything) unless it is empty."""
    if value == "" or value == []:
        raise InvalidInput(f"{_subject(field)}cannot be empty")
    return value


def no_empty_input(value: str | list, *, field: str | None = None) -> str | list:
    """One input (a text or token ids) or a list of them, none of them empty."""
    non_empty(value, field=field)
    items = one_per_item(value)
    if "" in items:
        raise InvalidInput(f"{_subject(field)}cannot contain an empty string")
    if [] in items:
        raise InvalidInput(f"{_subject(field)}cannot contain an empty list of token ids")
    return value


def no_empty_pair(inputs: Sequence[TextInput | TokenIds]) -> None:
    """As in TEI (/predict, /rerank and gRPC alike), a (text, text) pair may have one empty side, not two."""
    empty = next((i for i, item in enumerate(inputs) if isinstance(item, tuple) and not any(item)), None)
    if empty is not None:
        raise InvalidInput(f"input {empty} is a pair of two empty texts: a pair needs a text")


def rerank_pairs(query: str, texts: list[str]) -> list[tuple[str, str]]:
    """/rerank's (query, text) pairs, one per text; an empty query or text is scored (`no_empty_pair`)."""
    non_empty(texts, field="texts")
    return [(query, text) for text in texts]


# --- pairs: TEI's /predict shapes. A sequence is one text or a (text, text) pair; a string or a flat
# list is one sequence (`["a", "b"]` is a pair, as TEI reads it), a batch a list of sequences,
# `[["a"], ["a", "b"]]`. Zero-shot reads a flat list as texts.


def sequence(texts: Sequence[str]) -> TextInput:
    """One sequence from its texts: one text, not empty, or a (text, text) pair (`no_empty_pair`)."""
    if len(texts) not in (1, 2):
        raise InvalidInput(f"`inputs`: a flat list is one text or one (text, text) pair, as in TEI, not "
                           f"{len(texts)} texts; a batch is a list of them, [[text], [text, text], ...]")
    return non_empty(texts[0], field="inputs") if len(texts) == 1 else (texts[0], texts[1])


def predict_inputs(value: object) -> object:
    """/predict's `inputs` as parsed: texts, or a batch whose items each hold one text or a pair."""
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        if not all(len(item) in (1, 2) and all(isinstance(text, str) for text in item) for item in value):
            raise InvalidInput("a batch of sequences holds lists of one text or of a pair of texts")
        return value
    return texts_only(value)


def no_empty_sequence(value: str | list) -> str | list:
    """No empty text, but a pair's side may be (two empty sides: `no_empty_pair`). A flat list of two is a
    pair, or two texts for zero-shot (`zero_shot_texts` refuses an empty one)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item if len(item) == 2 else no_empty_input(item) for item in value]
    if isinstance(value, list) and len(value) == 2:
        return value
    return no_empty_input(value)


def predict_sequences(inputs: str | list) -> tuple[list[TextInput], bool]:
    """/predict's sequences, and whether they came as a batch."""
    if isinstance(inputs, str):
        return [inputs], False
    if isinstance(inputs[0], list):
        return [sequence(item) for item in inputs], True
    return [sequence(inputs)], False


def zero_shot_texts(inputs: str | list) -> tuple[list[str], bool]:
    """The texts zero-shot `labels` are scored against, and whether they came as a list: single texts
    (flat, or a batch of one-text sequences), none empty."""
    texts = [item if isinstance(item, str) else sequence(item) for item in one_per_item(inputs)]
    if any(isinstance(text, tuple) for text in texts):
        raise InvalidInput("zero-shot `labels` score single texts, not pairs")
    return no_empty_input(texts, field="inputs"), not isinstance(inputs, str)


# transformers' zero-shot-classification pipeline's hypothesis, one per candidate label
DEFAULT_HYPOTHESIS_TEMPLATE = "This example is {}."


def hypotheses(template: str, labels: list[str]) -> list[str]:
    """Each label's NLI hypothesis: `template` formatted with it (`str.format`, as the pipeline does); a
    template the first label leaves unchanged (no `{}`), or that `str.format` cannot fill, is refused."""
    try:
        filled = [template.format(label) for label in labels]
    except (IndexError, KeyError, ValueError) as exc:
        raise InvalidInput(f"`hypothesis_template` {template!r} cannot be filled with a label ({type(exc).__name__}: "
                           f"{exc}); put {{}} where the label goes, e.g. {DEFAULT_HYPOTHESIS_TEMPLATE!r}") from None
    if filled[0] == template:
        raise InvalidInput(f"`hypothesis_template` {template!r} has no {{}} where the label goes, e.g. "
                           f"{DEFAULT_HYPOTHESIS_TEMPLATE!r}")
    return filled


# --- token ids: the embedding routes take one input's ids (a list of integers) where they take a text


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: object) -> bool:
    """One input's token ids: a list of them (an empty one is refused by `no_empty_input`, by name)."""
    return isinstance(value, list) and all(is_token_id(item) for item in value)


def one_per_item(inputs: str | list) -> list:
    """A request's inputs one per item: a string or one input's token ids stand alone."""
    return [inputs] if isinstance(inputs, str) or (inputs and is_token_id(inputs[0])) else inputs


def texts_only(value: object) -> object:
    """A string or a list of strings; anything else is refused in one line (not as a union's error per
    branch, `inputs.str: Input should be a valid string`), token ids by name."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(text, str) for text in value)):
        return value
    if isinstance(value, list) and value and all(is_token_id(item) or is_token_ids(item) for item in value):
        raise InvalidInput("token ids are not accepted here: send the text, a string or a list of strings")
    raise InvalidInput("expected a string or a list of strings")


def texts_or_ids(value: object) -> object:
    """What TEI's embedding routes and OpenAI's take: a string, one input's token ids, or a list whose
    items are each a string or a list of token ids; anything else is refused in one line."""
    if isinstance(value, str) or is_token_ids(value):
        return value
    if isinstance(value, list) and all(isinstance(item, str) or is_token_ids(item) for item in value):
        return value
    raise InvalidInput("expected a string, a list of token ids, or a list of strings and lists of token ids")


def in_vocabulary(ids: Iterable[int], size: int, what: str) -> None:
    """Token ids index a vocabulary of `size` (checked before they become int64: a JSON integer has no bound)."""
    if not all(0 <= token < size for token in ids):
        raise InvalidInput(f"{what} must lie in [0, {size})")


# --- truncation and sizes


def truncation(truncate: bool | None, direction: str = "right", *, auto_truncate: bool = False) -> Truncation:
    """Where a request's over-long inputs lose tokens: at `direction` ("Left" or "Right", either case)
    when it asks to truncate, or when it does not say (None) and the server's --auto-truncate is on;
    otherwise they are refused (413). gRPC always says: proto3 cannot tell false from unset, so as in
    TEI a gRPC request truncates only where it asks."""
    return direction.lower() if (auto_truncate if truncate is None else truncate) else None


def valid_dimensions(dimensions: int | None, width: int) -> None:
    """Matryoshka `dimensions` keep the first d of the model's `width` components: 1 <= d <= width
    (gRPC's may be 0, HTTP's schema refuses it first)."""
    if dimensions is not None and not 0 < dimensions <= width:
        raise InvalidInput(f"`dimensions` must be at least 1 and at most the model's {width}, got {dimensions}")


# --- embedding dtypes and bge-m3's outputs (HTTP's schemas refuse an unknown name as they parse)


def known_embedding_dtype(dtype: str) -> str:
    if dtype not in EMBEDDING_DTYPES:
        raise InvalidInput(f"embedding_dtype {dtype!r} is none of {', '.join(EMBEDDING_DTYPES)}")
    return dtype


def token_vector_dtype(dtype: str) -> str:
    """/embed_multi's dtype: token vectors have no calibration ranges, so float32, binary or ubinary."""
    if known_embedding_dtype(dtype) in CALIBRATED_DTYPES:
        raise NotSupported(f"embedding_dtype {dtype}: token vectors have no calibration ranges "
                           "(float32, binary or ubinary)")
    return dtype


HybridOutput = Literal["dense", "sparse", "colbert"]
HYBRID_OUTPUTS: tuple[str, ...] = get_args(HybridOutput)


def hybrid_outputs(requested: Sequence[str]) -> list[str]:
    """/embed_hybrid's outputs, each once in the order asked; none named (gRPC's unset list): all three."""
    unknown = [name for name in requested if name not in HYBRID_OUTPUTS]
    if unknown:
        raise InvalidInput(f"`outputs` {unknown[0]!r} is none of {', '.join(HYBRID_OUTPUTS)}")
    return list(dict.fromkeys(requested)) or list(HYBRID_OUTPUTS)


# --- ranking: best first, ties in input order


def best_first(scores: np.ndarray) -> np.ndarray:
    """Indices of `scores`, highest first; equal scores keep their input order."""
    return np.argsort(-scores, kind="stable")


def ranked_labels(labels: list[str], scores: np.ndarray) -> list[dict]:
    """A classifier's (or zero-shot's) labels with their scores, best first."""
    return [{"label": labels[i], "score": float(scores[i])} for i in best_first(scores)]


def ranked_texts(scores: np.ndarray, texts: list[str], return_text: bool) -> list[dict]:
    """/rerank's answer: each text's index and score, best first, with the text where asked."""
    return [{"index": int(i), "score": float(scores[i]), **({"text": texts[i]} if return_text else {})}
            for i in best_first(scores)]
