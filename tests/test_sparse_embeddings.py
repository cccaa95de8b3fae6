"""SPLADE: `bert-compile --task sparse` on tiny random masked LMs with a real tokenizer (a
sentence-transformers SparseEncoder checkpoint, max and sum pooling, and a bare BertForMaskedLM),
packed and padded, served on POST /embed_sparse (and gRPC EmbedSparse) equal to
`SparseEncoder.encode`; the dense routes refuse a sparse model and the reverse."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from compile.config import CompileConfig
from compile.errors import CompileError
from loadtest.random_checkpoint import copy_tokenizer
from service.grpc_api import tei_pb2 as pb
from service.grpc_api import tei_pb2_grpc as pb_grpc
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import tiny_config
from tests.support.service import error_of, http_client

pytestmark = pytest.mark.slow  # collected first: see conftest.py

TEXTS = ["seven wizards quietly judge boxing matches", "hello", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: directory}: a bare BertForMaskedLM, and SparseEncoder.save of it with max and sum pooling."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import BertForMaskedLM

    root = tmp_path_factory.mktemp("mlm")
    torch.manual_seed(7)
    BertForMaskedLM(tiny_config(architectures=["BertForMaskedLM"])).save_pretrained(root / "bare")
    copy_tokenizer(root / "bare")
    for strategy in ("max", "sum"):
        SparseEncoder(modules=[MLMTransformer(str(root / "bare")), SpladePooling(strategy)]).save(
            str(root / f"splade-{strategy}"))
    return {name: root / name for name in ("bare", "splade-max", "splade-sum")}


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse-artifacts")
    compile_artifact(checkpoints["splade-max"], root / "splade-max", ["packed-16"], task="sparse", layout="packed",
                     generic_shapes=["3x20"])
    compile_artifact(checkpoints["bare"], root / "bare", ["2x16"], pooling="splade", generic_shapes=["3x20"])
    compile_artifact(checkpoints["splade-sum"], root / "splade-sum", ["2x16"], task="sparse", generic_shapes=["3x20"])
    return [root / "splade-max", root / "bare", root / "splade-sum"]


@pytest.fixture(scope="module")
def server(serve, artifacts, tiny_embed_artifact):
    with serve([*artifacts, tiny_embed_artifact], "--max-wait-ms", "20", grpc=True) as running:
        yield running


client = pytest.fixture(scope="module", name="client")(http_client)


def encoded(checkpoint) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(checkpoint), device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()


def dense(pairs: list[dict], vocab: int) -> np.ndarray:
    row = np.zeros(vocab, dtype=np.float32)
    for pair in pairs:
        row[pair["index"]] = pair["value"]
    return row


@pytest.mark.parametrize("model, checkpoint", [("splade-max", "splade-max"), ("bare", "bare"),
                                               ("splade-sum", "splade-sum")])
def test_embed_sparse_equals_sparse_encoder(client, checkpoints, model, checkpoint):
    response = client.post("/embed_sparse", json={"inputs": TEXTS, "model": model})
    assert response.status_code == 200, response.text
    expected = encoded(checkpoints[checkpoint])
    answer = response.json()
    assert len(answer) == len(TEXTS)
    for pairs, reference in zip(answer, expected):
        indices = [pair["index"] for pair in pairs]
        assert indices == sorted(indices) and all(pair["value"] > 0 for pair in pairs)
        assert set(indices) == set(np.flatnonzero(reference))  # the same active terms
        np.testing.assert_allclose(dense(pairs, len(reference)), reference, atol=1e-5, rtol=1e-4)


def test_grpc_embed_sparse_answers_what_http_answers(server, client):
    with grpc.insecure_channel(server.grpc) as channel:
        answer = pb_grpc.EmbedStub(channel).EmbedSparse(pb.EmbedSparseRequest(inputs=TEXTS[0]))
    expected = client.post("/embed_sparse", json={"inputs": TEXTS[0]}).json()[0]
    assert [(v.index, pytest.approx(v.value, abs=1e-6)) for v in answer.sparse_embeddings] == [
        (pair["index"], pair["value"]) for pair in expected]


def test_dense_routes_refuse_a_sparse_model_and_the_reverse(client):
    for route, body in (("/embed", {"inputs": "hello", "model": "bare"}),
                        ("/v1/embeddings", {"input": "hello", "model": "bare"}),
                        ("/embed", {"inputs": "hello", "model": "splade-max"})):
        refused = client.post(route, json=body)
        assert refused.status_code == 400 and "/embed_sparse" in error_of(refused)[0], (route, refused.text)
    refused = client.post("/embed_sparse", json={"inputs": "hello", "model": "tiny-embed"})
    assert refused.status_code == 400 and "--task sparse" in refused.json()["error"]
    info = client.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    assert [m["pooling"] for m in info["models"][:3]] == ["splade", "splade", "splade-sum"]
    assert info["models"][0]["output_dim"] == 30522


def test_compile_refuses_what_is_not_splade(tiny_bert_dir, tmp_path):
    with pytest.raises(CompileError, match="not a masked-LM checkpoint"):
        compile_artifact(tiny_bert_dir, tmp_path / "out", ["1x8"], task="sparse")
    with pytest.raises(ValueError, match="task sparse pools with splade"):
        CompileConfig(task="sparse", pooling="mean")
    assert CompileConfig(pooling="splade").task == "sparse"
    assert not (tmp_path / "out").exists()


def test_the_mlm_heads_weight_is_packed_at_compile_time(checkpoints):
    """The vocabulary is padded to a multiple of every CPU tile width, so the packing pass takes the
    head's weight like any other linear's (BERT's 30522 words alone divide none: the kernel would
    pad and copy the whole weight on every call)."""
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.packing import linears_on_weights, pack_linear_weights

    info = inspect_checkpoint(checkpoints["bare"], "embed", "splade")
    imported = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, info.config["vocab_size"], "packed")
    linears = linears_on_weights(imported.mod["main"])
    assert sorted(int(weight.ty.shape[0]) for weight in linears.values())[-1] == 30528  # 30522 padded to 96s
    for lanes in (8, 16):  # AVX2, AVX-512
        assert pack_linear_weights(imported.mod, lanes)[1] == len(linears)
