"""A ColBERT (PyLate) checkpoint's query and document settings, read as PyLate reads them.

PyLate writes them into `config_sentence_transformers.json` (which the compile copies next to the
tokenizer): the prefix token inserted after [CLS], each side's length, whether queries are padded
with [MASK] up to their length (query expansion) and whether those are attended to, and the words
whose tokens a document's output leaves out (punctuation by default). The compile stage reads them
to detect a ColBERT checkpoint, the service to tokenize its queries and documents.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

ST_CONFIG = "config_sentence_transformers.json"
COLBERT_KEYS = ("query_prefix", "document_prefix", "query_length", "document_length", "do_query_expansion",
                "attend_to_expansion_tokens", "skiplist_words")


@dataclass(frozen=True)
class ColbertSettings:
    """PyLate's `ColBERT` attributes, with its defaults where the checkpoint names none."""

    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: tuple[str, ...] = tuple(string.punctuation)

    @classmethod
    def of_checkpoint(cls, directory: Path) -> ColbertSettings | None:
        """The checkpoint's settings, or None where its config names none of them (not a PyLate model)."""
        path = Path(directory) / ST_CONFIG
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not any(key in config for key in COLBERT_KEYS):
            return None
        found = {key: config[key] for key in COLBERT_KEYS if config.get(key) is not None}
        if "skiplist_words" in found:
            found["skiplist_words"] = tuple(found["skiplist_words"])
        settings = cls(**found)
        if not settings.do_query_expansion:  # as PyLate: nothing to attend to
            settings = cls(**{**found, "attend_to_expansion_tokens": False})
        return settings
