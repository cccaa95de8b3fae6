"""POST /embed_all: every token's final hidden state from a `--pooling none` artifact (padded and
packed) and from a default (pooling) one, whose libraries return it beside the pooled row, equal to
transformers' `last_hidden_state`, through a real server on loopback."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support.artifacts import compile_artifact

TEXTS = ["hello", "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j k l m n o p q r s t"]


@pytest.fixture(scope="module")
def token_artifacts(tiny_bert_dir, tiny_tokens_artifact, tmp_path_factory):
    packed = tmp_path_factory.mktemp("token-artifacts") / "tokens-packed"
    compile_artifact(tiny_bert_dir, packed, ["packed-16"], pooling="none", layout="packed")
    return tiny_tokens_artifact, packed


@pytest.fixture(scope="module")
def client(serve, token_artifacts, tiny_embed_artifact):
    with serve([*token_artifacts, tiny_embed_artifact], "--max-wait-ms", "20") as running, \
            httpx.Client(base_url=running.url, timeout=60) as client:
        yield client


def last_hidden_states(model_dir, texts: list[str]) -> list[np.ndarray]:
    import torch
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
    states = []
    with torch.no_grad():
        for text in texts:
            encoded = tokenizer(text, return_tensors="pt")
            states.append(model(**encoded).last_hidden_state[0].numpy())
    return states


@pytest.mark.parametrize("model", ["tokens-padded", "tokens-packed", "tiny-embed"])
def test_embed_all_equals_transformers_last_hidden_state(client, tiny_bert_dir, model):
    response = client.post("/embed_all", json={"inputs": TEXTS, "model": model})
    assert response.status_code == 200, response.text
    expected = last_hidden_states(tiny_bert_dir, TEXTS)
    answer = response.json()
    assert len(answer) == len(TEXTS)
    for states, reference in zip(answer, expected):
        states = np.asarray(states)
        assert states.shape == reference.shape  # one vector per token, [CLS] and [SEP] included
        np.testing.assert_allclose(states, reference, atol=1e-4)
    one = client.post("/embed_all", json={"inputs": TEXTS[1], "model": model}).json()
    np.testing.assert_allclose(np.asarray(one[0]), expected[1], atol=1e-4)  # alone: same answer


def test_a_default_artifact_answers_embed_and_embed_all_from_the_same_libraries(client, tiny_bert_dir):
    pooled = client.post("/embed", json={"inputs": TEXTS, "model": "tiny-embed", "normalize": False})
    states = client.post("/embed_all", json={"inputs": TEXTS, "model": "tiny-embed"})
    assert pooled.status_code == states.status_code == 200
    for vector, tokens in zip(pooled.json(), states.json()):  # the checkpoint's mean pooling of its own states
        np.testing.assert_allclose(np.asarray(vector), np.asarray(tokens).mean(axis=0), atol=1e-5)


def test_each_route_refuses_the_other_kind_and_names_its_route(client):
    refused = client.post("/embed", json={"inputs": "hello", "model": "tokens-padded"})
    assert refused.status_code == 400 and "/embed_all" in refused.json()["error"]
    assert client.post("/embed_all", json={"inputs": []}).status_code == 422
    info = client.get("/info").json()
    assert info["models"][0]["pooling"] == "none"
    assert client.post("/embed", json={"inputs": "hello"}).status_code == 200  # the dense model, by task
