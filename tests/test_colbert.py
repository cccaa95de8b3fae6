"""ColBERT (PyLate) models: `--task colbert` (or detected), the projection of every token computed in the
packed libraries, queries and documents tokenized and filtered as PyLate's `ColBERT.encode(is_query=...)`
does, served on POST /embed_multi and gRPC's bertserve.v1 EmbedMulti through a real server on loopback.

The reference is PyLate's algorithm on transformers: its own `Dense`, `insert_prefix_token` and
`skiplist_mask`, around its tokenization and filtering as `ColBERT.tokenize` and `ColBERT.encode` write
them (pylate 1.6.0's `ColBERT.encode` calls sentence-transformers internals that version 6 removed, so
the model class itself cannot run here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from compile.checkpoint import inspect_checkpoint
from compile.errors import CompileError
from service.grpc_api import retrieval_pb2 as rpb
from service.grpc_api import retrieval_pb2_grpc as rpb_grpc
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import COLBERT_SETTINGS, save_tiny_colbert
from tests.support.service import assert_grpc_refuses, grpc_channel, http_client

QUERIES = ["hello", "what is the capital of france?"]
DOCUMENTS = ["Paris is the capital of France, and its largest city!",
             "a b c d e f g h i j k l m n o p q r s t u v w x y z, again and again.", "ok"]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory):
    return save_tiny_colbert(tmp_path_factory.mktemp("colbert") / "model")


@pytest.fixture(scope="module")
def colbert_artifact(colbert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("colbert-artifact") / "tiny-colbert"
    compile_artifact(colbert_dir, out, ["packed-32"], layout="packed", precision="fp32", generic_shapes=["2x11"])
    return out


@pytest.fixture(scope="module")
def server(serve, colbert_artifact, tiny_embed_artifact):
    with serve([colbert_artifact, tiny_embed_artifact], "--max-wait-ms", "20", grpc=True) as running:
        yield running


client = pytest.fixture(scope="module", name="client")(http_client)
channel = pytest.fixture(scope="module", name="channel")(grpc_channel)


@pytest.fixture(scope="module")
def embed_multi(channel):
    """bertserve.v1's EmbedMulti stub on the same server."""
    return rpb_grpc.EmbedMultiStub(channel)


