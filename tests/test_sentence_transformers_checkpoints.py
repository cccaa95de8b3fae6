"""Checkpoints as sentence-transformers saves them today: Dense layers after pooling
(compile/dense_head.py) compiled in, the Pooling and length configs of sentence-transformers 6 read,
so that the libraries and the server answer what `SentenceTransformer.encode` answers; what is not
compiled (modules, poolings, a pooling without the prompt's tokens) is refused in one line rather
than left out."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from artifact.loader import load_artifact
from compile.checkpoint import inspect_checkpoint
from compile.errors import CompileError
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import save_tiny_sentence_transformer

pytestmark = pytest.mark.slow  # four compiles: collected first, see conftest.py

TEXTS = ["hello", "the weather tomorrow", "A man is playing a guitar on stage while the crowd sings along."]
DENSE_WIDTH = 24  # the tiny BERT's 32 features projected to 24
MAX_SEQ_LENGTH = 32  # sentence-transformers' input limit, under the model's 64 positions


def save_dense_checkpoint(directory, pooling: str):
    """A tiny BERT saved by sentence-transformers itself with `pooling`, a 32 -> 24 tanh Dense layer
    and Normalize (LaBSE's and distiluse's layout)."""
    from sentence_transformers import SentenceTransformer, models

    base = save_tiny_sentence_transformer(directory / "base", seed=3)
    torch.manual_seed(4)
    encoder = SentenceTransformer(str(base), device="cpu")
    encoder.max_seq_length = MAX_SEQ_LENGTH  # sentence-transformers 6 saves it as the tokenizer's model_max_length
    dense = models.Dense(32, DENSE_WIDTH, activation_function=torch.nn.Tanh())
    torch.nn.init.normal_(dense.linear.weight, std=0.5)  # a layer that moves the embedding: random, not ~0
    modules = [encoder[0], models.Pooling(32, pooling_mode=pooling), dense, models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory / pooling))
    return directory / pooling


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    return {pooling: save_dense_checkpoint(tmp_path_factory.mktemp(pooling), pooling)
            for pooling in ("mean", "cls", "max")}


@pytest.fixture(scope="module")
def dense_dir(dense_dirs):
    return dense_dirs["mean"]


def expected(directory, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(directory), device="cpu").encode(texts, normalize_embeddings=True)


def tokenized(directory, texts):
    from transformers import AutoTokenizer

    batch = AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="np")
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("pooling, layout, buckets", [("mean", "padded", ["2x32"]), ("mean", "packed", ["packed-32"]),
                                                      ("cls", "packed", ["packed-32"]), ("max", "padded", ["2x32"])])
def test_dense_layers_are_compiled_into_the_libraries(tmp_path, dense_dirs, pooling, layout, buckets):
    checkpoint = dense_dirs[pooling]
    manifest, _ = compile_artifact(checkpoint, tmp_path / layout, buckets, layout=layout)
    assert manifest.output_dim == DENSE_WIDTH and manifest.pooling == pooling
    model = load_artifact(tmp_path / layout)
    ids, mask = tokenized(checkpoint, TEXTS)
    answers = np.concatenate([model.run(ids[i:i + 2], mask[i:i + 2]).output for i in range(0, len(TEXTS), 2)])
    answers /= np.linalg.norm(answers, axis=1, keepdims=True)
    np.testing.assert_allclose(answers, expected(checkpoint, TEXTS), atol=1e-5)


def test_the_server_cuts_inputs_where_sentence_transformers_does(tmp_path, dense_dir):
    """sentence-transformers 6 keeps `max_seq_length` as the tokenizer's `model_max_length`, not in
    sentence_bert_config.json: the served limit is still the one `encode` cuts at."""
    from sentence_transformers import SentenceTransformer

    from service.tokenization import max_input_length

    assert "max_seq_length" not in json.loads((dense_dir / "sentence_bert_config.json").read_text())
    assert SentenceTransformer(str(dense_dir), device="cpu").max_seq_length == MAX_SEQ_LENGTH
    assert max_input_length(64, dense_dir) == MAX_SEQ_LENGTH
    legacy = tmp_path / "legacy"  # sentence-transformers < 6: the limit in sentence_bert_config.json wins
    legacy.mkdir()
    (legacy / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    (legacy / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    assert max_input_length(64, legacy) == 48
    (legacy / "sentence_bert_config.json").unlink()  # a plain checkpoint: the model's limit, as TEI takes it
    assert max_input_length(64, legacy) == 64


def test_a_checkpoint_saved_by_current_sentence_transformers_pools_as_configured(dense_dir):
    """sentence-transformers 5.2+ writes `pooling_mode: mean`, earlier versions one bool per mode."""
    assert json.loads((dense_dir / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    info = inspect_checkpoint(dense_dir, "embed")
    assert info.pooling == "mean" and [layer.out_features for layer in info.dense] == [DENSE_WIDTH]
    assert info.output_dim == DENSE_WIDTH


def _edited(dense_dir, tmp_path, edit) -> object:
    copy = shutil.copytree(dense_dir, tmp_path / "edited")
    edit(copy)
    return copy


def _set_json(path, **values):
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "modules.json").write_text(json.dumps(json.loads((d / "modules.json").read_text()) + [
        {"idx": 4, "name": "4", "path": "4_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}])),
     "sentence-transformers module 'sentence_transformers.models.LayerNorm' is not compiled"),
    (lambda d: _set_json(d / "2_Dense" / "config.json", activation_function="torch.nn.modules.activation.SiLU"),
     "Dense activation torch.nn.modules.activation.SiLU is not compiled"),
    (lambda d: _set_json(d / "2_Dense" / "config.json", in_features=16),
     "Dense takes 16 features where the embedding has 32"),
    (lambda d: (d / "modules.json").write_text(json.dumps(
        [m for m in json.loads((d / "modules.json").read_text()) if m["path"] != "2_Dense"]
        + [{"idx": 4, "name": "4", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}])),
     "a Dense module after Normalize is not compiled"),
    (lambda d: _set_json(d / "1_Pooling" / "config.json", pooling_mode="lasttoken"),
     "sentence-transformers pooling lasttoken is not compiled"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})),
     "sentence-transformers pooling ['cls', 'mean'] is not compiled"),
])
def test_what_is_not_compiled_is_refused(tmp_path, dense_dir, edit, message):
    with pytest.raises(CompileError, match=re.escape(message)) as refused:
        inspect_checkpoint(_edited(dense_dir, tmp_path, edit), "embed")
    assert str(refused.value).startswith(str(tmp_path / "edited")) and "\n" not in str(refused.value)


def test_a_pooling_without_the_prompts_tokens_is_refused_where_the_checkpoint_has_prompts(tmp_path, dense_dir):
    """`include_prompt: false` pools without the prompt's tokens, which the libraries cannot do; the
    server would prepend the checkpoint's prompts and pool them in."""
    def prompted(directory):
        _set_json(directory / "1_Pooling" / "config.json", include_prompt=False)
        _set_json(directory / "config_sentence_transformers.json", prompts={"query": "query: "},
                  default_prompt_name="query")

    with pytest.raises(CompileError, match=re.escape("its Pooling leaves the prompt's tokens out (include_prompt: "
                                                     "false), which the libraries do not compile")):
        inspect_checkpoint(_edited(dense_dir, tmp_path, prompted), "embed")
    unprompted = _edited(dense_dir, tmp_path / "unprompted", lambda d: _set_json(
        d / "1_Pooling" / "config.json", include_prompt=False))
    assert inspect_checkpoint(unprompted, "embed").pooling == "mean"  # no prompt: nothing to leave out


def test_legacy_pooling_flags_are_read(tmp_path, dense_dir):
    copy = _edited(dense_dir, tmp_path, lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})))
    assert inspect_checkpoint(copy, "embed").pooling == "cls"
