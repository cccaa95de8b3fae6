"""The artifact's fast tokenizer, with our own truncation and no padding (the batcher pads), and
the checkpoint's sentence-transformers prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .errors import InvalidInput, TooLarge

ST_CONFIG = "sentence_bert_config.json"
ST_PROMPTS = "config_sentence_transformers.json"  # `prompts` {name: text} and `default_prompt_name`
TextInput = str | tuple[str, str]  # one text, or a (query, passage) pair for a cross-encoder


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


@dataclass(frozen=True)
class Prompts:
    """Texts prepended to inputs before tokenization, as sentence-transformers' `prompt_name` does
    (e5-style "query: " prefixes)."""

    prompts: dict[str, str]
    default: str  # prepended when a request names no prompt ("" for none)

    @classmethod
    def of_checkpoint(cls, tokenizer_dir: Path, default_name: str | None = None,
                      default_text: str | None = None) -> "Prompts":
        """The checkpoint's prompts; the default is `default_text`, else the prompt named
        `default_name`, else the checkpoint's own `default_prompt_name`. ValueError names a missing one."""
        path = Path(tokenizer_dir) / ST_PROMPTS
        config = json.loads(path.read_text()) if path.is_file() else {}
        prompts = dict(config.get("prompts") or {})
        name = default_name if default_name is not None else config.get("default_prompt_name")
        if default_text is None and name is not None and name not in prompts:
            raise ValueError(f"default prompt name {name!r} is not one of the checkpoint's prompts "
                             f"({', '.join(map(repr, prompts)) or 'it has none'})")
        default = default_text if default_text is not None else prompts.get(name, "") if name else ""
        return cls(prompts, default)

    def apply(self, texts: list[str], name: str | None) -> list[str]:
        if name is None:
            prefix = self.default
        elif name in self.prompts:
            prefix = self.prompts[name]
        else:
            raise InvalidInput(f"`prompt_name` {name!r} is not one of this model's prompts "
                               f"({', '.join(map(repr, self.prompts)) or 'it has none'})")
        return [prefix + text for text in texts] if prefix else texts

    def describe(self) -> dict:
        return {"prompts": self.prompts, "default": self.default}


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

    def encode(self, texts: list[TextInput], truncate: bool) -> list[Encoded]:
        """Token ids and type ids; a pair is one sequence with both segments (a cross-encoder's
        input), truncated longest-first."""
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
