"""The artifact's fast tokenizer, with our own truncation and no padding (the batcher pads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .errors import InvalidInput, TooLarge

ST_CONFIG = "sentence_bert_config.json"


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int64 [length], special tokens included
    type_ids: np.ndarray  # int64 [length]

    def __len__(self) -> int:
        return len(self.ids)


def max_input_length(model_limit: int, tokenizer_dir: Path) -> int:
    """The model's limit, lowered by a sentence-transformers `max_seq_length` as TEI does
    (the compile stage copies that file next to the tokenizer)."""
    path = Path(tokenizer_dir) / ST_CONFIG
    st_limit = json.loads(path.read_text()).get("max_seq_length") if path.is_file() else None
    return min(model_limit, int(st_limit)) if st_limit else model_limit


class TextTokenizer:
    """Encodes batches of texts; over-long inputs are truncated or refused with 413."""

    def __init__(self, tokenizer_file: Path, max_length: int):
        self.max_length = max_length
        self._full = Tokenizer.from_file(str(tokenizer_file))
        self._full.no_padding()
        self._full.no_truncation()  # the shipped tokenizer.json may truncate at 128 and pad
        self._truncating = Tokenizer.from_file(str(tokenizer_file))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_length)

    def tokens(self, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
        """TEI's /tokenize: per input, each token's id, its text (the input's own characters, or
        the special token), whether it is special, and its character span (None when special)."""
        result = []
        for text, encoding in zip(texts, self._full.encode_batch(texts, add_special_tokens=add_special_tokens)):
            tokens = []
            for token_id, token, special, (start, stop) in zip(encoding.ids, encoding.tokens,
                                                               encoding.special_tokens_mask, encoding.offsets):
                if special:
                    tokens.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
                else:
                    tokens.append({"id": token_id, "text": text[start:stop], "special": False,
                                   "start": start, "stop": stop})
            result.append(tokens)
        return result

    def decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        vocab = self._full.get_vocab_size()
        if any(not 0 <= token < vocab for row in ids for token in row):
            raise InvalidInput(f"`ids` must lie in [0, {vocab})")
        return self._full.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, texts: list[str], truncate: bool) -> list[Encoded]:
        tokenizer = self._truncating if truncate else self._full
        encodings = tokenizer.encode_batch(texts)
        encoded = []
        for encoding in encodings:
            if len(encoding.ids) > self.max_length:
                raise TooLarge(
                    f"`inputs` must have less than {self.max_length} tokens. Given: {len(encoding.ids)}"
                )
            encoded.append(Encoded(np.asarray(encoding.ids, dtype=np.int64), np.asarray(encoding.type_ids, dtype=np.int64)))
        return encoded
