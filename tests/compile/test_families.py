"""RoBERTa, XLM-R and DistilBERT through the same pipeline as BERT: tiny random-weight checkpoints
with real fast tokenizers built here (no downloads), compiled in both layouts, served, and compared
with sentence-transformers and transformers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from artifact.manifest import Manifest
from compile.checkpoint import inspect_checkpoint, load_wrapper
from compile.errors import CompileError
from compile.validate import DRIFT_SENTENCES
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import MAX_SEQ, TINY_LABELS, family_config, family_tokenizer
from tests.support.families import assert_wrappers_compute_what_transformers_does

pytestmark = pytest.mark.slow  # collected first: see conftest.py

SENTENCES = DRIFT_SENTENCES  # what the offline tokenizers are trained on
QUERIES = ["the cat plays a guitar", "Markets fell on Monday.", "zebra quartz jukebox", "a"]  # unseen words included
FAMILIES = ("roberta", "xlm-roberta", "distilbert")
VOCAB_FILES = {"roberta": {"vocab.json", "merges.txt"}, "xlm-roberta": set(), "distilbert": {"vocab.txt"}}  # beside
# tokenizer.json; XLM-R's sentencepiece.bpe.model needs sentencepiece to write


def make_checkpoint(directory: Path, family: str, task: str = "embed") -> Path:
    """A 2-layer random-weight checkpoint of `family`; for embed a sentence-transformers one (mean pooling)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(sum(map(ord, family)))
    tokenizer = family_tokenizer(family, SENTENCES)
    directory.mkdir(parents=True)
    if task == "classify":
        config = family_config(family, len(tokenizer), num_labels=3, id2label=TINY_LABELS,
                         label2id={v: k for k, v in TINY_LABELS.items()})
        AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    else:
        AutoModel.from_config(family_config(family, len(tokenizer))).save_pretrained(directory)
        (directory / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ}))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    tokenizer.save_pretrained(directory)
    if VOCAB_FILES[family]:
        tokenizer.backend_tokenizer.model.save(str(directory))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, task) -> checkpoint directory."""
    root = tmp_path_factory.mktemp("families")
    return {(family, task): make_checkpoint(root / f"{family}-{task}", family, task)
            for family in FAMILIES for task in ("embed", "classify")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", ["embed", "classify"])
def test_wrappers_compute_what_transformers_does(checkpoints, family, task):
    """The padded wrapper (positions from 0, the family's offset inside) equals the transformers model
    fed as transformers feeds it; the packed wrapper equals the padded one."""
    from transformers import AutoTokenizer

    directory = checkpoints[family, task]
    info = inspect_checkpoint(directory, task)
    assert info.max_seq == MAX_SEQ and info.hidden_size == 32
    batch = AutoTokenizer.from_pretrained(directory)(QUERIES + SENTENCES[:3], padding=True, return_tensors="pt")
    assert_wrappers_compute_what_transformers_does(load_wrapper(info, task), directory, task, batch)


LAYOUT_BUCKETS = {"padded": ["2x32"], "packed": ["packed-32"]}  # one bucket each, and the generic library


@pytest.fixture(scope="module")
def embed_artifacts(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """'<family>-<layout>' (also the served name) -> compiled embed artifact."""
    root = tmp_path_factory.mktemp("family-artifacts")
    artifacts = {f"{family}-{layout}": root / f"{family}-{layout}" for family in FAMILIES for layout in LAYOUT_BUCKETS}
    for name, out in artifacts.items():
        family, layout = name.rsplit("-", 1)
        compile_artifact(checkpoints[family, "embed"], out, LAYOUT_BUCKETS[layout], layout=layout)
    return artifacts


@pytest.fixture(scope="module")
def embed_server(serve, embed_artifacts):
    with serve(list(embed_artifacts.values()), "--workers", "1") as server:
        yield server


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUT_BUCKETS)
def test_served_embeddings_match_sentence_transformers(checkpoints, embed_artifacts, embed_server, family, layout):
    from sentence_transformers import SentenceTransformer

    name = f"{family}-{layout}"
    manifest = Manifest.read(embed_artifacts[name])
    assert manifest.model.architecture == {"roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel",
                                           "distilbert": "DistilBertModel"}[family]
    assert manifest.model.model_type == family
    assert manifest.layout == layout and manifest.pooling == "mean" and manifest.validated
    assert manifest.model.max_position_embeddings == MAX_SEQ
    assert manifest.passes.before.matmul == 2 * 8  # per layer: Q, K, V, output, 2 FFN, 2 attention
    assert manifest.passes.strategies["concat"].after.matmul == 2 * 6  # Q, K, V combined in each layer
    assert manifest.passes.strategies["concat"].after.concat > 0
    assert manifest.passes.strategies["concat"].after.permute_dims < manifest.passes.before.permute_dims
    assert manifest.passes.strategies["concat"].attention_fused == 2  # one fused attention kernel per layer
    shipped = {path.name for path in (embed_artifacts[name] / "tokenizer").iterdir()}
    assert shipped == {"tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json", *VOCAB_FILES[family]}
    texts = [*QUERIES, *SENTENCES, " ".join(SENTENCES)]  # the last one is truncated to MAX_SEQ tokens
    response = httpx.post(f"{embed_server.url}/embed", json={"inputs": texts, "model": name, "truncate": True},
                          timeout=60)
    assert response.status_code == 200, response.text
    served = torch.tensor(response.json())
    expected = torch.from_numpy(SentenceTransformer(str(checkpoints[family, "embed"]), device="cpu").encode(texts))
    assert torch.nn.functional.cosine_similarity(served, expected, dim=-1).min() >= 0.9999


@pytest.mark.parametrize("family, layout", [("roberta", "packed"), ("distilbert", "padded")])
def test_served_classifier_matches_transformers(checkpoints, serve, tmp_path, family, layout):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = checkpoints[family, "classify"]
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", LAYOUT_BUCKETS[layout], task="classify",
                                   layout=layout)
    assert manifest.labels == list(TINY_LABELS.values()) and manifest.validated
    assert manifest.passes.strategies["concat"].after.matmul == 2 * 6 + 2  # + the head's two linears
    texts = QUERIES + SENTENCES[:3]
    model = AutoModelForSequenceClassification.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(**AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="pt")).logits
    with serve([tmp_path / "artifact"], "--workers", "1") as server:
        response = httpx.post(f"{server.url}/predict", json={"inputs": [[text] for text in texts]}, timeout=60)
    assert response.status_code == 200, response.text
    for expected, predictions in zip(torch.softmax(logits, -1).numpy(), response.json()):
        scores = {p["label"]: p["score"] for p in predictions}
        np.testing.assert_allclose([scores[label] for label in TINY_LABELS.values()], expected, atol=1e-4)


def test_a_classifier_with_the_default_labels_is_served_with_them(serve, tmp_path):
    """transformers writes no id2label (nor num_labels) for its default two labels: the artifact still
    names LABEL_0 and LABEL_1, and /predict ranks them (with no labels it failed on every request)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    from loadtest.random_checkpoint import copy_tokenizer
    from tests.support.checkpoints import tiny_config

    torch.manual_seed(5)
    directory = tmp_path / "two-labels"
    BertForSequenceClassification(tiny_config(initializer_range=0.2)).save_pretrained(directory)
    copy_tokenizer(directory)
    assert not {"id2label", "num_labels"} & set(json.loads((directory / "config.json").read_text()))
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", ["1x16"], task="classify")
    assert manifest.labels == ["LABEL_0", "LABEL_1"] and manifest.output_dim == 2
    model = BertForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        batch = AutoTokenizer.from_pretrained(directory)(QUERIES[:2], padding=True, return_tensors="pt")
        logits = model(**batch).logits
    with serve([tmp_path / "artifact"], "--workers", "1") as server:
        response = httpx.post(f"{server.url}/predict", json={"inputs": [[query] for query in QUERIES[:2]]},
                              timeout=60)
    assert response.status_code == 200, response.text
    for expected, predictions in zip(torch.softmax(logits, -1).numpy(), response.json()):
        scores = {p["label"]: p["score"] for p in predictions}
        np.testing.assert_allclose([scores["LABEL_0"], scores["LABEL_1"]], expected, atol=1e-4)


def test_other_model_types_and_heads_are_refused(tmp_path, checkpoints):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CompileError, match=r"not a BERT checkpoint \(model_type='gpt2'; supported: bert, roberta, "
                                           r"xlm-roberta, distilbert, electra, mpnet, modernbert, deberta-v2\)"):
        inspect_checkpoint(gpt2, "embed")
    with pytest.raises(CompileError, match="not a DistilBertForSequenceClassification checkpoint"):
        inspect_checkpoint(checkpoints["distilbert", "embed"], "classify")
    with pytest.raises(CompileError, match="longer than the model's max_position_embeddings"):
        compile_artifact(checkpoints["roberta", "embed"], tmp_path / "out", [f"1x{MAX_SEQ + 1}"])


def test_the_attention_geometry_is_read_from_each_familys_config(checkpoints):
    """What `--attention-products auto` times its kernel at: DistilBERT names heads and width its own way."""
    from compile.attention_products import Geometry
    from compile.checkpoint import inspect_checkpoint

    for family in FAMILIES:
        info = inspect_checkpoint(checkpoints[(family, "embed")], "embed", "auto")
        assert Geometry.of(info) == Geometry(heads=2, head_size=16, max_seq=MAX_SEQ)


def test_distilbert_linears_are_pruned_by_kind(checkpoints):
    from compile.passes.sparsity import block_density, prune_model

    wrapper = load_wrapper(inspect_checkpoint(checkpoints["distilbert", "embed"], "embed"), "embed")
    assert prune_model(wrapper.bert, 0.25, (16, 1), ("ffn", "attention_output")) == 2 * 3
    assert prune_model(wrapper.bert, 0.25, (16, 1), ("qkv",)) == 2 * 3
    layer = wrapper.bert.transformer.layer[0]
    assert block_density(layer.ffn.lin1.weight.detach().numpy(), (16, 1)) == 0.25
