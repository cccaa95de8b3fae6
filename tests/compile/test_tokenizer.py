"""A checkpoint's tokenizer as the artifact ships it: the one transformers' AutoTokenizer loads, also
where the checkpoint ships only a slow tokenizer's files (RoBERTa's vocab.json and merges.txt, XLM-R's
SentencePiece model) or its tokenizer_config.json changes its tokenizer.json; the server's tokenizer
then encodes single texts and pairs, whole and truncated, as transformers does."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from compile.errors import CompileError
from compile.tokenizer import fast_tokenizer_file
from compile.validate import DRIFT_SENTENCES
from service.tokenization import TextTokenizer
from tests.support.checkpoints import tiny_bpe_tokenizer

HYPOTHESES = ["It is music.", "About rain."]
LIMIT = 20  # tokens: every pair below is cut, not its hypothesis alone


def slow_checkpoint(directory: Path, family: str) -> Path:
    """A checkpoint directory of `family` whose tokenizer is its slow files alone, no tokenizer.json."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": family}))
    if family == "roberta":
        tokenizer = tiny_bpe_tokenizer(DRIFT_SENTENCES)
        tokenizer.save_pretrained(directory)
        tokenizer.backend_tokenizer.model.save(str(directory))  # vocab.json and merges.txt
        (directory / "tokenizer.json").unlink()
    else:  # XLM-R's SentencePiece unigram model, RoBERTa's special tokens at fairseq's ids
        import sentencepiece

        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(DRIFT_SENTENCES * 4), model_writer=model, vocab_size=120, model_type="unigram",
            bos_id=0, pad_id=1, eos_id=2, unk_id=3, hard_vocab_limit=False, minloglevel=2)
        (directory / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    return directory


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta"])
def test_a_slow_tokenizer_is_converted_to_the_one_transformers_builds(tmp_path, family):
    from transformers import AutoTokenizer

    directory = slow_checkpoint(tmp_path / family, family)
    converted = fast_tokenizer_file(directory)
    assert converted.name == "tokenizer.json" and not (directory / "tokenizer.json").exists()
    assert fast_tokenizer_file(directory) == converted  # converted once per process
    expected = AutoTokenizer.from_pretrained(directory)
    served = TextTokenizer(converted, LIMIT, len(expected))
    served_long = TextTokenizer(converted, 512, len(expected))
    singles = ["a", *DRIFT_SENTENCES[:3]]
    pairs = [(text, hypothesis) for text in DRIFT_SENTENCES[3:6] for hypothesis in HYPOTHESES]
    whole = served_long.encode([*singles, *pairs], truncation=None)
    assert [e.ids.tolist() for e in whole] == [expected(*([item] if isinstance(item, str) else item))["input_ids"]
                                               for item in [*singles, *pairs]]
    assert all(len(encoded) > LIMIT for encoded in whole[len(singles):])
    assert [e.ids.tolist() for e in served.encode(singles, "right")] == [
        expected(text, truncation=True, max_length=LIMIT)["input_ids"] for text in singles]
    for premise_first, strategy in ((False, "longest_first"), (True, "only_first")):
        assert [e.ids.tolist() for e in served.encode(pairs, "right", premise_first)] == [
            expected(*pair, truncation=strategy, max_length=LIMIT)["input_ids"] for pair in pairs]


def test_the_tokenizer_config_changes_what_transformers_loads(tmp_path):
    """A tokenizer_config.json whose do_lower_case says otherwise than its tokenizer.json's normalizer:
    transformers follows the config, and so does the tokenizer the artifact ships."""
    from transformers import AutoTokenizer

    from loadtest.random_checkpoint import copy_tokenizer

    directory = tmp_path / "cased"
    directory.mkdir()
    copy_tokenizer(directory)  # MiniLM's: lowercases
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    expected = AutoTokenizer.from_pretrained(directory)
    served = TextTokenizer(fast_tokenizer_file(directory), 512, len(expected))
    inputs = ["Hello World", ("Hello there", "this is lower")]
    assert [e.ids.tolist() for e in served.encode(inputs, truncation=None)] == [
        expected("Hello World")["input_ids"], expected("Hello there", "this is lower")["input_ids"]]
    assert expected.unk_token_id in expected("Hello World")["input_ids"]  # cased words MiniLM's vocabulary lacks


def test_a_checkpoint_without_its_tokenizers_files_is_refused(tmp_path):
    """transformers builds a tokenizer of special tokens alone where the files it reads are missing;
    the compile refuses it rather than ship it."""
    directory = tmp_path / "no-tokenizer"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CompileError, match=r"no-tokenizer has no tokenizer.json, nor the vocab.txt its "
                                           r"BertTokenizer is built from$"):
        fast_tokenizer_file(directory)
