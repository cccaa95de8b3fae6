"""The HTTP API on the tiny compiled artifacts, through a real server process on loopback.

One server holds the tiny embed and classify artifacts (buckets 1x8, 2x16, 4x16 and 1x8, 4x16;
max 64 positions), so batching, bucket routing, fallback and every error path are exercised
in seconds.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import json
import re

import httpx
import numpy as np
import pytest

from tests.support.service import error_of

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def sentence(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="module")
def server(serve, tiny_embed_artifact, tiny_classify_artifact):
    with serve([tiny_embed_artifact, tiny_classify_artifact], "--max-wait-ms", "20", "--cores", "2",
               "--workers", "2") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def embed_one(client: httpx.Client, text: str, **extra) -> np.ndarray:
    response = client.post("/embed", json={"inputs": text, **extra})
    assert response.status_code == 200, response.text
    return np.asarray(response.json()[0])


def test_probes_info_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    info = client.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_input_length"] == 64
    tei_fields = ("model_id", "model_sha", "model_dtype", "served_model_name", "model_type", "max_concurrent_requests",
                  "max_input_length", "max_batch_tokens", "max_batch_requests", "max_client_batch_size",
                  "auto_truncate", "tokenization_workers", "version", "sha", "docker_label")  # TEI's Info, all of it
    assert set(tei_fields) <= set(info) and info["served_model_name"] == info["model_id"] == "tiny-embed"
    assert info["version"] == importlib.metadata.version("bert-tvm-serve") and info["tokenization_workers"] == 1
    by_task = {model["task"]: model for model in info["models"]}
    assert [b["name"] for b in by_task["embed"]["buckets"]] == ["1x8", "2x16", "4x16"]
    assert by_task["classify"]["labels"] == ["negative", "neutral", "positive"]
    assert by_task["embed"]["generic"] == {"max_batch": 16, "max_seq": 64, "strategy": "concat"}
    assert {"tvm", "torch", "transformers"} <= set(by_task["embed"]["versions"])
    text = client.get("/metrics").text
    for name in ("bert_serve_requests_total", "bert_serve_request_duration_seconds_bucket", "bert_serve_queue_depth",
                 "bert_serve_batch_size_bucket", "bert_serve_tokens_total", "bert_serve_padding_tokens_total",
                 "bert_serve_batches_total", "bert_serve_fallback_total"):
        assert name in text


def test_info_reports_the_topology_and_how_batches_are_costed(client):
    info = client.get("/info").json()
    assert info["topology"] == {"cores": 2, "workers": 2, "threads_per_worker": 1, "wide": True, "queue_ahead": True}
    assert {model["batch_costs"] for model in info["models"]} == {"measured latency"}


def test_root_routes_to_the_default_task_like_tei(server, client, monkeypatch):
    """POST / is /embed when an embedding model is loaded: what huggingface_hub's client posts to."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this talks to loopback only

    text = "a sentence for the default route"
    expected = np.asarray(client.post("/embed", json={"inputs": text}).json()[0])
    response = client.post("/", json={"inputs": text})
    assert response.status_code == 200
    np.testing.assert_allclose(response.json()[0], expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(InferenceClient(base_url=server.url).feature_extraction(text)).reshape(-1),
                               expected, atol=1e-6)
    bad = client.post("/", json={"inputs": 3})
    assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"
    assert client.post("/", content=b"{not json").status_code == 422


