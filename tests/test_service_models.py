"""Several models in one server, selected by name; a cross-encoder on /rerank; sentence-transformers
prompts; and huggingface_hub's InferenceClient on TEI's routes. Real uvicorn on loopback, answers
compared with transformers and sentence-transformers run here."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from compile.errors import CompileError
from loadtest.random_checkpoint import copy_tokenizer
from service.errors import InvalidInput
from service.tokenization import Prompts
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import save_tiny_sentence_transformer, tiny_config

PROMPTS = {"query": "query: ", "passage": "passage: "}
QUERY = "how do wizards judge boxing"
TEXTS = ["seven wizards quietly judge boxing matches", "the quick brown fox", "a lazy dog sleeps",
         "boxing judges are wizards"]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """A cross-encoder: BertForSequenceClassification with one label."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("tiny-reranker")
    BertForSequenceClassification(tiny_config(num_labels=1, architectures=["BertForSequenceClassification"])
                                  ).save_pretrained(directory)
    copy_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def reranker_artifact(reranker_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-reranker"
    compile_artifact(reranker_dir, out, ["2x16", "4x32"], task="rerank", generic_shapes=["3x20"])
    return out


@pytest.fixture(scope="module")
def prompted_dir(tmp_path_factory):
    return save_tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-prompted"), seed=5, prompts=PROMPTS)


@pytest.fixture(scope="module")
def prompted_artifact(prompted_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-prompted"
    compile_artifact(prompted_dir, out, ["packed-16", "packed-32"], layout="packed", generic_shapes=["3x20"])
    return out


@pytest.fixture(scope="module")
def server(serve, tiny_embed_artifact, prompted_artifact, tiny_classify_artifact, reranker_artifact):
    names = ["tiny", "e5ish", "sentiment", "reranker"]
    with serve([tiny_embed_artifact, prompted_artifact, tiny_classify_artifact, reranker_artifact],
               *[arg for name in names for arg in ("--served-name", name)], "--max-wait-ms", "5") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def test_models_are_listed_and_selected_by_name(client):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    assert [(m["id"], m["task"]) for m in listed["data"]] == [
        ("tiny", "embed"), ("e5ish", "embed"), ("sentiment", "classify"), ("reranker", "rerank")]
    assert [m["model_id"] for m in client.get("/info").json()["models"]] == ["tiny", "e5ish", "sentiment", "reranker"]
    by_default = client.post("/embed", json={"inputs": TEXTS[0]}).json()
    tiny = client.post("/embed", json={"inputs": TEXTS[0], "model": "tiny"}).json()
    other = client.post("/embed", json={"inputs": TEXTS[0], "model": "e5ish"}).json()
    np.testing.assert_allclose(by_default, tiny, atol=1e-6)  # the first embed model is the default
    assert float(np.dot(tiny[0], other[0])) < 0.99  # a different model answered
    missing = client.post("/embed", json={"inputs": "x", "model": "nope"})
    assert missing.status_code == 404 and "'nope' is not served" in missing.json()["error"]
    wrong_kind = client.post("/embed", json={"inputs": "x", "model": "sentiment"})
    assert wrong_kind.status_code == 400 and "is a classifier" in wrong_kind.json()["error"]
    absent = client.post("/embed_sparse", json={"inputs": "x"})
    assert absent.status_code == 400 and absent.json()["error"] == (
        "no model of this server is a sparse (SPLADE) model (compiled with --task sparse); it serves 'tiny', an "
        "embedding model, on POST /embed; 'e5ish', an embedding model, on POST /embed; 'sentiment', a classifier, "
        "on POST /predict; 'reranker', a reranker (a one-label classifier), on POST /rerank")
    zero_shot = client.post("/classify", json={"inputs": "x", "labels": ["a"], "model": "sentiment"})
    assert zero_shot.status_code == 400 and zero_shot.json()["error"] == (
        "model 'sentiment' is a classifier with labels negative, neutral, positive, not an embedding model or an NLI "
        "classifier (one of whose labels is entailment) for zero-shot `labels`; a classifier is served on POST /predict")
    templated = client.post("/classify", json={"inputs": "x", "labels": ["a"], "hypothesis_template": "It is {}."})
    assert templated.status_code == 422 and templated.json()["error"] == (
        "`hypothesis_template` and `multi_label` apply to an NLI classifier (one whose labels include entailment); "
        "model 'tiny' is an embedding model, which scores labels by the cosine similarity of their embeddings")
    labels = [p["label"] for p in client.post("/predict", json={"inputs": "fine"}).json()]
    assert sorted(labels) == ["negative", "neutral", "positive"]  # /predict's default: the first classifier
    tokens = client.post("/tokenize", json={"inputs": "fine", "model": "sentiment"})  # any model tokenizes
    assert tokens.status_code == 200 and [t["text"] for t in tokens.json()[0]] == ["[CLS]", "fine", "[SEP]"]


def test_openai_client_selects_the_model(server, client):
    import openai
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    expected = client.post("/embed", json={"inputs": TEXTS[:2], "model": "e5ish"}).json()
    result = api.embeddings.create(input=TEXTS[:2], model="e5ish", encoding_format="float")
    np.testing.assert_allclose([item.embedding for item in result.data], expected, atol=1e-6)
    assert result.model == "e5ish"
    assert [m.id for m in api.models.list()] == ["tiny", "e5ish", "sentiment", "reranker"]
    assert api.models.retrieve("sentiment").id == "sentiment"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("text-embedding-3-small")
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(input="x", model="text-embedding-3-small")


def test_rerank_scores_are_the_cross_encoders_sigmoid_logits(client, reranker_dir):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    model = BertForSequenceClassification.from_pretrained(reranker_dir).eval()
    with torch.inference_mode():
        logits = model(**tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")).logits[:, 0].numpy()
    expected_order = list(np.argsort(-logits, kind="stable"))

    ranked = client.post("/rerank", json={"query": QUERY, "texts": TEXTS})
    assert ranked.status_code == 200, ranked.text
    answer = ranked.json()
    assert [item["index"] for item in answer] == expected_order
    np.testing.assert_allclose([item["score"] for item in answer], 1 / (1 + np.exp(-logits[expected_order])), atol=1e-5)
    assert all("text" not in item for item in answer)
    raw = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True,
                                       "model": "reranker"}).json()
    np.testing.assert_allclose([item["score"] for item in raw], logits[expected_order], atol=1e-5)
    assert [item["text"] for item in raw] == [TEXTS[i] for i in expected_order]
    assert client.post("/rerank", json={"query": QUERY, "texts": []}).status_code == 422
    not_a_reranker = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "model": "sentiment"})
    assert not_a_reranker.status_code == 400 and "not a reranker" in not_a_reranker.json()["error"]


