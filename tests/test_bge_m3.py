"""bge-m3 as one artifact with three heads: a checkpoint laid out as FlagEmbedding lays it out (an XLM-R
encoder, `colbert_linear.pt`, `sparse_linear.pt`) compiled into packed libraries whose pooled output
is the dense vector and whose token output carries every token's ColBERT vector and lexical weight;
served on /embed, /embed_sparse, /embed_multi and /embed_hybrid through a real server on loopback and
compared with FlagEmbedding's `BGEM3FlagModel.encode`; gRPC's bertserve.v1 EmbedHybrid and EmbedMulti
compared with those routes."""

from __future__ import annotations

import numpy as np
import pytest

from compile.validate import DRIFT_SENTENCES
from service.grpc_api import retrieval_pb2 as rpb
from service.grpc_api import retrieval_pb2_grpc as rpb_grpc
from service.grpc_api import tei_pb2 as pb
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import save_tiny_bge_m3
from tests.support.service import assert_grpc_refuses, grpc_channel, http_client

# unseen words come out as <unk>, which the lexical weights leave out; one repeated word keeps its largest weight
TEXTS = ["The cat sleeps on the warm windowsill.", "zebra quartz", "a man is playing a guitar, a man.",
         DRIFT_SENTENCES[3]]  # 39 tokens: within the tiny model's 40 positions


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return save_tiny_bge_m3(tmp_path_factory.mktemp("bge-m3") / "model", DRIFT_SENTENCES)