def test_embed_is_normalised_ordered_and_timed(client):
    texts = [sentence(3), sentence(9, 2), sentence(5, 4)]
    response = client.post("/embed", json={"inputs": texts})
    assert response.status_code == 200
    vectors = np.asarray(response.json())
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for text, vector in zip(texts, vectors):  # input order kept
        np.testing.assert_allclose(embed_one(client, text), vector, atol=1e-4)
    raw = np.asarray(client.post("/embed", json={"inputs": texts[0], "normalize": False}).json()[0])
    np.testing.assert_allclose(raw / np.linalg.norm(raw), vectors[0], atol=1e-5)
    for header in ("x-compute-time", "x-tokenization-time", "x-queue-time", "x-inference-time", "x-compute-tokens"):
        assert response.headers[header].isdigit(), header
    assert response.headers["x-compute-path"].startswith("bucket-")
    timing = dict(part.split(";dur=") for part in response.headers["server-timing"].split(", "))
    assert set(timing) == {"tokenize", "queue", "inference", "total"}
    assert 0 < float(timing["inference"]) <= float(timing["total"])
    assert int(response.headers["x-inference-time"]) == int(float(timing["inference"]))


def test_concurrent_mixed_burst_matches_alone(server, client):
    """72 concurrent requests of 1 to 40 words: each answer equals the same input sent alone."""
    texts = [sentence(1 + (i * 7) % 40, i) for i in range(72)]
    alone = {text: embed_one(client, text) for text in set(texts)}
    before = client.get("/metrics").text

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as aclient:
            return await asyncio.gather(*(aclient.post("/embed", json={"inputs": text}) for text in texts))

    responses = asyncio.run(asyncio.wait_for(burst(), 120))
    assert [r.status_code for r in responses] == [200] * len(texts)
    for text, response in zip(texts, responses):
        np.testing.assert_allclose(np.asarray(response.json()[0]), alone[text], atol=1e-4)
    paths = {path for r in responses for path in r.headers["x-compute-path"].split(",")}
    assert "generic" in paths and any(p.startswith("bucket-") for p in paths)
    after = client.get("/metrics").text
    batches = metric(after, "bert_serve_batch_size_count") - metric(before, "bert_serve_batch_size_count")
    assert 0 < batches < len(texts), "concurrent requests were batched together"


def test_fallback_serves_shapes_larger_than_every_bucket(client):
    before = client.get("/metrics").text
    response = client.post("/embed", json={"inputs": sentence(40)})  # 42 tokens > 16, the longest bucket
    assert response.status_code == 200 and response.headers["x-compute-path"] == "generic"
    after = client.get("/metrics").text
    assert metric(after, "bert_serve_fallback_total") == metric(before, "bert_serve_fallback_total") + 1
    assert metric(after, "bert_serve_batches_total", path="generic") == \
        metric(before, "bert_serve_batches_total", path="generic") + 1


def test_batch_larger_than_every_bucket_is_split_not_sent_to_generic(client):
    before = client.get("/metrics").text
    texts = [sentence(3, i) for i in range(10)]  # 10 short inputs > 4, the largest bucket batch
    response = client.post("/embed", json={"inputs": texts})
    assert response.status_code == 200 and len(response.json()) == 10
    assert "generic" not in response.headers["x-compute-path"]
    after = client.get("/metrics").text
    assert metric(after, "bert_serve_fallback_total") == metric(before, "bert_serve_fallback_total")
    hits = metric(after, "bert_serve_batches_total") - metric(before, "bert_serve_batches_total")
    assert hits >= 3  # at least ceil(10 / 4) bucket runs
    # every computed token is a real one or padding up to the bucket that ran it
    runs = {b: metric(after, "bert_serve_batches_total", path=f"bucket-{b}")
            - metric(before, "bert_serve_batches_total", path=f"bucket-{b}") for b in ("1x8", "2x16", "4x16")}
    computed = sum(count * int(b.split("x")[0]) * int(b.split("x")[1]) for b, count in runs.items())
    tokens = metric(after, "bert_serve_tokens_total") - metric(before, "bert_serve_tokens_total")
    padding = metric(after, "bert_serve_padding_tokens_total") - metric(before, "bert_serve_padding_tokens_total")
    assert tokens == int(response.headers["x-compute-tokens"])
    assert padding == computed - tokens and padding > 0


