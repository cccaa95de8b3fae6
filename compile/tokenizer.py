"""The checkpoint's fast tokenizer as the artifact ships it: the one transformers' AutoTokenizer loads
from the checkpoint, saved as a tokenizer.json. That is its own tokenizer.json with what its
tokenizer_config.json changes (a `do_lower_case` of its own), or, for a checkpoint that ships only a
slow tokenizer's files (vocab.json and merges.txt, a SentencePiece model such as DeBERTa-v3's
spm.model), the tokenizer transformers builds from them. The server then tokenizes as transformers
(and sentence-transformers) do, special tokens and pair templates included (RoBERTa's
`<s> A </s></s> B </s>`), with no rule of its own for any family."""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from pathlib import Path

from .errors import CompileError

TOKENIZER_JSON = "tokenizer.json"
_loaded: dict[Path, Path] = {}  # a checkpoint's directory -> the tokenizer.json saved for it, once per process


def fast_tokenizer_file(model_dir: Path) -> Path:
    """The tokenizer.json that tokenizes as transformers' AutoTokenizer does for `model_dir` (kept for
    this process); the checkpoint's own where transformers cannot load its tokenizer (TEI reads that
    file alone)."""
    directory = Path(model_dir).resolve()
    if directory not in _loaded:
        _loaded[directory] = _save(directory)
    return _loaded[directory]


def _save(model_dir: Path) -> Path:
    """AutoTokenizer's fast tokenizer of `model_dir`, saved as a tokenizer.json in a directory removed at exit."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    own = model_dir / TOKENIZER_JSON
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, said in one line
        if own.is_file():
            return own
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, and transformers builds no tokenizer from its "
                           f"files: {reason}") from None
    if not own.is_file():  # transformers builds an empty tokenizer (special tokens alone) without the files it reads
        missing = [name for key, name in getattr(tokenizer, "vocab_files_names", {}).items()
                   if key != "tokenizer_file" and not (model_dir / name).is_file()]
        if missing:
            raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, nor the {' and '.join(missing)} its "
                               f"{type(tokenizer).__name__} is built from")
    if not getattr(tokenizer, "is_fast", False):
        if own.is_file():
            return own
        raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, and its {type(tokenizer).__name__} has no fast "
                           "(tokenizers) version to convert to")
    saved = Path(tempfile.mkdtemp(prefix="bert-compile-tokenizer-"))
    atexit.register(shutil.rmtree, saved, True)
    path = saved / hashlib.sha256(str(model_dir).encode()).hexdigest()[:16] / TOKENIZER_JSON
    path.parent.mkdir()
    tokenizer.backend_tokenizer.save(str(path))
    return path