@pytest.fixture(scope="module")
def server(serve, m3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bge-m3-artifact") / "tiny-m3"
    compile_artifact(m3_dir, out, ["packed-32"], layout="packed", precision="fp32", generic_shapes=["2x11"])
    with serve([out], "--max-wait-ms", "20", grpc=True) as running:
        yield running


client = pytest.fixture(scope="module", name="client")(http_client)
channel = pytest.fixture(scope="module", name="channel")(grpc_channel)


@pytest.fixture(scope="module")
def reference(m3_dir):
    from FlagEmbedding import BGEM3FlagModel

    model = BGEM3FlagModel(str(m3_dir), use_fp16=False, devices="cpu")
    return model.encode(TEXTS, return_dense=True, return_sparse=True, return_colbert_vecs=True)


def assert_same_sparse(answer: list[dict], expected: dict):
    assert [pair["index"] for pair in answer] == sorted(int(token) for token in expected)
    for pair in answer:
        assert pair["value"] == pytest.approx(float(expected[str(pair["index"])]), rel=1e-3)


def test_each_route_answers_as_flag_embedding(client, reference):
    dense = client.post("/embed", json={"inputs": TEXTS})
    assert dense.status_code == 200, dense.text
    np.testing.assert_allclose(np.asarray(dense.json()), reference["dense_vecs"], atol=1e-5)
    sparse = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert sparse.status_code == 200, sparse.text
    for answer, expected in zip(sparse.json(), reference["lexical_weights"]):
        assert_same_sparse(answer, expected)
    assert all(len(answer) for answer in sparse.json()[:1])
    multi = client.post("/embed_multi", json={"inputs": TEXTS})
    assert multi.status_code == 200, multi.text
    for answer, expected in zip(multi.json(), reference["colbert_vecs"]):
        np.testing.assert_allclose(np.asarray(answer), expected, atol=2e-5)  # every token after the first


def test_a_hybrid_request_answers_any_combination_from_one_pass(client, reference):
    hybrid = client.post("/embed_hybrid", json={"inputs": TEXTS})
    assert hybrid.status_code == 200, hybrid.text
    for answer, dense, weights, vectors in zip(hybrid.json(), reference["dense_vecs"], reference["lexical_weights"],
                                               reference["colbert_vecs"]):
        assert set(answer) == {"dense", "sparse", "colbert"}
        np.testing.assert_allclose(answer["dense"], dense, atol=1e-5)
        assert_same_sparse(answer["sparse"], weights)
        np.testing.assert_allclose(np.asarray(answer["colbert"]), vectors, atol=2e-5)
    sparse_only = client.post("/embed_hybrid", json={"inputs": TEXTS[0], "outputs": ["sparse"]}).json()
    assert list(sparse_only[0]) == ["sparse"]
    assert client.post("/embed_hybrid", json={"inputs": "a", "outputs": ["lexical"]}).status_code == 422
    assert client.post("/embed_hybrid", json={"inputs": "a", "outputs": []}).status_code == 422


def rows(vectors) -> list[list[float]]:
    """gRPC's token vectors (tei.v1.TokenEmbedding) as HTTP's lists."""
    return [list(row.embeddings) for row in vectors]


def assert_hybrid_as_http(answer: rpb.EmbedHybridResponse, expected: dict):
    """One gRPC answer holds what the HTTP answer holds: the outputs asked for, the others empty."""
    np.testing.assert_allclose(answer.dense, expected.get("dense", []), atol=1e-6)
    assert [(pair.index, pytest.approx(pair.value, rel=1e-6)) for pair in answer.sparse] == [
        (pair["index"], pair["value"]) for pair in expected.get("sparse", [])]
    assert len(answer.colbert) == len(expected.get("colbert", []))
    for vector, wanted in zip(rows(answer.colbert), expected.get("colbert", [])):
        np.testing.assert_allclose(vector, wanted, atol=1e-6)


def test_grpc_embed_hybrid_and_its_stream_answer_what_http_answers(client, channel):
    hybrid = rpb_grpc.EmbedHybridStub(channel)
    expected = client.post("/embed_hybrid", json={"inputs": TEXTS}).json()
    requests = [rpb.EmbedHybridRequest(inputs=text) for text in TEXTS]  # no outputs named: all three
    singles = [hybrid.EmbedHybrid(request) for request in requests]
    for answers in (singles, list(hybrid.EmbedHybridStream(iter(requests)))):
        assert len(answers) == len(TEXTS)
        for answer, wanted in zip(answers, expected):
            assert len(answer.dense) and len(answer.sparse) and len(answer.colbert)
            assert_hybrid_as_http(answer, wanted)
    for outputs, normalize in ((["sparse"], True), (["colbert", "dense", "colbert"], False)):
        answer = hybrid.EmbedHybrid(rpb.EmbedHybridRequest(inputs=TEXTS[2], outputs=outputs, normalize=normalize))
        wanted = client.post("/embed_hybrid", json={"inputs": TEXTS[2], "outputs": outputs, "normalize": normalize})
        assert_hybrid_as_http(answer, wanted.json()[0])
        assert answer.metadata.compute_tokens == int(wanted.headers["x-compute-tokens"])
    assert not hybrid.EmbedHybrid(rpb.EmbedHybridRequest(inputs=TEXTS[0], outputs=["sparse"])).dense


def test_grpc_embed_multi_answers_the_colbert_vectors_of_http(client, channel):
    multi = rpb_grpc.EmbedMultiStub(channel)
    expected = client.post("/embed_multi", json={"inputs": TEXTS}).json()
    for text, wanted in zip(TEXTS, expected):
        np.testing.assert_allclose(rows(multi.EmbedMulti(rpb.EmbedMultiRequest(inputs=text)).token_embeddings),
                                   wanted, atol=1e-6)


def test_grpc_embed_hybrid_truncates_and_refuses_as_http(client, channel):
    """Over-long: cut only where `truncate` says (TEI's gRPC), at the side it names; bad outputs, an
    empty input, a text past the model's positions: INVALID_ARGUMENT where HTTP answers 4xx."""
    hybrid = rpb_grpc.EmbedHybridStub(channel).EmbedHybrid
    long = " ".join(TEXTS)
    for direction, name in ((pb.TRUNCATION_DIRECTION_LEFT, "Left"), (pb.TRUNCATION_DIRECTION_RIGHT, "Right")):
        answer = hybrid(rpb.EmbedHybridRequest(inputs=long, truncate=True, truncation_direction=direction))
        wanted = client.post("/embed_hybrid", json={"inputs": long, "truncate": True, "truncation_direction": name})
        assert_hybrid_as_http(answer, wanted.json()[0])
    refusals = ((rpb.EmbedHybridRequest(inputs=long), {"inputs": long, "truncate": False}, "tokens"),
                (rpb.EmbedHybridRequest(inputs="a", outputs=["lexical"]), {"inputs": "a", "outputs": ["lexical"]},
                 "lexical"),
                (rpb.EmbedHybridRequest(inputs=""), {"inputs": ""}, "empty"))
    for request, body, says in refusals:
        assert_grpc_refuses(hybrid, request, says)
        assert 400 <= client.post("/embed_hybrid", json=body).status_code < 500
    metrics = client.get("/metrics").text
    assert 'endpoint="grpc EmbedHybrid",status="INVALID_ARGUMENT"' in metrics