def test_classify_matches_pytorch_softmax(client, tiny_classifier_dir):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = [sentence(4), sentence(11, 3), sentence(20, 5)]
    model = BertForSequenceClassification.from_pretrained(tiny_classifier_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    with torch.no_grad():
        probs = torch.softmax(model(**tokenizer(texts, padding=True, return_tensors="pt")).logits, -1).numpy()
    labels = ["negative", "neutral", "positive"]
    for route in ("/classify", "/predict"):
        response = client.post(route, json={"inputs": [[text] for text in texts]})  # TEI's batch
        assert response.status_code == 200, response.text
        for expected, predictions in zip(probs, response.json()):
            scores = [p["score"] for p in predictions]
            assert scores == sorted(scores, reverse=True)
            got = {p["label"]: p["score"] for p in predictions}
            np.testing.assert_allclose([got[label] for label in labels], expected, atol=1e-4)
    single = client.post("/classify", json={"inputs": texts[0], "raw_scores": True}).json()
    assert isinstance(single[0], dict)  # one string in, TEI's flat list out
    raw = {p["label"]: p["score"] for p in single}
    np.testing.assert_allclose(np.exp([raw[l] for l in labels]) / np.exp([raw[l] for l in labels]).sum(),
                               probs[0], atol=1e-4)


def test_predict_takes_teis_batch_of_single_texts_and_pairs(client, tiny_classifier_dir):
    """TEI's /predict batch: a list of sequences, each one text or a (query, passage) pair, scored as
    transformers scores the same sequences."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    single, pair = sentence(6), (sentence(4, 2), sentence(9, 5))
    model = BertForSequenceClassification.from_pretrained(tiny_classifier_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    with torch.no_grad():
        expected = [torch.softmax(model(**tokenizer(*texts, return_tensors="pt")).logits, -1).numpy()[0]
                    for texts in ((single,), pair)]
    response = client.post("/predict", json={"inputs": [[single], list(pair)], "raw_scores": False})
    assert response.status_code == 200, response.text
    labels = ["negative", "neutral", "positive"]
    for probabilities, predictions in zip(expected, response.json()):
        got = {p["label"]: p["score"] for p in predictions}
        np.testing.assert_allclose([got[label] for label in labels], probabilities, atol=1e-4)
    flat_pair = client.post("/predict", json={"inputs": list(pair)}).json()  # TEI: a flat list of two is a pair
    got = {p["label"]: p["score"] for p in flat_pair}
    np.testing.assert_allclose([got[label] for label in labels], expected[1], atol=1e-4)
    one = client.post("/predict", json={"inputs": [single]}).json()  # one text, answered flat
    np.testing.assert_allclose([{p["label"]: p["score"] for p in one}[label] for label in labels], expected[0],
                               atol=1e-4)
    for inputs, message in (([["a", "b", "c"]], "lists of one text or of a pair"), ([[]], "lists of one text"),
                            ([[""]], "cannot contain an empty string"), ([["", ""]], "a pair of two empty texts"),
                            (["a", "b", "c"], "a flat list is one text or one (text, text) pair, as in TEI")):
        refused = client.post("/predict", json={"inputs": inputs})
        assert refused.status_code == 422 and message in refused.json()["error"], refused.text
    zero_shot = client.post("/predict", json={"inputs": [list(pair)], "labels": ["a", "b"]})
    assert zero_shot.status_code == 422 and "not pairs" in zero_shot.json()["error"]


def test_tokenize_and_decode_match_the_tokenizer(client, tiny_embed_artifact):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = ["Hello, world!", "Tokenizers split words like unbelievable"]
    tokens = client.post("/tokenize", json={"inputs": texts}).json()
    assert len(tokens) == 2
    for text, row in zip(texts, tokens):
        expected = tokenizer.encode(text)
        assert [t["id"] for t in row] == expected.ids
        assert row[0] == {"id": expected.ids[0], "text": "[CLS]", "special": True, "start": None, "stop": None}
        assert all(t["text"] == text[t["start"]:t["stop"]] for t in row if not t["special"])
    bare = client.post("/tokenize", json={"inputs": "Hello", "add_special_tokens": False}).json()
    assert [t["id"] for t in bare[0]] == tokenizer.encode("Hello", add_special_tokens=False).ids
    ids = [t["id"] for t in tokens[1]]
    assert client.post("/decode", json={"ids": ids}).json() == [tokenizer.decode(ids)]
    assert client.post("/decode", json={"ids": [ids, ids[:3]], "skip_special_tokens": False}).json() == \
        tokenizer.decode_batch([ids, ids[:3]], skip_special_tokens=False)
    bad = client.post("/decode", json={"ids": [10**9]})
    assert bad.status_code == 422 and "ids" in bad.json()["error"]


def test_similarity_is_the_cosine_of_the_embeddings(client):
    source, sentences = "a cat sits on the mat", ["a cat is on a mat", "stock markets fell today"]
    response = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences}})
    assert response.status_code == 200
    vectors = np.asarray(client.post("/embed", json={"inputs": [source, *sentences]}).json())
    np.testing.assert_allclose(response.json(), vectors[1:] @ vectors[0], atol=1e-5)
    empty = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": []}})
    assert empty.status_code == 422


def test_openai_client(server, client):
    import openai
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    texts = [sentence(4), sentence(12, 1)]
    expected = np.asarray(client.post("/embed", json={"inputs": texts}).json())
    for encoding_format in ("base64", "float"):  # the client asks for base64 unless told otherwise
        kwargs = {"encoding_format": encoding_format} if encoding_format == "float" else {}
        result = api.embeddings.create(input=texts, model="tiny-embed", **kwargs)
        assert [item.index for item in result.data] == [0, 1]
        np.testing.assert_allclose([item.embedding for item in result.data], expected, atol=1e-6)
        assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    single = client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(single["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=1e-6)
    assert single["object"] == "list" and single["data"][0]["object"] == "embedding"
    unset = client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": None}).json()  # null: float
    np.testing.assert_allclose(unset["data"][0]["embedding"], expected[0], atol=1e-6)


def test_dimensions_keep_the_first_components_renormalised(server, client):
    """Matryoshka truncation on /embed and through the openai client's `dimensions=`; 422 past the width."""
    import openai
    texts = [sentence(5), sentence(9, 2)]
    raw = np.asarray(client.post("/embed", json={"inputs": texts, "normalize": False}).json())
    expected = raw[:, :8] / np.linalg.norm(raw[:, :8], axis=1, keepdims=True)
    cut = client.post("/embed", json={"inputs": texts, "dimensions": 8})
    assert cut.status_code == 200
    np.testing.assert_allclose(cut.json(), expected, atol=1e-6)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    result = api.embeddings.create(input=texts, model="tiny-embed", dimensions=8)
    np.testing.assert_allclose([item.embedding for item in result.data], expected, atol=1e-6)
    with pytest.raises(openai.UnprocessableEntityError, match="at most the model's 32, got 33"):  # shown
        api.embeddings.create(input=texts, model="tiny-embed", dimensions=33)
    too_wide = client.post("/embed", json={"inputs": texts, "dimensions": 33})  # the tiny model is 32 wide
    assert too_wide.status_code == 422 and "at most the model's 32" in too_wide.json()["error"]


LONG = sentence(100)  # 102 tokens > 64


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        ("/embed", {"inputs": ""}, 422),
        ("/embed", {"inputs": []}, 422),
        ("/embed", {"inputs": ["fine", ""]}, 422),
        ("/embed", {"inputs": 42}, 422),
        ("/embed", {"inputs": ["fine", 42]}, 422),
        ("/embed", {"inputs": "fine", "normalize": "yes"}, 422),
        ("/embed", {"normalize": True}, 422),
        ("/embed", [1, 2], 422),
        ("/classify", {"inputs": "fine", "labels": []}, 422),
        ("/v1/embeddings", {"input": "fine", "encoding_format": "hex"}, 422),
        ("/embed", {"inputs": ["a"] * 33}, 413),
        ("/embed", {"inputs": LONG, "truncate": False}, 413),
        ("/classify", {"inputs": LONG, "truncate": False}, 413),
        ("/classify", {"inputs": "fine", "labels": ["a"] * 32}, 413),
    ],
)
def test_bad_input_gets_status_and_json(client, route, body, status):
    response = client.post(route, json=body)
    assert response.status_code == status, response.text
    message, _ = error_of(response)
    assert message
    if isinstance(body, dict) and body.get("inputs") == LONG:
        assert message.startswith("`inputs` must have at most 64 tokens. Given: ")  # names the limit
    if "labels" in body and status == 413:
        assert message == ("batch size 33 (1 input and 32 zero-shot labels, each embedded) > maximum allowed "
                                  "batch size 32")


