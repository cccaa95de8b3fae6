"""The packed layout end to end: the packed PyTorch function, its Relax module, a compiled packed
artifact against PyTorch on padded rows, the loader's routing, and a served packed artifact."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tvm

from artifact.bucketing import PackedBucket
from artifact.loader import load_artifact
from artifact.packed_batch import pack_batch
from compile.build import specialize
from compile.checkpoint import inspect_checkpoint, load_wrapper
from compile.importer import export_and_import, symbolic_dims
from compile.packed_model import PackedBertWrapper
from compile.verify import verify
from loadtest.servers import compute_path_counts
from tests.support.artifacts import compile_artifact


def _ragged(lengths, seed=0, vocab=30522):
    generator = np.random.default_rng(seed)
    width = max(lengths)
    ids = generator.integers(1000, vocab, (len(lengths), width))
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    return ids * mask, mask


@pytest.mark.parametrize("task, pooling", [("embed", "mean"), ("embed", "cls"), ("embed", "max"), ("classify", "auto")])
def test_packed_function_equals_the_padded_one(tiny_bert_dir, tiny_classifier_dir, task, pooling):
    info = inspect_checkpoint(tiny_classifier_dir if task == "classify" else tiny_bert_dir, task, pooling)
    padded = load_wrapper(info, task)
    ids, mask = _ragged([7, 1, 13, 4])
    positions = np.broadcast_to(np.arange(13), ids.shape).copy()
    inputs = [torch.from_numpy(x) for x in (ids, mask, np.zeros_like(ids), positions)]
    packed = [torch.from_numpy(x) for x in pack_batch(ids, mask, seq=16, tokens=30)]
    with torch.no_grad():
        expected = padded(*inputs).numpy()
        got = PackedBertWrapper(padded)(*packed).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_packed_module_runs_linears_on_symbolic_tokens_and_a_bucket_binds_only_seq(tiny_bert_dir):
    info = inspect_checkpoint(tiny_bert_dir, "embed")
    imported = export_and_import(load_wrapper(info, "embed"), 8, info.max_seq, 30522, layout="packed")
    dims = symbolic_dims(imported.mod)
    assert set(dims) == {"tokens", "batch", "seq"}
    main = imported.mod["main"]
    assert [len(p.ty.shape) for p in main.params[:6]] == [1, 1, 1, 2, 2, 1]
    bound = specialize(imported.mod, PackedBucket(16))["main"].params
    tokens, (batch, seq) = bound[0].ty.shape[0], bound[3].ty.shape
    assert isinstance(tokens, tvm.tirx.Var) and isinstance(batch, tvm.tirx.Var)
    assert isinstance(seq, tvm.tirx.IntImm) and int(seq) == 16


@pytest.fixture(scope="module")
def packed_artifact(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-packed"
    compile_artifact(tiny_bert_dir, out, ["packed-8", "packed-16"], layout="packed")
    return out


def test_packed_artifact_is_validated_and_timed_per_sequence_bound(packed_artifact):
    model = load_artifact(packed_artifact)
    manifest = model.manifest
    assert manifest.layout == "packed" and manifest.validated
    assert [b.name for b in model.buckets] == ["packed-8", "packed-16"]
    for entry in manifest.buckets:
        assert entry.batch is None and entry.max_abs_diff <= 1e-4
        assert entry.latency_ms > 0 and entry.cost_model is not None
    assert manifest.generic.cost_model is not None and not manifest.generic.takes_bounded_batches
    # what the planner (and the loader) charge a batch: the tightest bound's cost model at the
    # batch's real tokens, attention padded to that bound
    choice = model.costs.choose(4, 5, tokens=17)
    assert choice.bucket == PackedBucket(8) and choice.computed_tokens == 17
    assert choice.cost == manifest.buckets[0].cost_model.predicted_ms(4, 8, 17)
    assert verify(packed_artifact)["bucket_packed-16"]["packed-16"] <= 1e-4


@pytest.mark.parametrize("lengths, path", [([5, 1, 8], "bucket-packed-8"), ([3, 16, 9, 2, 11], "bucket-packed-16"),
                                           ([30, 4], "generic")])
def test_loader_runs_real_tokens_only_and_matches_pytorch(packed_artifact, tiny_bert_dir, lengths, path):
    model = load_artifact(packed_artifact)
    ids, mask = _ragged(lengths, seed=len(lengths))
    result = model.run(ids, mask)
    assert result.path == path
    assert result.computed_tokens == result.real_tokens == sum(lengths)
    wrapper = load_wrapper(inspect_checkpoint(tiny_bert_dir, "embed"), "embed")
    ids_t = torch.from_numpy(ids)
    with torch.no_grad():
        expected = wrapper(ids_t, torch.from_numpy(mask), torch.zeros_like(ids_t),
                           torch.arange(ids.shape[1]).expand(ids.shape)).numpy()
    np.testing.assert_allclose(result.output, expected, atol=1e-4)


def test_served_packed_artifact_answers_like_the_padded_one_without_padding(serve, packed_artifact,
                                                                           tiny_embed_artifact):
    texts = ["a short one", "a somewhat longer sentence with more words in it", "mid length text here"]
    answers = {}
    for name, artifact in (("packed", packed_artifact), ("padded", tiny_embed_artifact)):
        with serve([artifact], "--workers", "1") as server:
            before = compute_path_counts(server.url)
            response = httpx.post(f"{server.url}/embed", json={"inputs": texts}, timeout=60)
            assert response.status_code == 200, response.text
            answers[name] = np.asarray(response.json())
            counts = compute_path_counts(server.url)
            info = httpx.get(f"{server.url}/info").json()["models"][0]
            assert info["layout"] == name
            if name == "packed":
                assert counts["tokens"] > before["tokens"] and counts["padding"] == before["padding"]
                assert info["buckets"][0]["name"] == "packed-8" and info["batch_costs"] == "measured latency"
    np.testing.assert_allclose(answers["packed"], answers["padded"], atol=1e-5)