def test_rerank_task_needs_one_label(tiny_classifier_dir, tmp_path):
    with pytest.raises(CompileError, match="one label; .* has 3"):
        compile_artifact(tiny_classifier_dir, tmp_path / "out", ["1x8"], task="rerank")
    assert not (tmp_path / "out").exists()


def test_prompts_match_sentence_transformers(client, prompted_dir):
    import sentence_transformers
    model = sentence_transformers.SentenceTransformer(str(prompted_dir), device="cpu")
    for prompt_name in ("query", "passage"):
        expected = model.encode(TEXTS, prompt_name=prompt_name, normalize_embeddings=True)
        served = np.asarray(client.post("/embed", json={"inputs": TEXTS, "model": "e5ish",
                                                        "prompt_name": prompt_name}).json())
        cosine = np.sum(served * expected, axis=1)
        assert cosine.min() >= 0.9999, cosine
    plain = np.asarray(client.post("/embed", json={"inputs": TEXTS, "model": "e5ish"}).json())
    np.testing.assert_allclose(plain, model.encode(TEXTS, normalize_embeddings=True), atol=1e-4)
    unknown = client.post("/embed", json={"inputs": "x", "model": "e5ish", "prompt_name": "document"})
    assert unknown.status_code == 422 and "'query', 'passage'" in unknown.json()["error"]
    ids = client.post("/embed", json={"inputs": [101, 2023, 102], "model": "e5ish", "prompt_name": "query"})
    assert ids.status_code == 422 and "token ids are run as given" in ids.json()["error"]
    tokens = client.post("/tokenize", json={"inputs": TEXTS[0], "model": "e5ish", "prompt_name": "query"}).json()[0]
    prompted = PROMPTS["query"] + TEXTS[0]
    assert [t["id"] for t in tokens] == model.tokenizer(prompted)["input_ids"]
    assert all(t["text"] == prompted[t["start"]:t["stop"]] for t in tokens if not t["special"])
    info = {m["model_id"]: m for m in client.get("/info").json()["models"]}
    assert info["e5ish"]["prompts"] == {"prompts": PROMPTS, "default": ""}


