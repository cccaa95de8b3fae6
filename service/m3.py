"""bge-m3's three outputs from its libraries' two: the dense vector is the pooled row, and each token's
output row is its ColBERT vector followed by its lexical weight (compile/m3_heads.py). Split here as
FlagEmbedding's `BGEM3FlagModel.encode` computes them: the lexical weights' maximum per token id,
the special tokens ([CLS], [EOS], padding, unknown) and zero weights left out; the ColBERT vectors of
every token after the first, L2-normalized."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .tokenization import Encoded

SPECIAL_KEYS = ("cls_token", "eos_token", "pad_token", "unk_token")  # the tokens BGEM3FlagModel leaves out
XLM_R_SPECIALS = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


class M3Outputs:
    def __init__(self, tokenizer_dir: Path):
        tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        named = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = Path(tokenizer_dir) / name
            if path.is_file():
                named |= {key: value for key, value in json.loads(path.read_text()).items() if key in SPECIAL_KEYS}
        tokens = [_content(named.get(key, XLM_R_SPECIALS[key])) for key in SPECIAL_KEYS]
        self.special_ids = np.asarray([tokenizer.token_to_id(token) for token in tokens
                                       if tokenizer.token_to_id(token) is not None], dtype=np.int64)

    def lexical_weights(self, encoded: Encoded, rows: np.ndarray) -> list[dict]:
        """TEI's sparse answer: `{"index": token id, "value": its largest weight}` by token id."""
        weights, ids = rows[:len(encoded), -1], encoded.ids
        kept = (weights > 0) & ~np.isin(ids, self.special_ids)
        best: dict[int, float] = {}
        for token, weight in zip(ids[kept].tolist(), weights[kept].tolist()):
            if weight > best.get(token, 0.0):
                best[token] = weight
        return [{"index": token, "value": best[token]} for token in sorted(best)]

    @staticmethod
    def colbert_vectors(encoded: Encoded, rows: np.ndarray) -> np.ndarray:
        vectors = rows[1:len(encoded), :-1]
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    return token["content"] if isinstance(token, dict) else token
