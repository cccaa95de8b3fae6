"""TEI's gRPC API (tei.v1) through a real grpcio client against a real server on loopback, beside
HTTP: every method and its stream variant answers what the HTTP route answers, reflection lists
the services, and bad calls get TEI's status codes while the server keeps serving."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool

from loadtest.random_checkpoint import copy_tokenizer
from loadtest.servers import free_port
from service.grpc_api import retrieval_pb2 as rpb
from service.grpc_api import retrieval_pb2_grpc as rpb_grpc
from service.grpc_api import tei_pb2 as pb
from service.grpc_api import tei_pb2_grpc as pb_grpc
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import tiny_config
from tests.support.service import grpc_channel

KEY = "grpc-secret"
AUTH = (("authorization", f"Bearer {KEY}"),)
TEXTS = ["seven wizards quietly judge boxing matches", "the quick brown fox", "a lazy dog sleeps"]
PAYLOAD_LIMIT = 20_000


@pytest.fixture(scope="module")
def artifacts(tiny_embed_artifact, tiny_classify_artifact, tiny_tokens_artifact, tmp_path_factory):
    import torch
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("grpc-artifacts")
    torch.manual_seed(3)
    BertForSequenceClassification(tiny_config(num_labels=1, architectures=["BertForSequenceClassification"])
                                  ).save_pretrained(root / "reranker-checkpoint")
    copy_tokenizer(root / "reranker-checkpoint")
    compile_artifact(root / "reranker-checkpoint", root / "reranker", ["2x16"], task="rerank", generic_shapes=["3x20"])
    return [tiny_embed_artifact, tiny_classify_artifact, root / "reranker", tiny_tokens_artifact]


@pytest.fixture(scope="module")
def server(serve, artifacts):
    with serve(artifacts, "--api-key", KEY, "--payload-limit", str(PAYLOAD_LIMIT),
               "--max-wait-ms", "20", ready_headers=dict(AUTH), grpc=True) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=dict(AUTH)) as client:
        yield client


channel = pytest.fixture(scope="module", name="channel")(grpc_channel)


def stubs(channel):
    return (pb_grpc.InfoStub(channel), pb_grpc.EmbedStub(channel), pb_grpc.PredictStub(channel),
            pb_grpc.RerankStub(channel), pb_grpc.TokenizeStub(channel))


def test_unary_methods_answer_what_http_answers(channel, http):
    info, embed, predict, rerank, tokenize = stubs(channel)
    described = info.Info(pb.InfoRequest(), metadata=AUTH)
    assert described.model_id == "tiny-embed" and described.model_type == pb.MODEL_TYPE_EMBEDDING
    assert described.max_input_length == 64 and described.max_client_batch_size == 32

    answer = embed.Embed(pb.EmbedRequest(inputs=TEXTS[0], normalize=True), metadata=AUTH)
    response = http.post("/embed", json={"inputs": TEXTS[0], "model": "tiny-embed"})
    np.testing.assert_allclose(answer.embeddings, response.json()[0], atol=1e-6)
    assert answer.metadata.compute_tokens == int(response.headers["x-compute-tokens"])
    assert answer.metadata.compute_chars == len(TEXTS[0]) and answer.metadata.inference_time_ns > 0

    long = " ".join(TEXTS * 4)  # past the 64 tokens: truncated at its start, as HTTP does it
    for direction, name in ((pb.TRUNCATION_DIRECTION_LEFT, "Left"), (pb.TRUNCATION_DIRECTION_RIGHT, "Right")):
        answer = embed.Embed(pb.EmbedRequest(inputs=long, truncate=True, normalize=True, truncation_direction=direction),
                             metadata=AUTH)
        response = http.post("/embed", json={"inputs": long, "truncate": True, "truncation_direction": name})
        np.testing.assert_allclose(answer.embeddings, response.json()[0], atol=1e-6)

    states = embed.EmbedAll(pb.EmbedAllRequest(inputs=TEXTS[1]), metadata=AUTH)
    expected = http.post("/embed_all", json={"inputs": TEXTS[1]}).json()[0]
    np.testing.assert_allclose([token.embeddings for token in states.token_embeddings], expected, atol=1e-6)

    predicted = predict.Predict(pb.PredictRequest(inputs=TEXTS[2]), metadata=AUTH)
    expected = http.post("/predict", json={"inputs": TEXTS[2], "model": "tiny-classify"}).json()
    assert [p.label for p in predicted.predictions] == [p["label"] for p in expected]
    np.testing.assert_allclose([p.score for p in predicted.predictions], [p["score"] for p in expected], atol=1e-6)
    pair = predict.PredictPair(pb.PredictPairRequest(inputs=TEXTS[:2], raw_scores=True), metadata=AUTH)
    assert len(pair.predictions) == 3

    ranked = rerank.Rerank(pb.RerankRequest(query=TEXTS[0], texts=TEXTS, return_text=True), metadata=AUTH)
    expected = http.post("/rerank", json={"query": TEXTS[0], "texts": TEXTS}).json()
    assert [r.index for r in ranked.ranks] == [r["index"] for r in expected]
    np.testing.assert_allclose([r.score for r in ranked.ranks], [r["score"] for r in expected], atol=1e-6)
    assert [r.text for r in ranked.ranks] == [TEXTS[r["index"]] for r in expected]

    tokens = tokenize.Tokenize(pb.EncodeRequest(inputs=TEXTS[1], add_special_tokens=True), metadata=AUTH)
    expected = http.post("/tokenize", json={"inputs": TEXTS[1]}).json()[0]
    assert [(t.id, t.text, t.special) for t in tokens.tokens] == [(t["id"], t["text"], t["special"]) for t in expected]
    assert [t.start if t.HasField("start") else None for t in tokens.tokens] == [t["start"] for t in expected]
    ids = [t.id for t in tokens.tokens]
    decoded = tokenize.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=True), metadata=AUTH)
    assert decoded.text == http.post("/decode", json={"ids": ids}).json()[0] == TEXTS[1]


def test_streams_answer_each_message_in_order(channel):
    info, embed, predict, rerank, tokenize = stubs(channel)
    singles = [embed.Embed(pb.EmbedRequest(inputs=text), metadata=AUTH).embeddings for text in TEXTS]
    streamed = list(embed.EmbedStream(iter([pb.EmbedRequest(inputs=text) for text in TEXTS]), metadata=AUTH))
    for answer, single in zip(streamed, singles, strict=True):
        np.testing.assert_allclose(answer.embeddings, single, atol=1e-6)
    lengths = [len(tokenize.Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=True), metadata=AUTH).tokens)
               for text in TEXTS]
    streamed = list(embed.EmbedAllStream(iter([pb.EmbedAllRequest(inputs=text) for text in TEXTS]), metadata=AUTH))
    assert [len(answer.token_embeddings) for answer in streamed] == lengths
    streamed = list(predict.PredictStream(iter([pb.PredictRequest(inputs=text) for text in TEXTS]), metadata=AUTH))
    single = predict.Predict(pb.PredictRequest(inputs=TEXTS[1]), metadata=AUTH)
    assert streamed[1].predictions == single.predictions and len(streamed) == 3
    pairs = list(predict.PredictPairStream(iter([pb.PredictPairRequest(inputs=TEXTS[:2])] * 2), metadata=AUTH))
    assert len(pairs) == 2 and pairs[0].predictions == pairs[1].predictions
    ranked = rerank.RerankStream(iter([pb.RerankStreamRequest(query=TEXTS[0], text=text) for text in TEXTS]),
                                 metadata=AUTH)
    whole = rerank.Rerank(pb.RerankRequest(query=TEXTS[0], texts=TEXTS), metadata=AUTH)
    assert [(r.index, r.score) for r in ranked.ranks] == [(r.index, r.score) for r in whole.ranks]
    tokens = list(tokenize.TokenizeStream(iter([pb.EncodeRequest(inputs=text) for text in TEXTS]), metadata=AUTH))
    assert [len(answer.tokens) for answer in tokens] == [n - 2 for n in lengths]  # add_special_tokens false
    texts = list(tokenize.DecodeStream(iter([pb.DecodeRequest(ids=[t.id for t in answer.tokens]) for answer in tokens]),
                                       metadata=AUTH))
    assert [answer.text for answer in texts] == TEXTS


def test_reflection_lists_and_describes_the_services(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    assert {"tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"} <= set(
        database.get_services())
    pool = DescriptorPool(database)
    embed = pool.FindServiceByName("tei.v1.Embed")
    assert {m.name for m in embed.methods} == {"Embed", "EmbedStream", "EmbedSparse", "EmbedSparseStream",
                                               "EmbedAll", "EmbedAllStream"}
    assert pool.FindMessageTypeByName("tei.v1.EmbedRequest").fields_by_name["inputs"].number == 1
    # our own package beside TEI's, described with the tei.v1 messages it reuses
    assert {"bertserve.v1.EmbedMulti", "bertserve.v1.EmbedHybrid"} <= set(database.get_services())
    hybrid = pool.FindServiceByName("bertserve.v1.EmbedHybrid")
    assert {m.name for m in hybrid.methods} == {"EmbedHybrid", "EmbedHybridStream"}
    assert hybrid.methods_by_name["EmbedHybrid"].output_type.fields_by_name["sparse"].message_type.full_name == \
        "tei.v1.SparseValue"


def test_embed_fields_as_in_teis_proto(channel, http):
    """`normalize` unset is true and `dimensions` cuts as /embed's (TEI's optional fields); `truncate`
    unset is false even though the server's --auto-truncate (HTTP's default) is on, as in TEI."""
    embed = pb_grpc.EmbedStub(channel)
    unset = np.asarray(embed.Embed(pb.EmbedRequest(inputs=TEXTS[0]), metadata=AUTH).embeddings)
    raw = np.asarray(embed.Embed(pb.EmbedRequest(inputs=TEXTS[0], normalize=False), metadata=AUTH).embeddings)
    assert np.linalg.norm(unset) == pytest.approx(1, abs=1e-5) and abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(unset, raw / np.linalg.norm(raw), atol=1e-6)
    cut = embed.Embed(pb.EmbedRequest(inputs=TEXTS[0], dimensions=8), metadata=AUTH).embeddings
    expected = http.post("/embed", json={"inputs": TEXTS[0], "dimensions": 8, "model": "tiny-embed"}).json()[0]
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    for dimensions in (0, 33):
        refused = status_of(embed.Embed, pb.EmbedRequest(inputs=TEXTS[0], dimensions=dimensions), metadata=AUTH)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in refused.details()
    assert http.post("/embed", json={"inputs": "word " * 200, "model": "tiny-embed"}).status_code == 200


def test_pairs_with_one_empty_side_are_scored_as_tei_does(channel, http, artifacts):
    """Either side of a (query, text) pair may be empty, as in TEI (/rerank, /predict and gRPC); the
    logits are transformers'. Two empty sides, or an empty single text, are refused."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    checkpoint = json.loads((artifacts[2] / "manifest.json").read_text())["model"]["path"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = BertForSequenceClassification.from_pretrained(checkpoint)
    rerank = pb_grpc.RerankStub(channel)
    for query, texts in ((TEXTS[0], [TEXTS[1], ""]), ("", TEXTS[:2])):
        with torch.no_grad():
            expected = model.eval()(**tokenizer([query] * 2, texts, padding=True, return_tensors="pt")).logits[:, 0]
        answer = http.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True})
        assert answer.status_code == 200, answer.text
        scores = {rank["index"]: rank["score"] for rank in answer.json()}
        np.testing.assert_allclose([scores[0], scores[1]], expected.numpy(), atol=1e-4)
        ranked = rerank.Rerank(pb.RerankRequest(query=query, texts=texts, raw_scores=True), metadata=AUTH)
        np.testing.assert_allclose(sorted(r.score for r in ranked.ranks), sorted(scores.values()), atol=1e-6)
    both = http.post("/rerank", json={"query": "", "texts": [TEXTS[1], ""]})
    assert both.status_code == 422
    assert both.json()["error"] == "input 1 is a pair of two empty texts: a pair needs a text"
    refused = status_of(rerank.Rerank, pb.RerankRequest(query="", texts=[""]), metadata=AUTH)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "two empty texts" in refused.details()

    checkpoint = json.loads((artifacts[1] / "manifest.json").read_text())["model"]["path"]  # the classifier
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = BertForSequenceClassification.from_pretrained(checkpoint)
    pairs = [[TEXTS[0], ""], ["", TEXTS[1]]]
    with torch.no_grad():
        expected = model.eval()(**tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True,
                                            return_tensors="pt")).logits.numpy()
    batch = http.post("/predict", json={"inputs": pairs, "raw_scores": True, "model": "tiny-classify"})
    flat = http.post("/predict", json={"inputs": pairs[0], "raw_scores": True, "model": "tiny-classify"})
    assert batch.status_code == 200 and flat.status_code == 200, (batch.text, flat.text)
    labels = model.config.id2label
    for row, answer in zip(expected, [*batch.json(), flat.json()]):
        by_label = {item["label"]: item["score"] for item in answer}
        np.testing.assert_allclose([by_label[labels[i]] for i in range(len(row))], row, atol=1e-4)
    predict = pb_grpc.PredictStub(channel)
    pair = predict.PredictPair(pb.PredictPairRequest(inputs=["", TEXTS[1]], raw_scores=True), metadata=AUTH)
    np.testing.assert_allclose(sorted(p.score for p in pair.predictions), sorted(expected[1]), atol=1e-4)
    for inputs in (["", ""], [["", ""]], [[""]], ""):
        refused = http.post("/predict", json={"inputs": inputs, "model": "tiny-classify"})
        assert refused.status_code == 422, (inputs, refused.text)
    zero_shot = http.post("/predict", json={"inputs": [TEXTS[0], ""], "labels": ["a", "b"], "model": "tiny-embed"})
    assert zero_shot.status_code == 422 and zero_shot.json()["error"] == "`inputs` cannot contain an empty string"