@pytest.mark.parametrize(("route", "field", "value", "message"), [
    ("/predict", "inputs", [101, 2023, 102], "inputs: token ids are not accepted here: send the text"),
    ("/tokenize", "inputs", [[101, 2023, 102], [101, 102]], "inputs: token ids are not accepted here: send the text"),
    ("/predict", "inputs", 42, "inputs: expected a string or a list of strings"),
    ("/embed", "inputs", 42, "inputs: expected a string, a list of token ids, or a list of strings and lists"),
    ("/embed", "inputs", ["fine", 42], "inputs: expected a string, a list of token ids"),
    ("/embed", "inputs", None, "inputs: expected a string, a list of token ids"),
    ("/embed", "inputs", [True, False], "inputs: expected a string, a list of token ids"),
    ("/embed", "inputs", [[101, 1.5]], "inputs: expected a string, a list of token ids"),
    ("/v1/embeddings", "input", [], "input: cannot be empty"),
    ("/v1/embeddings", "input", [[101, 102], []], "input: cannot contain an empty list of token ids"),
    ("/embed", "inputs", ["fine", ""], "inputs: cannot contain an empty string"),
])
def test_inputs_of_the_wrong_kind_are_refused_in_one_line(client, route, field, value, message):
    """Not the union's error per branch (`inputs.str: Input should be a valid string`): what was
    expected, and token ids named as such where a route takes text only."""
    response = client.post(route, json={field: value})
    assert response.status_code == 422 and error_of(response)[0].startswith(message), response.text