def test_default_prompt_comes_from_the_flag_or_the_checkpoint(prompted_artifact, tmp_path):
    tokenizer_dir = prompted_artifact / "tokenizer"
    assert Prompts.of_checkpoint(tokenizer_dir).apply(["a"], None) == ["a"]
    assert Prompts.of_checkpoint(tokenizer_dir, "query").apply(["a"], None) == ["query: a"]
    assert Prompts.of_checkpoint(tokenizer_dir, None, "q: ").apply(["a"], "passage") == ["passage: a"]
    (tmp_path / "config_sentence_transformers.json").write_text('{"prompts": {"q": "Q "}, "default_prompt_name": "q"}')
    assert Prompts.of_checkpoint(tmp_path).apply(["a"], None) == ["Q a"]
    assert Prompts.of_checkpoint(tmp_path).apply(["a", [101, 5]], None) == ["Q a", [101, 5]]  # ids run as given
    with pytest.raises(InvalidInput, match="applies to text: token ids are run as given"):
        Prompts.of_checkpoint(tmp_path).apply(["a", [101, 5]], "q")
    with pytest.raises(ValueError, match="'document' is not one of the checkpoint's prompts"):
        Prompts.of_checkpoint(tokenizer_dir, "document")


def test_server_refuses_a_default_prompt_the_checkpoint_lacks(prompted_artifact):
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(prompted_artifact),
                             "--default-prompt-name", "document", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"bert-serve: error: {prompted_artifact}: default prompt name 'document' is not one of "
        "the checkpoint's prompts ('query', 'passage')"]


def test_huggingface_hub_client_on_tei_routes(server, client, monkeypatch):
    """InferenceClient posts feature_extraction and sentence_similarity to `/` (base_url) and
    text_classification to the model URL it is given."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this talks to loopback only
    similarity = InferenceClient(base_url=server.url).sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    expected = client.post("/similarity", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
    np.testing.assert_allclose(similarity, expected.json(), atol=1e-6)
    vectors = np.asarray(client.post("/embed", json={"inputs": TEXTS}).json())
    np.testing.assert_allclose(similarity, vectors[1:] @ vectors[0], atol=1e-5)
    classifier = InferenceClient(model=f"{server.url}/predict")
    served = client.post("/predict", json={"inputs": "it went fine"}).json()
    assert [(c.label, round(c.score, 5)) for c in classifier.text_classification("it went fine")] == \
        [(p["label"], round(p["score"], 5)) for p in served]
    raw = client.post("/predict", json={"inputs": "it went fine", "raw_scores": True}).json()
    top = classifier.text_classification("it went fine", top_k=1, function_to_apply="none")
    assert [(c.label, round(c.score, 5)) for c in top] == [(raw[0]["label"], round(raw[0]["score"], 5))]
