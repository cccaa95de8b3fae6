"""The artifact's fast tokenizer, with our own truncation and no padding (the batcher pads), and
the checkpoint's sentence-transformers prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .errors import InvalidInput, TooLarge
from .inputs import TextInput, TokenIds, Truncation, in_vocabulary

ST_CONFIG = "sentence_bert_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # model_max_length: sentence-transformers 6's max_seq_length
ST_PROMPTS = "config_sentence_transformers.json"  # `prompts` {name: text} and `default_prompt_name`

@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int64 [length], special tokens included
    type_ids: np.ndarray  # int64 [length]

    def __len__(self) -> int:
        return len(self.ids)


def max_input_length(model_limit: int, tokenizer_dir: Path) -> int:
    """The model's limit, lowered as sentence-transformers lowers it (and TEI): a sentence-transformers
    checkpoint's `max_seq_length`, or where its config has none (sentence-transformers 6 keeps it as
    the tokenizer's), the tokenizer's `model_max_length` (the compile copies both files next to the
    tokenizer). A plain checkpoint takes the model's limit."""
    directory = Path(tokenizer_dir)
    if not (directory / ST_CONFIG).is_file():
        return model_limit
    limit = json.loads((directory / ST_CONFIG).read_text()).get("max_seq_length")
    if limit is None and (directory / TOKENIZER_CONFIG).is_file():
        limit = json.loads((directory / TOKENIZER_CONFIG).read_text()).get("model_max_length")
    return min(model_limit, int(limit)) if isinstance(limit, (int, float)) and limit >= 1 else model_limit


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

    def apply(self, inputs: list[str | TokenIds], name: str | None) -> list[str | TokenIds]:
        """Every text with the prompt named (else the default) prepended; token ids are run as given,
        so a request naming a prompt for them is refused rather than answered without it."""
        if name is None:
            prefix = self.default
        elif name in self.prompts:
            prefix = self.prompts[name]
        else:
            raise InvalidInput(f"`prompt_name` {name!r} is not one of this model's prompts "
                               f"({', '.join(map(repr, self.prompts)) or 'it has none'})")
        if name is not None and any(isinstance(item, list) for item in inputs):
            raise InvalidInput("`prompt_name` applies to text: token ids are run as given")
        return [prefix + item if isinstance(item, str) else item for item in inputs] if prefix else inputs

    def describe(self) -> dict:
        return {"prompts": self.prompts, "default": self.default}


class TextTokenizer:
    """Encodes batches of texts (or takes token ids); over-long inputs are truncated or refused with 413."""

    def __init__(self, tokenizer_file: Path, max_length: int, vocab_size: int):
        self.max_length = max_length
        self.vocab_size = vocab_size  # the model's embedding rows: what an input id must lie under
        self._full = Tokenizer.from_file(str(tokenizer_file))
        self._full.no_padding()
        self._full.no_truncation()  # the shipped tokenizer.json may truncate at 128 and pad
        self._file = tokenizer_file
        # special tokens stay: the text loses its end, or its start; a pair its longer text's tokens first
        self._truncating = {(direction, "longest_first"): self._truncator(direction, "longest_first")
                            for direction in ("right", "left")}

    def _truncator(self, direction: str, strategy: str) -> Tokenizer:
        """The tokenizer that cuts over-long inputs at `direction`; a pair by `strategy` (`tokenizers`')."""
        tokenizer = Tokenizer.from_file(str(self._file))
        tokenizer.no_padding()
        tokenizer.enable_truncation(self.max_length, strategy=strategy, direction=direction)
        return tokenizer

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
        in_vocabulary((token for row in ids for token in row), self._full.get_vocab_size(), "`ids`")
        return self._full.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, inputs: list[TextInput | TokenIds], truncation: Truncation,
               premise_first: bool = False) -> list[Encoded]:
        """Token ids and type ids; a pair is one sequence with both segments (a cross-encoder's
        input), truncated longest-first, or with `premise_first` (an NLI premise and hypothesis) its
        first text only, as transformers' zero-shot pipeline cuts it; token ids are taken as given
        (`encode_ids`)."""
        texts = [item for item in inputs if not isinstance(item, list)]
        tokenizer = self._full if truncation is None else self._truncation(truncation, premise_first)
        try:
            encodings = iter(tokenizer.encode_batch(texts) if texts else ())
        except Exception as exc:  # tokenizers' own: a pair whose second text alone is over the limit
            if not premise_first or "too short" not in str(exc):
                raise
            raise TooLarge(f"`inputs` must have at most {self.max_length} tokens: a hypothesis and the special "
                           "tokens leave no room for the text") from None
        encoded = []
        for item in inputs:
            if isinstance(item, list):
                encoded.append(self.encode_ids(item, truncation))
                continue
            encoding = next(encodings)
            self._check_length(len(encoding.ids))
            encoded.append(Encoded(np.asarray(encoding.ids, dtype=np.int64),
                                   np.asarray(encoding.type_ids, dtype=np.int64)))
        return encoded

    def _truncation(self, direction: str, premise_first: bool) -> Tokenizer:
        """The truncating tokenizer of a direction and pair strategy; only_first's built on first use
        (a dict's item assignment is atomic: two threads at once at worst build it twice)."""
        key = (direction, "only_first" if premise_first else "longest_first")
        if key not in self._truncating:
            self._truncating[key] = self._truncator(*key)
        return self._truncating[key]

    def encode_ids(self, ids: TokenIds, truncation: Truncation) -> Encoded:
        """One input given as token ids (TEI's and OpenAI's pre-tokenized input): run as given, no
        special tokens added, one segment; cut to the length limit at its end or start when truncating."""
        in_vocabulary(ids, self.vocab_size, "token ids")
        if truncation == "right":
            ids = ids[: self.max_length]
        elif truncation == "left":
            ids = ids[-self.max_length:]
        self._check_length(len(ids))
        return Encoded(np.asarray(ids, dtype=np.int64), np.zeros(len(ids), dtype=np.int64))

    def _check_length(self, length: int) -> None:
        if length > self.max_length:
            raise TooLarge(f"`inputs` must have at most {self.max_length} tokens. Given: {length}")
