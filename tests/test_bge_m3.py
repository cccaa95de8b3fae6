"""bge-m3 as one artifact with three heads: a checkpoint laid out as FlagEmbedding lays it out (an XLM-R
encoder, `colbert_linear.pt`, `sparse_linear.pt`) compiled into packed libraries whose pooled output
is the dense vector and whose token output carries every token's ColBERT vector and lexical weight;
served on /embed, /embed_sparse, /embed_multi and /embed_hybrid through a real server on loopback and
compared with FlagEmbedding's `BGEM3FlagModel.encode`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from compile.validate import DRIFT_SENTENCES
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import save_tiny_bge_m3

# unseen words come out as <unk>, which the lexical weights leave out; one repeated word keeps its largest weight
TEXTS = ["The cat sleeps on the warm windowsill.", "zebra quartz", "a man is playing a guitar, a man.",
         DRIFT_SENTENCES[3]]  # 39 tokens: within the tiny model's 40 positions


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return save_tiny_bge_m3(tmp_path_factory.mktemp("bge-m3") / "model", DRIFT_SENTENCES)


@pytest.fixture(scope="module")
def client(serve, m3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bge-m3-artifact") / "tiny-m3"
    compile_artifact(m3_dir, out, ["packed-32"], layout="packed", precision="fp32", generic_shapes=["2x11"])
    with serve([out], "--max-wait-ms", "20") as running, httpx.Client(base_url=running.url, timeout=60) as client:
        yield client


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