def test_token_ids_embed_as_the_text_they_encode(client, tiny_embed_artifact):
    """TEI's and OpenAI's pre-tokenized inputs: ids run as given (special tokens are the client's),
    alone, in a batch beside text, and through OpenAI's token arrays, each equal to the text's vector."""
    texts = [sentence(5), sentence(9, 3)]
    ids = [[token["id"] for token in row] for row in client.post("/tokenize", json={"inputs": texts}).json()]
    expected = np.asarray(client.post("/embed", json={"inputs": texts}).json())
    single = client.post("/embed", json={"inputs": ids[0]})
    assert single.status_code == 200 and single.headers["x-compute-characters"] == str(len(ids[0]))
    np.testing.assert_allclose(single.json()[0], expected[0], atol=1e-5)
    mixed = np.asarray(client.post("/embed", json={"inputs": [ids[0], texts[1]]}).json())
    np.testing.assert_allclose(mixed, expected, atol=1e-5)
    openai = client.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    np.testing.assert_allclose([item["embedding"] for item in openai["data"]], expected, atol=1e-5)
    assert openai["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    bare = client.post("/embed", json={"inputs": ids[0][1:-1]}).json()[0]  # no [CLS] / [SEP]: not the text's input
    assert np.dot(bare, expected[0]) < 0.9999


def test_truncation_direction_keeps_the_end_or_the_start_of_an_over_long_input(client):
    """TEI's truncation_direction: Left drops an over-long input's first tokens, Right (the default) its
    last, the special tokens kept either way (here 64 positions), for text and for token ids alike."""
    long = sentence(80)
    ids = [token["id"] for token in client.post("/tokenize", json={"inputs": long}).json()[0]]
    assert len(ids) > 64
    kept = {"Left": [ids[0], *ids[len(ids) - 63:-1], ids[-1]], "Right": [*ids[:63], ids[-1]]}
    vectors = {}
    for direction, expected_ids in kept.items():
        expected = client.post("/embed", json={"inputs": expected_ids}).json()[0]
        for inputs, spelled in ((long, direction), ([long], direction), (long, direction.lower())):
            response = client.post("/embed", json={"inputs": inputs, "truncate": True, "truncation_direction": spelled})
            np.testing.assert_allclose(response.json()[0], expected, atol=1e-6)
        vectors[direction] = np.asarray(expected)
    assert np.dot(vectors["Left"], vectors["Right"]) < 0.9999
    default = client.post("/embed", json={"inputs": long, "truncate": True}).json()[0]
    np.testing.assert_allclose(default, vectors["Right"], atol=1e-6)
    ids_left = client.post("/embed", json={"inputs": ids, "truncate": True, "truncation_direction": "Left"}).json()[0]
    np.testing.assert_allclose(ids_left, client.post("/embed", json={"inputs": ids[-64:]}).json()[0], atol=1e-6)
    refused = client.post("/embed", json={"inputs": long, "truncate": True, "truncation_direction": "Middle"})
    assert refused.status_code == 422 and refused.json()["error"].startswith("truncation_direction")


def test_similarity_takes_its_options_in_parameters_as_tei_does(client):
    source, sentences = "a cat sits on the mat", ["a cat is on a mat", sentence(80)]
    top_level = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences},
                                                 "truncate": True, "truncation_direction": "Left"})
    in_parameters = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences},
                                                      "parameters": {"truncate": True, "truncation_direction": "Left"}})
    assert top_level.status_code == in_parameters.status_code == 200
    np.testing.assert_allclose(in_parameters.json(), top_level.json(), atol=1e-6)
    right = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences},
                                             "parameters": {"truncate": True}}).json()
    assert abs(right[1] - in_parameters.json()[1]) > 1e-4  # Left kept the long sentence's end, Right its start
    twice = client.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences},
                                             "truncate": True, "parameters": {"truncate": True}})
    assert twice.status_code == 422 and "`truncate` is given twice" in twice.json()["error"]


