"""Quantized embeddings (`embedding_dtype`: int8, uint8, binary, ubinary) against sentence-transformers'
`quantize_embeddings` with the artifact's calibration ranges: the ranges the compile records, then
/embed, /v1/embeddings (JSON and base64) and gRPC Embed of a real server, its --embedding-dtype
default, and the refusals (an unknown dtype, int8 without ranges, a route that answers float32)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys

import grpc
import httpx
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from artifact.embedding_dtypes import l2_normalize, quantize
from artifact.loader import load_artifact
from artifact.manifest import Manifest
from compile.passes.quantize import sentence_rows
from service.grpc_api import tei_pb2 as pb
from service.grpc_api import tei_pb2_grpc as pb_grpc
from tests.support.service import error_of

TEXTS = ["seven wizards quietly judge boxing matches", "the quick brown fox", "a lazy dog sleeps", "no"]
QUANTIZED = ("int8", "uint8", "binary", "ubinary")
BYTES_OF = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def test_quantize_is_quantize_embeddings():
    """Every precision, bit for bit, on values inside, on the edges of and outside the ranges, a
    dimension whose range is one value, and a dimension count that is not a multiple of 8."""
    rng = np.random.default_rng(0)
    calibration = rng.normal(size=(40, 37)).astype(np.float32)
    calibration[:, 5] = 0.25  # a constant dimension: its step is 1, as sentence-transformers makes it
    ranges = np.stack([calibration.min(axis=0), calibration.max(axis=0)])
    embeddings = np.concatenate([rng.normal(size=(6, 37)).astype(np.float32) * 1.5, ranges, -ranges])
    for precision in ("float32", *QUANTIZED):
        ours, theirs = quantize(embeddings, precision, ranges), quantize_embeddings(embeddings, precision, ranges)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, precision
        np.testing.assert_array_equal(ours, theirs, err_msg=precision)


def test_the_compile_records_the_ranges_of_the_artifacts_own_embeddings_of_the_shipped_sentences(
        tiny_embed_artifact, tiny_bert_dir):
    manifest = Manifest.read(tiny_embed_artifact)
    model = load_artifact(tiny_embed_artifact)
    rows = sentence_rows(tiny_bert_dir / "tokenizer.json", manifest.model.max_position_embeddings)
    step = manifest.generic.max_batch
    outputs = np.concatenate([model.run_generic(rows[0][i:i + step], rows[1][i:i + step]).output
                              for i in range(0, len(rows[0]), step)])
    ranges = manifest.embedding_ranges
    assert ranges.sentences == len(outputs)
    for recorded, embeddings in ((ranges.raw, outputs), (ranges.normalized, l2_normalize(outputs))):
        expected = np.stack([embeddings.min(axis=0), embeddings.max(axis=0)])
        np.testing.assert_allclose(np.array(recorded), expected, rtol=0, atol=1e-6)
    # what quantize_embeddings computes from them as its calibration_embeddings
    np.testing.assert_array_equal(quantize_embeddings(outputs, "int8", calibration_embeddings=outputs),
                                  quantize(outputs, "int8", np.array(ranges.raw)))


@pytest.fixture(scope="module")
def uncalibrated(tiny_embed_artifact, tmp_path_factory):
    """The tiny artifact as compiled before ranges were recorded: its manifest without them."""
    copy = tmp_path_factory.mktemp("uncalibrated") / "uncalibrated"
    shutil.copytree(tiny_embed_artifact, copy)
    data = json.loads((copy / "manifest.json").read_text())
    del data["embedding_ranges"]
    (copy / "manifest.json").write_text(json.dumps(data))
    return copy


@pytest.fixture(scope="module")
def server(serve, tiny_embed_artifact, tiny_classify_artifact):
    """int8 by default (--embedding-dtype), gRPC beside HTTP."""
    with serve([tiny_embed_artifact, tiny_classify_artifact], "--embedding-dtype", "int8",
               grpc=True) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def ranges(tiny_embed_artifact):
    recorded = Manifest.read(tiny_embed_artifact).embedding_ranges
    return {True: np.array(recorded.normalized), False: np.array(recorded.raw)}


def _floats(http, normalize=True, **fields) -> np.ndarray:
    response = http.post("/embed", json={"inputs": TEXTS, "normalize": normalize, "embedding_dtype": "float32",
                                         **fields})
    assert response.status_code == 200, response.text
    return np.array(response.json(), dtype=np.float32)


@pytest.mark.parametrize("precision", QUANTIZED)
def test_embed_answers_quantize_embeddings_of_its_float32_answer(http, ranges, precision):
    for normalize, dimensions in ((True, None), (False, None), (False, 20)):
        fields = {"normalize": normalize, "dimensions": dimensions}
        floats = _floats(http, **fields)
        response = http.post("/embed", json={"inputs": TEXTS, "embedding_dtype": precision, **fields})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert all(type(value) is int for row in answer for value in row)
        expected = quantize_embeddings(floats, precision, ranges=ranges[normalize][:, :dimensions])
        np.testing.assert_array_equal(np.array(answer), expected, err_msg=f"{precision} {fields}")


def test_the_servers_default_dtype_answers_where_a_request_names_none(http, server, ranges):
    floats = _floats(http)
    answer = http.post("/embed", json={"inputs": TEXTS}).json()
    np.testing.assert_array_equal(np.array(answer), quantize_embeddings(floats, "int8", ranges=ranges[True]))
    assert http.get("/info").json()["embedding_dtype"] == "int8"
    # not a classifier's: /predict answers as ever
    assert http.post("/predict", json={"inputs": TEXTS[0]}).status_code == 200


@pytest.mark.parametrize("precision", ("float32", *QUANTIZED))
def test_openai_embeddings_in_json_and_base64(http, ranges, precision):
    floats = _floats(http)
    expected = quantize_embeddings(floats, precision, ranges=ranges[True])
    for path in ("/v1/embeddings", "/embeddings"):
        body = {"input": TEXTS, "embedding_dtype": precision}
        listed = http.post(path, json=body).json()["data"]
        np.testing.assert_array_equal(np.array([item["embedding"] for item in listed]), expected)
        packed = http.post(path, json={**body, "encoding_format": "base64"}).json()["data"]
        dtype = BYTES_OF.get(precision, "<f4")
        decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype=dtype) for item in packed])
        np.testing.assert_array_equal(decoded, expected)


def test_the_openai_client_reads_them_when_told_the_format(server, http, ranges):
    """Told no format, the `openai` client asks base64 and reads it as float32: a quantized dtype
    needs `encoding_format` (docs/API.md)."""
    import openai

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    floats = _floats(http)
    answer = api.embeddings.create(input=TEXTS, model="tiny-embed", encoding_format="float",
                                   extra_body={"embedding_dtype": "uint8"})
    np.testing.assert_array_equal([item.embedding for item in answer.data],
                                  quantize_embeddings(floats, "uint8", ranges=ranges[True]))


def test_grpc_embed_takes_the_dtype_and_keeps_teis_clients_answered(server, http, ranges):
    floats = _floats(http)
    with grpc.insecure_channel(server.grpc) as channel:
        embed = pb_grpc.EmbedStub(channel).Embed
        for precision in QUANTIZED:
            answer = embed(pb.EmbedRequest(inputs=TEXTS[0], embedding_dtype=precision))
            assert answer.embedding_dtype == precision
            expected = quantize_embeddings(floats[:1], precision, ranges=ranges[True])[0]
            np.testing.assert_array_equal(np.array(answer.embeddings), expected)
        as_float = embed(pb.EmbedRequest(inputs=TEXTS[0], embedding_dtype="float32"))
        assert not as_float.HasField("embedding_dtype")
        np.testing.assert_allclose(as_float.embeddings, floats[0], atol=1e-6)
        # a TEI client, which knows no embedding_dtype, gets the server's default in the field it reads
        default = embed(pb.EmbedRequest(inputs=TEXTS[0]))
        assert default.embedding_dtype == "int8"
        np.testing.assert_array_equal(default.embeddings, quantize_embeddings(floats[:1], "int8", ranges[True])[0])
        with pytest.raises(grpc.RpcError) as refused:
            embed(pb.EmbedRequest(inputs=TEXTS[0], embedding_dtype="int4"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "int4" in refused.value.details() and "ubinary" in refused.value.details()


def test_refusals(http):
    for path, body in (("/embed", {"inputs": "hi"}), ("/v1/embeddings", {"input": "hi"})):
        response = http.post(path, json={**body, "embedding_dtype": "int4"})
        message, _ = error_of(response)
        assert response.status_code == 422 and "embedding_dtype" in message and "ubinary" in message
    response = http.post("/embed", json={"inputs": "hi", "embedding_dtype": "uint8", "dimensions": 20})
    message, _ = error_of(response)
    assert response.status_code == 400 and "normalize false" in message
    response = http.post("/embed_sparse", json={"inputs": "hi", "embedding_dtype": "binary"})
    message, _ = error_of(response)
    assert response.status_code == 400 and "/embed_sparse answers float32" in message
    response = http.post("/embed", json={"inputs": "hi", "model": "tiny-classify", "embedding_dtype": "int8"})
    assert response.status_code == 400 and "not an embedding model" in error_of(response)[0]


def test_a_model_without_ranges_refuses_int8_and_answers_binary(serve, uncalibrated):
    with serve([uncalibrated]) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        floats = _floats(http)
        for precision in ("int8", "uint8"):
            response = http.post("/v1/embeddings", json={"input": TEXTS, "embedding_dtype": precision})
            message, _ = error_of(response)
            assert response.status_code == 400 and "records no calibration ranges" in message, message
        answer = http.post("/embed", json={"inputs": TEXTS, "embedding_dtype": "binary"}).json()
        np.testing.assert_array_equal(np.array(answer), quantize_embeddings(floats, "binary"))
        assert http.get("/info").json()["models"][0]["embedding_dtypes"] == ["float32", "binary", "ubinary"]


def test_a_default_int8_over_a_model_without_ranges_is_refused_at_start(uncalibrated):
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(uncalibrated), "--port", "0"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BERT_SERVE_EMBEDDING_DTYPE": "uint8"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--embedding-dtype uint8" in lines[0] and "'uncalibrated'" in lines[0], lines
