"""The checkpoint's fast tokenizer as the artifact ships it: its own tokenizer.json, or, for a checkpoint
that ships only a slow tokenizer's files (vocab.json and merges.txt, a SentencePiece model such as
DeBERTa-v3's spm.model), the tokenizer transformers' AutoTokenizer builds from them. The server then
tokenizes as transformers does, special tokens and pair templates included (RoBERTa's
`<s> A </s></s> B </s>`), with no rule of its own for any family."""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from pathlib import Path

from .errors import CompileError

TOKENIZER_JSON = "tokenizer.json"
_converted: dict[Path, Path] = {}  # a checkpoint's directory -> its converted tokenizer.json, once per process


def fast_tokenizer_file(model_dir: Path) -> Path:
    """The tokenizer.json that tokenizes as transformers' AutoTokenizer does for `model_dir`: the
    checkpoint's own, else the one converted from its slow tokenizer's files (kept for this process)."""
    own = Path(model_dir) / TOKENIZER_JSON
    if own.is_file():
        return own
    directory = Path(model_dir).resolve()
    if directory not in _converted:
        _converted[directory] = _convert(directory)
    return _converted[directory]


def _convert(model_dir: Path) -> Path:
    """AutoTokenizer's fast tokenizer of `model_dir`, saved as a tokenizer.json in a directory removed at exit."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, said in one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, and transformers builds no tokenizer from its "
                           f"files: {reason}") from None
    # transformers builds an empty tokenizer (its special tokens alone) where the files it reads are missing
    missing = [name for key, name in getattr(tokenizer, "vocab_files_names", {}).items()
               if key != "tokenizer_file" and not (model_dir / name).is_file()]
    if missing:
        raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, nor the {' and '.join(missing)} its "
                           f"{type(tokenizer).__name__} is built from")
    if not getattr(tokenizer, "is_fast", False):
        raise CompileError(f"{model_dir} has no {TOKENIZER_JSON}, and its {type(tokenizer).__name__} has no fast "
                           "(tokenizers) version to convert to")
    converted = Path(tempfile.mkdtemp(prefix="bert-compile-tokenizer-"))
    atexit.register(shutil.rmtree, converted, True)
    path = converted / hashlib.sha256(str(model_dir).encode()).hexdigest()[:16] / TOKENIZER_JSON
    path.parent.mkdir()
    tokenizer.backend_tokenizer.save(str(path))
    return path
