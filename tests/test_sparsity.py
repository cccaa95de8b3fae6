"""Block sparsity: pruning, the BSR kernel, the Relax rewrite, and a tiny BERT end to end."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
import tvm
from tvm import relax

from compile.build import make_target
from compile.checkpoint import BertWrapper, example_inputs
from compile.importer import export_and_import
from compile.passes.lift import lift_and_transform
from compile.passes.sparsity import (
    block_density,
    bsr_matmul_func,
    prune_blocks,
    prune_model,
    sparsify,
    to_bsr,
)
from compile.passes.strategy import apply_strategy

pytestmark = pytest.mark.slow  # collected first: see conftest.py

CPU = make_target("cpu")
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
VOCAB = 30522


def _vm(mod: tvm.IRModule) -> relax.VirtualMachine:
    return relax.VirtualMachine(tvm.compile(mod, CPU, relax_pipeline=relax.get_default_pipeline(CPU)), tvm.cpu())


# ----------------------------------------------------------------------------- pruning


def test_prune_blocks_keeps_the_largest_blocks():
    weight = np.random.default_rng(0).standard_normal((48, 30)).astype(np.float32)
    pruned = prune_blocks(weight, 0.3, (16, 3))
    norms = np.sqrt((weight.reshape(3, 16, 10, 3) ** 2).sum(axis=(1, 3))).ravel()
    kept = np.any(pruned.reshape(3, 16, 10, 3) != 0, axis=(1, 3)).ravel()
    assert kept.sum() == round(0.3 * 30)
    assert norms[kept].min() > norms[~kept].max()
    np.testing.assert_array_equal(pruned[pruned != 0], weight[pruned != 0])
    assert block_density(pruned, (16, 3)) == pytest.approx(9 / 30)


def test_prune_blocks_keeps_at_least_one_and_refuses_bad_blocks():
    weight = np.ones((32, 8), np.float32)
    assert block_density(prune_blocks(weight, 1e-6, (16, 1)), (16, 1)) == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="does not divide"):
        prune_blocks(weight, 0.5, (5, 1))
    with pytest.raises(ValueError, match="density"):
        prune_blocks(weight, 0.0, (16, 1))


def test_to_bsr_round_trips():
    weight = prune_blocks(np.random.default_rng(1).standard_normal((32, 12)).astype(np.float32), 0.25, (8, 2))
    data, indices, indptr = to_bsr(weight, (8, 2))
    dense = np.zeros_like(weight)
    for row in range(len(indptr) - 1):
        for j in range(indptr[row], indptr[row + 1]):
            dense[row * 8:(row + 1) * 8, indices[j] * 2:(indices[j] + 1) * 2] = data[j]
    np.testing.assert_array_equal(dense, weight)
    assert indices.dtype == indptr.dtype == np.int32


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("mcpu", ["x86-64-v3", "x86-64-v4"])  # 8 and 16 lanes: different row tiles
@pytest.mark.parametrize("block", [(16, 1), (32, 1), (4, 2)])
def test_bsr_kernel_matches_dense(block, mcpu):
    """One build, symbolic M: M=1, M at and around the kernel's row tile, odd M, and a weight with
    empty block rows; compiled for AVX2 and AVX-512, run where this CPU can."""
    from artifact.cpu_features import missing_on_host, target_features
    from compile.capabilities import Capabilities
    from compile.kernels.sparse import tile_rows

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    rng = np.random.default_rng(2)
    n, k = 96, 38
    weight = rng.standard_normal((n, k)).astype(np.float32)
    weight[:block[0]] = 0  # an all-zero block row: an empty row in BSR
    weight = prune_blocks(weight, 0.2, block)
    data, indices, indptr = to_bsr(weight, block)
    assert indptr[1] == 0
    kernel = bsr_matmul_func(k, len(indices), block, n // block[0], "float32", target)
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target)
    if missing_on_host(target_features(target)):
        pytest.skip(f"compiled for {mcpu}; this CPU lacks its features, so it is not run")
    rows = tile_rows(Capabilities.of(target).lanes, block[0])
    for m in (1, rows, rows + 1, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.zeros((m, n // block[0], block[0]), np.float32)
        args = [tvm.runtime.tensor(a) for a in (x, data, indices, indptr, out)]
        lib["main"](*args)
        np.testing.assert_allclose(args[-1].numpy().reshape(m, n), x @ weight.T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the Relax rewrite


def _three_linears() -> tvm.IRModule:
    """h = x @ w1^T; y = h @ w2^T (both eligible); z = x3 @ w3^T (3-D LHS, left dense); u = x @ w4^T."""
    m = tvm.tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((m, 32), "float32"))
    x3 = relax.Var("x3", relax.TensorType((2, m, 32), "float32"))
    weights = [relax.Var(name, relax.TensorType(shape, "float32"))
               for name, shape in (("w1", (64, 32)), ("w2", (32, 64)), ("w3", (16, 32)), ("w4", (16, 32)))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, x3, *weights], attrs={"num_input": 2}):
        with bb.dataflow():
            linear = lambda a, w: bb.emit(relax.op.matmul(a, bb.emit(relax.op.permute_dims(w))))  # noqa: E731
            h = linear(x, weights[0])
            y = linear(h, weights[1])
            z = linear(x3, weights[2])
            u = linear(x, weights[3])
            out = bb.emit_output(relax.Tuple([y, z, u]))
        bb.emit_func_output(out)
    return bb.get()


def test_sparsify_rewrites_only_eligible_matmuls():
    rng = np.random.default_rng(3)
    shapes = [(64, 32), (32, 64), (16, 32), (16, 32)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params[:3] = [prune_blocks(w, 0.2, (16, 1)) for w in params[:3]]  # w4 stays dense: kept_dense
    mod, new_params, report = sparsify(_three_linears(), params, (16, 1), max_density=0.5)
    assert report == {"rewritten": 2, "kept_dense": 1, "density": pytest.approx(0.2, abs=0.01), "block": [16, 1],
                      "choice": "block density <= 0.5", "choices": []}
    main = mod["main"]
    assert int(main.attrs["num_input"]) == 2
    assert [p.name for p in main.params] == [
        "x", "x3", "w1_bsr_data", "w1_bsr_indices", "w1_bsr_indptr",
        "w2_bsr_data", "w2_bsr_indices", "w2_bsr_indptr", "w3", "w4"]
    assert [tuple(p.shape) for p in new_params] == [tuple(int(d) for d in p.ty.shape) for p in main.params[2:]]
    x, x3 = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((2, 5, 32)).astype(np.float32)
    got = _vm(mod)["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(x3), *new_params)
    w1, w2, w3, w4 = params
    for out, want in zip(got, ((x @ w1.T) @ w2.T, x3 @ w3.T, x @ w4.T)):
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- tiny BERT


@pytest.fixture(scope="module")
def tiny_bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    query = model.encoder.layer[0].attention.self.query.weight.detach().clone()
    pruned = prune_model(model, 0.25, (16, 1))
    assert torch.equal(model.encoder.layer[0].attention.self.query.weight, query)  # qkv not chosen
    wrapper = BertWrapper(model, "embed", "mean").eval()
    imported = export_and_import(wrapper, 4, 64, VOCAB)
    return wrapper, pruned, apply_strategy(imported.mod, "concat"), imported.params


def test_tiny_bert_sparse_build_matches_torch(tiny_bert):
    wrapper, pruned, combined, params = tiny_bert
    assert pruned == 6  # 2 layers x (attention.output, intermediate, output)
    mod, new_params, report = sparsify(combined, params, (16, 1))
    assert report["rewritten"] == 6 and report["density"] == pytest.approx(0.25)
    lifted = lift_and_transform(mod, new_params)
    inputs = example_inputs(3, 17, VOCAB, seed=1)
    args = [tvm.runtime.tensor(a) for a in [*(t.numpy() for t in inputs), *lifted.weights]]
    got = _vm(lifted.mod)["main"](*args)[0].numpy()
    with torch.no_grad():
        want = wrapper(*inputs).numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_tiny_bert_sparse_cuda_build_compiles(tiny_bert):
    _, _, combined, params = tiny_bert
    mod, new_params, _ = sparsify(combined, params, (16, 1), target=CUDA)
    lifted = lift_and_transform(mod, new_params)
    executable = tvm.compile(lifted.mod, CUDA, relax_pipeline=relax.get_default_pipeline(CUDA))
    assert executable is not None


@pytest.fixture(scope="module")
def sparse_artifact(tiny_bert_dir, tmp_path_factory):
    from conftest import compile_artifact

    out = tmp_path_factory.mktemp("sparse") / "artifact"
    compile_artifact(tiny_bert_dir, out, ["2x16"], sparsity=0.75, block="16x1", sparse_choice="density")
    return out


def test_sparse_compile_of_a_tiny_bert_through_the_pipeline(sparse_artifact):
    from artifact.loader import load_artifact

    model = load_artifact(sparse_artifact)
    manifest, sparsity = model.manifest, model.manifest.sparsity
    assert manifest.validated and manifest.buckets[0].max_abs_diff <= 1e-4  # vs PyTorch on the pruned weights
    assert sparsity.pruned == 2 * 3  # FFN in, FFN out, attention output of both layers
    assert sparsity.rewritten == 2 * 3 and sparsity.kept_dense == 0
    assert abs(sparsity.density - 0.25) < 1e-9 and sparsity.block == [16, 1]
    assert 0.0 < sparsity.cosine_vs_dense < 1.0
    ids = np.ones((2, 16), dtype=np.int64)
    assert model.run(ids, ids).path == "bucket-2x16"


def test_sparse_artifact_serves_through_the_service(sparse_artifact, serve):
    import httpx

    from artifact.loader import load_artifact
    from service.tokenization import TextTokenizer

    texts = ["block sparse weights", "a longer sentence that still fits in the bucket"]
    model = load_artifact(sparse_artifact)
    tokenizer = TextTokenizer(model.tokenizer_dir / "tokenizer.json", 64, model.manifest.model.vocab_size)
    encoded = tokenizer.encode(texts, truncation=None)
    width = max(len(e) for e in encoded)
    ids = np.zeros((len(texts), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, : len(e)], mask[row, : len(e)] = e.ids, 1
    expected = model.run(ids, mask).output
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    with serve([sparse_artifact]) as server:
        response = httpx.post(f"{server.url}/embed", json={"inputs": texts}, timeout=30)
    assert response.status_code == 200
    assert response.headers["x-compute-path"] == "bucket-2x16"
    np.testing.assert_allclose(np.array(response.json()), expected, atol=1e-5)


def test_sparse_block_that_does_not_divide_is_a_compile_error(tiny_bert_dir, tmp_path):
    from conftest import compile_artifact

    from compile.errors import CompileError

    with pytest.raises(CompileError, match="block 5x1"):
        compile_artifact(tiny_bert_dir, tmp_path / "bad", ["2x16"], sparsity=0.5, block="5x1")
    assert not (tmp_path / "bad").exists()


def test_from_checkpoint_uses_the_checkpoints_own_zero_blocks_without_changing_it(tiny_bert_dir, tmp_path):
    """A checkpoint whose FFN weights are 90% zero 16x1 blocks: `--sparsity from-checkpoint` rewrites
    exactly those linears to BSR, prunes nothing, and the artifact verifies against PyTorch on the
    checkpoint itself (what `compile.verify` can do only for an unchanged model)."""
    from conftest import compile_artifact
    from safetensors.torch import load_file, save_file

    from compile.verify import verify

    checkpoint = tmp_path / "sparse-checkpoint"
    shutil.copytree(tiny_bert_dir, checkpoint)
    weights = load_file(str(checkpoint / "model.safetensors"))
    generator = np.random.default_rng(0)
    for name, weight in weights.items():
        if name.endswith(("intermediate.dense.weight", "output.dense.weight")) and "attention" not in name:
            blocks = weight.reshape(weight.shape[0] // 16, 16, weight.shape[1])
            keep = generator.random((blocks.shape[0], blocks.shape[2])) < 0.1
            keep[0, 0] = True
            weights[name] = (blocks * torch.from_numpy(keep)[:, None, :]).reshape(weight.shape).contiguous()
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})

    manifest, _ = compile_artifact(checkpoint, tmp_path / "artifact", ["2x16"], sparsity="from-checkpoint", block="16x1")
    sparsity = manifest.sparsity
    assert sparsity.mode == "from-checkpoint" and sparsity.pruned == 0 and sparsity.cosine_vs_dense is None
    # the two FFN linears of both layers were timed, dense against BSR, on this CPU; the faster runs
    assert sparsity.choice.startswith("timed here") and len(sparsity.choices) == 2 * 2
    assert all(c.density < 0.2 and c.dense_ms > 0 and c.sparse_ms > 0 for c in sparsity.choices)
    assert sparsity.rewritten == sum(c.bsr for c in sparsity.choices)
    assert manifest.validated and manifest.buckets[0].max_abs_diff <= 1e-4
    assert verify(tmp_path / "artifact")["generic"]  # the unchanged checkpoint is the oracle


def test_sparse_bench_times_a_table_and_a_sparse_checkpoint(tiny_bert_dir, tmp_path, capsys):
    """The benchmark end to end on the tiny BERT: one cell of the pruning table, and a checkpoint
    that is sparse for real, compiled dense and from-checkpoint, both validated against PyTorch."""
    import json

    from loadtest import sparse_bench

    common = ["--model", str(tiny_bert_dir), "--shape", "2x16", "--blocks", "16x1", "--repeats", "1"]
    assert sparse_bench.main([*common, "--sparsities", "0.75", "--out", str(tmp_path / "table")]) == 0
    table = json.loads((tmp_path / "table" / "sparse_bench.json").read_text())
    assert [row["config"] for row in table["rows"]] == ["dense", "0.75@16x1"]
    assert table["rows"][1]["sparsity"]["rewritten"] == 2 * 3 and table["rows"][1]["median_ms"] > 0
    assert sparse_bench.main([*common, "--from-checkpoint", "0.25", "--out", str(tmp_path / "checkpoint")]) == 0
    report = json.loads((tmp_path / "checkpoint" / "from_checkpoint.json").read_text())
    dense, sparse = report["builds"]["dense"], report["builds"]["from-checkpoint"]
    assert dense["max_abs_diff"] <= 1e-4 and sparse["max_abs_diff"] <= 1e-4  # both are the checkpoint's function
    assert sparse["sparsity"]["mode"] == "from-checkpoint" and len(sparse["sparsity"]["choices"]) == 2 * 3
    assert sparse["sparsity"]["rewritten"] == sum(c["bsr"] for c in sparse["sparsity"]["choices"])
    assert "| from-checkpoint |" in capsys.readouterr().out