def test_token_ids_are_checked_against_the_vocabulary_and_the_length_limit(client, tiny_embed_artifact):
    vocab = json.loads((tiny_embed_artifact / "manifest.json").read_text())["model"]["vocab_size"]
    for ids in ([101, vocab], [-1], [10**30]):
        response = client.post("/embed", json={"inputs": ids})
        assert response.status_code == 422 and response.json()["error"] == f"token ids must lie in [0, {vocab})"
    long = [101] + [1000 + i for i in range(70)] + [102]  # the tiny model takes 64 tokens
    too_long = client.post("/embed", json={"inputs": long, "truncate": False})
    assert too_long.status_code == 413 and "64" in too_long.json()["error"]
    cut = client.post("/embed", json={"inputs": long, "truncate": True})
    np.testing.assert_allclose(cut.json(), client.post("/embed", json={"inputs": long[:64]}).json(), atol=1e-6)
    assert client.get("/health").status_code == 200


def test_non_json_and_oversized_bodies(client):
    for content in (b"not json", b"{\"inputs\": ", "{\"inputs\": \"caf\u00e9\"".encode()):
        response = client.post("/embed", content=content, headers={"content-type": "application/json"})
        assert response.status_code == 422 and response.json()["error_type"] == "Validation"
    huge = json.dumps({"inputs": "a " * 1_100_000})  # 2.2 MB > the 2 MB default limit
    response = client.post("/embed", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and set(response.json()) == {"error", "error_type"}

    def chunks():  # no Content-Length: the limit holds for streamed bodies too
        for _ in range(30):
            yield b" " * 100_000

    response = client.post("/embed", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert client.get("/nowhere").json()["error_type"] and client.get("/nowhere").status_code == 404


@pytest.mark.parametrize(
    "text",
    ["\U0001F600\U0001F680 emoji only \U0001F44D", "ctrl\x00chars\x07\x1b[31m\t\r\n", "混合 scripts: Ελληνικά, العربية, हिन्दी",
     "\u200b\u200d\ufeff", " " * 10, "x" * 100_000],
)
def test_strange_text_gets_a_normal_answer(client, text):
    response = client.post("/embed", json={"inputs": text, "truncate": True})
    assert response.status_code == 200, response.text
    vector = np.asarray(response.json()[0])
    assert vector.shape == (32,) and np.isfinite(vector).all()


def test_truncate_on_serves_long_input_at_the_limit(client):
    response = client.post("/embed", json={"inputs": LONG, "truncate": True})
    assert response.status_code == 200 and int(response.headers["x-compute-tokens"]) == 64


def test_over_long_inputs_are_cut_unless_a_request_says_not_to(client):
    """TEI's --auto-truncate is on by default: a request that does not say `truncate`, and OpenAI's
    route, which cannot, get the input cut to the limit (--no-auto-truncate: test_service_limits)."""
    cut = client.post("/embed", json={"inputs": LONG, "truncate": True}).json()
    unsaid = client.post("/embed", json={"inputs": LONG})
    assert unsaid.status_code == 200 and int(unsaid.headers["x-compute-tokens"]) == 64
    np.testing.assert_allclose(unsaid.json(), cut, atol=1e-6)
    openai = client.post("/v1/embeddings", json={"input": LONG})
    assert openai.status_code == 200 and openai.json()["usage"]["prompt_tokens"] == 64
    np.testing.assert_allclose(openai.json()["data"][0]["embedding"], cut[0], atol=1e-6)
    assert client.post("/embed", json={"inputs": LONG, "truncate": False}).status_code == 413


def test_tei_route_aliases(client):
    """TEI's other paths: /embeddings (an OpenAI base URL without /v1), GET / and /ping (health), and
    SageMaker's POST /invocations (the default task, as POST /)."""
    body = {"input": ["first text", "second one"], "model": "tiny-embed"}
    aliased, original = client.post("/embeddings", json=body), client.post("/v1/embeddings", json=body)
    assert aliased.status_code == 200
    assert [d["embedding"] for d in aliased.json()["data"]] == [d["embedding"] for d in original.json()["data"]]
    for path in ("/", "/ping"):
        assert client.get(path).json() == {"status": "ok"} and client.head(path).status_code == 200
    assert client.get("/models").json() == client.get("/v1/models").json()
    assert client.get("/models/tiny-embed").json() == client.get("/v1/models/tiny-embed").json()
    missing = client.get("/models/nope")
    assert missing.status_code == 404 and "tiny-embed" in error_of(missing)[0]
    invoked = client.post("/invocations", json={"inputs": "first text"})
    assert invoked.status_code == 200 and invoked.json() == client.post("/", json={"inputs": "first text"}).json()


def test_openapi_document_describes_every_post_body(client):
    """POST bodies are parsed by pydantic directly, not by FastAPI; the OpenAPI document still
    names each route's body schema, and every schema it refers to is in the document."""
    document = client.get("/openapi.json").json()
    posts = {path: item["post"] for path, item in document["paths"].items() if "post" in item}
    assert {"/", "/embed", "/predict", "/rerank", "/v1/embeddings"} <= set(posts)
    for path, operation in posts.items():
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        if path in ("/", "/invocations"):  # the body of the default model's task, or /similarity's
            assert [ref["$ref"].rsplit("/", 1)[1] for ref in body["oneOf"]] == [
                "EmbedRequest", "ClassifyRequest", "RerankRequest", "EmbedAllRequest", "EmbedMultiRequest",
                "SimilarityRequest"]
        else:
            assert body["$ref"], path
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(document)))
    assert refs and refs <= set(document["components"]["schemas"])
    assert "inputs" in document["components"]["schemas"]["EmbedRequest"]["properties"]
