"""A ColBERT (PyLate) model's queries and documents: tokenized and filtered as PyLate's
`ColBERT.encode(is_query=...)` does, around the libraries' projected token output.

A query is cut to `query_length - 1` tokens ([CLS] and [SEP] included), gets the query prefix token
after [CLS], and with query expansion is padded with [MASK] up to `query_length`; the expansion
tokens are computed but not attended to (unless the checkpoint attends to them), and every token's
vector is kept. A document is cut to `document_length - 1`, gets the document prefix, and its
vectors leave out the skip-list's tokens (punctuation). Every vector is L2-normalized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from artifact.colbert import ColbertSettings

from .errors import InvalidInput
from .inputs import TextInput, TokenIds, Truncation
from .tokenization import Encoded


class ColbertEncoder:
    """PyLate's tokenization of queries and documents, and which token vectors each keeps."""

    def __init__(self, tokenizer_file: Path, settings: ColbertSettings):
        self.settings = settings
        base = Tokenizer.from_file(str(tokenizer_file))
        self.query_prefix = self._prefix_id(base, settings.query_prefix)
        self.document_prefix = self._prefix_id(base, settings.document_prefix)
        self.mask_id = _mask_id(base)
        self.skiplist = np.asarray(sorted({_token_id(base, word) for word in settings.skiplist_words}), dtype=np.int64)
        self._tokenizers = {}
        for is_query, length, prefix in ((True, settings.query_length, self.query_prefix),
                                         (False, settings.document_length, self.document_prefix)):
            for direction in ("right", "left"):
                tokenizer = Tokenizer.from_file(str(tokenizer_file))
                tokenizer.no_padding()
                tokenizer.enable_truncation(length - (prefix is not None), direction=direction)
                self._tokenizers[is_query, direction] = tokenizer

    @staticmethod
    def _prefix_id(tokenizer: Tokenizer, prefix: str) -> int | None:
        if not prefix:
            return None
        token = tokenizer.token_to_id(prefix)
        if token is None:
            raise ValueError(f"the ColBERT prefix {prefix!r} is not a token of the model's tokenizer")
        return token

    def encode(self, inputs: list[TextInput | TokenIds], is_query: bool, truncation: Truncation) -> list[Encoded]:
        """The inputs as PyLate runs them; each is cut to its side's length (as PyLate always does), at
        the end unless `truncation` says "left"."""
        if any(not isinstance(item, str) for item in inputs):
            raise InvalidInput("a ColBERT model takes texts: its prefix and query expansion are added to their tokens")
        tokenizer = self._tokenizers[is_query, truncation or "right"]
        prefix = self.query_prefix if is_query else self.document_prefix
        settings, encoded = self.settings, []
        for encoding in tokenizer.encode_batch(inputs):
            ids = list(encoding.ids)
            if prefix is not None:
                ids.insert(1, prefix)
            attended = None
            if is_query and settings.do_query_expansion and len(ids) < settings.query_length:
                attended = None if settings.attend_to_expansion_tokens else len(ids)
                ids += [self.mask_id] * (settings.query_length - len(ids))
            ids = np.asarray(ids, dtype=np.int64)
            encoded.append(Encoded(ids, np.zeros_like(ids), tokens=True, attended=attended))
        return encoded

    def vectors(self, encoded: Encoded, states: np.ndarray, is_query: bool) -> np.ndarray:
        """The token vectors PyLate returns for one input: every query token, or the document's tokens
        outside the skip-list; each L2-normalized."""
        states = states[:len(encoded)]
        if not is_query:
            states = states[~np.isin(encoded.ids, self.skiplist)]
        return states / np.maximum(np.linalg.norm(states, axis=1, keepdims=True), 1e-12)


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    """transformers' `convert_tokens_to_ids`: a token outside the vocabulary is the unknown token's id."""
    found = tokenizer.token_to_id(token)
    if found is not None:
        return found
    unknown = getattr(tokenizer.model, "unk_token", None)
    return tokenizer.token_to_id(unknown) if unknown is not None else -1


def _mask_id(tokenizer: Tokenizer) -> int:
    """The mask token that pads a query (BERT's [MASK], XLM-R's <mask>)."""
    for token in ("[MASK]", "<mask>"):
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise ValueError("the model's tokenizer has no mask token for ColBERT's query expansion")