def pylate_encode(model_dir, texts: list[str], is_query: bool) -> list[np.ndarray]:
    """PyLate's `ColBERT.encode(texts, is_query=...)` (normalized, filtered token vectors)."""
    import torch
    from pylate.models import ColBERT, Dense
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertModel

    settings = json.loads((model_dir / "config_sentence_transformers.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.mask_token  # PyLate pads (expands) queries with [MASK]
    bert = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
    dense_config = json.loads((model_dir / "1_Dense" / "config.json").read_text())
    dense = Dense(dense_config["in_features"], dense_config["out_features"], bias=dense_config["bias"])
    dense.linear.load_state_dict({key.removeprefix("linear."): value
                                  for key, value in load_file(str(model_dir / "1_Dense" / "model.safetensors")).items()})
    length = settings["query_length"] if is_query else settings["document_length"]
    prefix = tokenizer.convert_tokens_to_ids(settings["query_prefix"] if is_query else settings["document_prefix"])
    expand = is_query and settings["do_query_expansion"]
    features = tokenizer(texts, padding="max_length" if expand else True, truncation="longest_first",
                         max_length=length - 1, return_tensors="pt")
    ids = ColBERT.insert_prefix_token(features["input_ids"], prefix)
    mask = ColBERT.insert_prefix_token(features["attention_mask"], 1)
    types = ColBERT.insert_prefix_token(features["token_type_ids"], 0)
    if is_query and settings["attend_to_expansion_tokens"]:
        mask.fill_(1)
    with torch.no_grad():
        states = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        vectors = dense({"token_embeddings": states})["token_embeddings"]
    if is_query:
        keep = torch.ones_like(ids, dtype=torch.bool) if expand else mask.bool()
    else:
        skiplist = [tokenizer.convert_tokens_to_ids(word) for word in settings["skiplist_words"]]
        keep = ColBERT.skiplist_mask(ids, skiplist) & mask.bool()
    return [torch.nn.functional.normalize(vectors[i][keep[i]], p=2, dim=1).numpy() for i in range(len(texts))]


def assert_same_vectors(answer, expected):
    assert len(answer) == len(expected)
    for vectors, reference in zip(answer, expected):
        vectors = np.asarray(vectors, dtype=np.float32)
        assert vectors.shape == reference.shape
        np.testing.assert_allclose(vectors, reference, atol=2e-5)


@pytest.mark.parametrize("is_query,texts", [(True, QUERIES), (False, DOCUMENTS)])
def test_embed_multi_equals_pylate(client, colbert_dir, is_query, texts):
    response = client.post("/embed_multi", json={"inputs": texts, "is_query": is_query, "model": "tiny-colbert"})
    assert response.status_code == 200, response.text
    expected = pylate_encode(colbert_dir, texts, is_query)
    assert_same_vectors(response.json(), expected)
    if is_query:  # expanded with [MASK] up to the query length, every token kept
        assert all(len(vectors) == COLBERT_SETTINGS["query_length"] for vectors in response.json())


def test_a_packed_batch_mixing_queries_and_documents_answers_each_as_alone(colbert_artifact, colbert_dir):
    from artifact.colbert import ColbertSettings
    from artifact.loader import load_artifact
    from service.batcher import EXPANDED
    from service.colbert import ColbertEncoder

    model = load_artifact(colbert_artifact)
    tokenizer_dir = model.tokenizer_dir
    encoder = ColbertEncoder(tokenizer_dir / "tokenizer.json", ColbertSettings.of_checkpoint(tokenizer_dir))
    encoded = [*encoder.encode(QUERIES, True, None), *encoder.encode(DOCUMENTS, False, None)]
    width = max(map(len, encoded))
    input_ids, mask = np.zeros((len(encoded), width), np.int64), np.zeros((len(encoded), width), np.int64)
    for row, item in enumerate(encoded):
        input_ids[row, :len(item)], mask[row, :len(item)] = item.ids, 1
        mask[row, item.attended or len(item):len(item)] = EXPANDED
    result = model.run(input_ids, mask, tokens=True)
    assert result.path == "bucket-packed-32"
    assert all(entry.attention_fused == 2 for entry in model.manifest.passes.strategies.values())  # the fused kernel
    answers = [encoder.vectors(item, rows, row < len(QUERIES)) for row, (item, rows) in enumerate(zip(encoded, result.tokens))]
    expected = pylate_encode(colbert_dir, QUERIES, True) + pylate_encode(colbert_dir, DOCUMENTS, False)
    assert_same_vectors(answers, expected)
    assert model.run(input_ids, mask).tokens is None  # a pooled-only call copies no token output


def test_embed_all_serves_the_projection_and_routes_refuse_other_kinds(client):
    states = client.post("/embed_all", json={"inputs": "hello", "model": "tiny-colbert"})
    assert states.status_code == 200 and np.asarray(states.json()[0]).shape == (3, 16)  # [CLS] hello [SEP], projected
    refused = client.post("/embed", json={"inputs": "hello", "model": "tiny-colbert"})
    assert refused.status_code == 400 and "/embed_multi" in refused.json()["error"]
    refused = client.post("/embed_multi", json={"inputs": "hello", "model": "tiny-embed"})
    assert refused.status_code == 400 and "projection" in refused.json()["error"]
    assert "\n" not in refused.json()["error"]
    assert client.post("/embed_multi", json={"inputs": "hello", "is_query": "yes"}).status_code == 422
    assert client.post("/embed_multi", json={"inputs": [[1, 2, 3]]}).status_code == 422


def test_a_checkpoint_without_colbert_settings_or_projection_is_refused_in_one_line(tiny_bert_dir, colbert_dir,
                                                                                  tmp_path):
    with pytest.raises(CompileError, match="not a ColBERT checkpoint") as refused:
        inspect_checkpoint(tiny_bert_dir, "embed", "colbert")
    assert "\n" not in str(refused.value)
    bare = tmp_path / "no-projection"
    bare.mkdir()
    for path in colbert_dir.iterdir():
        if path.is_file() and path.name != "modules.json":
            (bare / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CompileError, match="no projection"):
        inspect_checkpoint(bare, "embed", "auto")  # detected by its settings, refused for its missing Dense
    assert inspect_checkpoint(colbert_dir, "embed", "auto").pooling == "colbert"  # detected


def test_embed_multi_quantizes_as_sentence_transformers_and_refuses_uncalibrated_dtypes(client, colbert_dir):
    from sentence_transformers.quantization import quantize_embeddings

    expected = pylate_encode(colbert_dir, DOCUMENTS[:2], False)
    for dtype in ("binary", "ubinary"):
        answer = client.post("/embed_multi", json={"inputs": DOCUMENTS[:2], "is_query": False, "embedding_dtype": dtype})
        assert answer.status_code == 200, answer.text
        for vectors, reference in zip(answer.json(), expected):
            np.testing.assert_array_equal(np.asarray(vectors), quantize_embeddings(reference, precision=dtype))
    refused = client.post("/embed_multi", json={"inputs": "hello", "embedding_dtype": "int8"})
    assert refused.status_code == 400 and "calibration" in refused.json()["error"]
    assert client.post("/embed_multi", json={"inputs": "hello", "embedding_dtype": "int4"}).status_code == 422


def token_vectors(answer: rpb.EmbedMultiResponse) -> np.ndarray:
    return np.asarray([row.embeddings for row in answer.token_embeddings], dtype=np.float32)


@pytest.mark.parametrize("is_query,texts", [(True, QUERIES), (False, DOCUMENTS)])
def test_grpc_embed_multi_and_its_stream_answer_what_http_answers(client, embed_multi, is_query, texts):
    expected = client.post("/embed_multi", json={"inputs": texts, "is_query": is_query}).json()
    requests = [rpb.EmbedMultiRequest(inputs=text, is_query=is_query) for text in texts]
    singles = [embed_multi.EmbedMulti(request) for request in requests]
    streamed = list(embed_multi.EmbedMultiStream(iter(requests)))
    for answers in (singles, streamed):
        assert_same_vectors([token_vectors(answer) for answer in answers], [np.asarray(rows) for rows in expected])
        assert not any(answer.HasField("embedding_dtype") for answer in answers)  # float32
    single = client.post("/embed_multi", json={"inputs": texts[0], "is_query": is_query})
    assert singles[0].metadata.compute_tokens == int(single.headers["x-compute-tokens"])
    if is_query:  # unset is_query: a query, as HTTP's default
        assert_same_vectors([token_vectors(embed_multi.EmbedMulti(rpb.EmbedMultiRequest(inputs=texts[0])))],
                            [np.asarray(expected[0])])


def test_grpc_embed_multi_quantizes_and_refuses_as_http(client, channel, embed_multi):
    for dtype in ("binary", "ubinary"):
        request = rpb.EmbedMultiRequest(inputs=DOCUMENTS[0], is_query=False, embedding_dtype=dtype)
        answer = embed_multi.EmbedMulti(request)
        expected = client.post("/embed_multi", json={"inputs": DOCUMENTS[0], "is_query": False,
                                                     "embedding_dtype": dtype}).json()[0]
        assert answer.embedding_dtype == dtype
        np.testing.assert_array_equal(token_vectors(answer), np.asarray(expected))
    by_name = embed_multi.EmbedMulti(rpb.EmbedMultiRequest(inputs="hello", model="tiny-colbert"))
    assert token_vectors(by_name).shape == (COLBERT_SETTINGS["query_length"], 16)
    for request, says, http_status in (
            (rpb.EmbedMultiRequest(inputs="hello", embedding_dtype="int8"), "calibration", 400),
            (rpb.EmbedMultiRequest(inputs="hello", embedding_dtype="int4"), "int4", 422),
            (rpb.EmbedMultiRequest(inputs="hello", model="tiny-embed"), "projection", 400),
            (rpb.EmbedMultiRequest(inputs=""), "empty", 422)):
        assert_grpc_refuses(embed_multi.EmbedMulti, request, says)
        body = {"inputs": request.inputs, **({"embedding_dtype": request.embedding_dtype}
                                             if request.HasField("embedding_dtype") else {}),
                **({"model": request.model} if request.HasField("model") else {})}
        assert client.post("/embed_multi", json=body).status_code == http_status
    assert_grpc_refuses(embed_multi.EmbedMulti, rpb.EmbedMultiRequest(inputs="hello", model="nope"), code="NOT_FOUND")
    assert_grpc_refuses(lambda requests: list(embed_multi.EmbedMultiStream(iter(requests))),  # a bad message fails
                        [rpb.EmbedMultiRequest(inputs="ok"), rpb.EmbedMultiRequest(inputs="")])  # its stream
    assert_grpc_refuses(rpb_grpc.EmbedHybridStub(channel).EmbedHybrid, rpb.EmbedHybridRequest(inputs="hello"), "bge-m3")
    assert client.post("/embed_hybrid", json={"inputs": "hello"}).status_code == 400