def status_of(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failure:
        result = call(*args, **kwargs)
        if isinstance(result, grpc.Call):  # a response stream fails as it is read
            list(result)
    return failure.value


def test_bad_calls_get_tei_status_codes_and_the_server_keeps_serving(channel, server, http):
    info, embed, predict, rerank, tokenize = stubs(channel)
    refused = status_of(embed.Embed, pb.EmbedRequest(inputs="hello"))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    refused = status_of(embed.Embed, pb.EmbedRequest(inputs="hello"), metadata=(("authorization", "Bearer wrong"),))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    multi = rpb_grpc.EmbedMultiStub(channel).EmbedMulti  # our own package wants the key too
    assert status_of(multi, rpb.EmbedMultiRequest(inputs="hello")).code() == grpc.StatusCode.UNAUTHENTICATED
    no_colbert = status_of(multi, rpb.EmbedMultiRequest(inputs="hello"), metadata=AUTH)
    assert no_colbert.code() == grpc.StatusCode.INVALID_ARGUMENT and "ColBERT" in no_colbert.details()
    lowercase = (("authorization", f"bearer {KEY}"),)  # the scheme is case-insensitive (RFC 7235)
    assert len(embed.Embed(pb.EmbedRequest(inputs="hello"), metadata=lowercase).embeddings) > 0
    assert status_of(embed.Embed, pb.EmbedRequest(inputs=""), metadata=AUTH).code() == grpc.StatusCode.INVALID_ARGUMENT
    sparse = status_of(embed.EmbedSparse, pb.EmbedSparseRequest(inputs="hello"), metadata=AUTH)
    assert sparse.code() == grpc.StatusCode.INVALID_ARGUMENT and "sparse" in sparse.details()
    too_long = status_of(embed.Embed, pb.EmbedRequest(inputs="word " * 200), metadata=AUTH)
    assert too_long.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in too_long.details()
    no_texts = status_of(rerank.Rerank, pb.RerankRequest(query="q", texts=[]), metadata=AUTH)
    assert no_texts.code() == grpc.StatusCode.INVALID_ARGUMENT and no_texts.details() == "`texts` cannot be empty"
    too_many = status_of(rerank.Rerank, pb.RerankRequest(query="q", texts=["t"] * 33), metadata=AUTH)
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    oversize = status_of(embed.Embed, pb.EmbedRequest(inputs="x" * (PAYLOAD_LIMIT + 1)), metadata=AUTH)
    assert oversize.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    unknown = status_of(channel.unary_unary("/tei.v1.Embed/Nope"), b"", metadata=AUTH)
    assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED
    stream_error = status_of(embed.EmbedStream, iter([pb.EmbedRequest(inputs="ok"), pb.EmbedRequest(inputs="")]),
                             metadata=AUTH)
    assert stream_error.code() == grpc.StatusCode.INVALID_ARGUMENT

    cancelled = embed.Embed.future(pb.EmbedRequest(inputs=" ".join(TEXTS)), metadata=AUTH)
    cancelled.cancel()
    assert len(embed.Embed(pb.EmbedRequest(inputs="still serving"), metadata=AUTH).embeddings) == 32
    assert server.process.poll() is None

    metrics = http.get("/metrics").text
    assert _count(metrics, 'endpoint="grpc Embed",status="OK"') >= 1
    assert _count(metrics, 'endpoint="grpc Embed",status="UNAUTHENTICATED"') == 2
    assert _count(metrics, 'endpoint="grpc Embed",status="INVALID_ARGUMENT"') >= 2  # empty, over-long


def _count(metrics: str, labels: str) -> float:
    found = re.search(r"^bert_serve_requests_total\{" + re.escape(labels) + r"\} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_cancelled_calls_queued_input_never_runs(tiny_embed_artifact):
    """A gRPC call waiting behind a blocked batch is cancelled by its client: its (poisoned) input
    leaves the queue before it runs, counted in bert_serve_dropped_inputs_total, as an HTTP
    request whose client went away."""
    from tokenizers import Tokenizer

    from loadtest.faults import FaultyBackend
    from loadtest.servers import metric_value, running_app, wait_until
    from service.app import create_app
    from service.backends import load_backend
    from service.settings import Settings

    poison = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json")).token_to_id("poison")
    backends: list[FaultyBackend] = []

    def loader(directory, kind, threads):
        backends.append(FaultyBackend(load_backend(directory, kind, threads), block_calls=[1], poison_id=poison))
        return backends[-1]

    port = free_port()
    settings = Settings(artifacts=[tiny_embed_artifact], grpc_port=port, workers=1, threads_per_worker=1,
                        wide_worker=False, max_wait_ms=0)
    with running_app(create_app(settings, loader=loader)) as url, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="/ready 200")
        embed = pb_grpc.EmbedStub(channel)
        blocker = embed.Embed.future(pb.EmbedRequest(inputs="holds the only worker"))
        assert backends[0].blocked.wait(60)
        cancelled = embed.Embed.future(pb.EmbedRequest(inputs="poison"))
        wait_until(lambda: metric_value(url, "bert_serve_admitted_inputs", model="tiny-embed") == 2,
                   what="the second call admitted")
        cancelled.cancel()
        wait_until(lambda: metric_value(url, "bert_serve_admitted_inputs", model="tiny-embed") == 1,
                   what="the cancelled call released")
        backends[0].release.set()
        assert len(blocker.result(timeout=60).embeddings) == 32
        wait_until(lambda: metric_value(url, "bert_serve_dropped_inputs_total", model="tiny-embed") == 1,
                   what="the cancelled call's input dropped (from the queue, or the batch held behind the worker)")
        assert len(embed.Embed(pb.EmbedRequest(inputs="a caller that waits"), timeout=60).embeddings) == 32
        assert backends[0].calls == 2  # the blocked call and the waiting caller's: the cancelled input never ran
        assert metric_value(url, "bert_serve_batch_failures_total", model="tiny-embed") == 0


def test_a_taken_grpc_port_is_refused_in_one_line(tiny_embed_artifact):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(tiny_embed_artifact),
                                 "--port", "0", "--grpc-port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"bert-serve: error: cannot listen for gRPC on 127.0.0.1:{port}: "
                                                  "Address already in use"]
