"""compile/passes/sparsity.py: block sparsity: pruning, the BSR kernel, SparsifyLinears as Before/Expected,
the Relax rewrite, and a tiny BERT end to end."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
import tvm
from tvm import relax
from tvm.script import relax as R

from compile.build import make_target
from compile.capabilities import Capabilities
from compile.checkpoint import BertWrapper, example_inputs
from compile.importer import export_and_import
from compile.kernels import bsr, dense
from compile.passes.lift import lift_and_transform
from compile.passes.sparsity import (
    SparseWeights,
    SparsifyLinears,
    block_density,
    bsr_matmul_func,
    prune_blocks,
    prune_model,
    sparsify,
    to_bsr,
)
from compile.passes.strategy import apply_strategy
from compile.sparse_choice import SparseChoice
from tests.support.relax_modules import linear_module
from tests.support.tvm_run import build_kernel, build_reference, call_kernel, run, skip_unless_runs_here

pytestmark = pytest.mark.slow  # collected first: see conftest.py

CPU = make_target("cpu")
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
VOCAB = 30522


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


@pytest.mark.parametrize("mcpu", ["x86-64-v3", "x86-64-v4"])  # 8 and 16 lanes: different row tiles
@pytest.mark.parametrize("block", [(16, 1), (32, 1), (4, 2)])
def test_bsr_kernel_matches_dense(block, mcpu):
    """One build, symbolic M: M=1, M at and around the kernel's row tile, odd M, and a weight with
    empty block rows; compiled for AVX2 and AVX-512, run where this CPU can."""
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
    lib = build_kernel(kernel.with_attr("global_symbol", "main"), target)
    skip_unless_runs_here(target)
    rows = tile_rows(Capabilities.of(target).lanes, block[0])
    for m in (1, rows, rows + 1, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        (out,) = call_kernel(lib, [x, data, indices, indptr], [((m, n // block[0], block[0]), "float32")])
        np.testing.assert_allclose(out.reshape(m, n), x @ weight.T, rtol=1e-5, atol=1e-5)


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
    mod, new_params, report = sparsify(_three_linears(), params, SparseChoice((16, 1), 0.5, CPU))
    assert report == {"rewritten": 2, "kept_dense": 1, "density": pytest.approx(0.2, abs=0.01), "block": [16, 1],
                      "choice": "block density <= 0.5", "choices": []}
    main = mod["main"]
    assert int(main.attrs["num_input"]) == 2
    assert [p.name for p in main.params] == [
        "x", "x3", "w1_bsr_data", "w1_bsr_offsets", "w1_bsr_indptr",
        "w2_bsr_data", "w2_bsr_offsets", "w2_bsr_indptr", "w3", "w4"]
    assert [tuple(p.shape) for p in new_params] == [tuple(int(d) for d in p.ty.shape) for p in main.params[2:]]
    x, x3 = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((2, 5, 32)).astype(np.float32)
    got = run(build_reference(mod, CPU), x, x3, *new_params)
    w1, w2, w3, w4 = params
    for out, want in zip(got, ((x @ w1.T) @ w2.T, x3 @ w3.T, x @ w4.T)):
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


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
    mod, new_params, report = sparsify(combined, params, SparseChoice((16, 1), 0.5, CPU))
    assert report["rewritten"] == 6 and report["density"] == pytest.approx(0.25)
    lifted = lift_and_transform(mod, new_params)
    inputs = example_inputs(3, 17, VOCAB, seed=1)
    got = run(build_reference(lifted.mod, CPU), *(t.numpy() for t in inputs), *lifted.weights)[0]
    with torch.no_grad():
        want = wrapper(*inputs).numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_tiny_bert_sparse_cuda_build_compiles(tiny_bert):
    _, _, combined, params = tiny_bert
    mod, new_params, _ = sparsify(combined, params, SparseChoice((16, 1), 0.5, CUDA))
    lifted = lift_and_transform(mod, new_params)
    assert build_reference(lifted.mod, CUDA) is not None


@pytest.fixture(scope="module")
def sparse_artifact(tiny_bert_dir, tmp_path_factory):
    from tests.support.artifacts import compile_artifact

    out = tmp_path_factory.mktemp("sparse") / "artifact"
    compile_artifact(tiny_bert_dir, out, ["2x16"], sparsity=0.75, block="16x1", sparse_choice="density")
    return out


def test_sparse_compile_of_a_tiny_bert_through_the_pipeline(sparse_artifact, tiny_bert_dir):
    from artifact.loader import load_artifact

    model = load_artifact(sparse_artifact)
    manifest, sparsity = model.manifest, model.manifest.sparsity
    assert manifest.validated and manifest.buckets[0].max_abs_diff <= 1e-4  # vs PyTorch on the pruned weights
    assert sparsity.pruned == 2 * 3  # FFN in, FFN out, attention output of both layers
    assert sparsity.rewritten == 2 * 3 and sparsity.kept_dense == 0
    assert abs(sparsity.density - 0.25) < 1e-9 and sparsity.block == [16, 1]
    assert 0.0 < sparsity.cosine_vs_dense < 1.0
    # next to it, the pruned model against the dense one on the shipped sentences, as PyTorch computes it
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.passes.quantize import sentence_rows
    from compile.sentences import ACCURACY_SENTENCES

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    dense, pruned = load_wrapper(info, "embed"), load_wrapper(info, "embed")
    prune_model(pruned.bert, 0.25, (16, 1))
    rows = [torch.from_numpy(x) for x in sentence_rows(tiny_bert_dir / "tokenizer.json", info.max_seq)]
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(dense(*rows), pruned(*rows), dim=-1)
    agreement = sparsity.sentences_vs_dense
    assert agreement["cosine_min"] == pytest.approx(float(cosine.min()), abs=1e-5)
    assert agreement["cosine_mean"] == pytest.approx(float(cosine.mean()), abs=1e-5)
    assert agreement["worst_sentence"] == ACCURACY_SENTENCES[int(cosine.argmin())]
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
    from compile.errors import CompileError
    from tests.support.artifacts import compile_artifact

    with pytest.raises(CompileError, match="block 5x1"):
        compile_artifact(tiny_bert_dir, tmp_path / "bad", ["2x16"], sparsity=0.5, block="5x1")
    assert not (tmp_path / "bad").exists()


def test_from_checkpoint_uses_the_checkpoints_own_zero_blocks_without_changing_it(tiny_bert_dir, tmp_path):
    """A checkpoint whose FFN weights are 90% zero 16x1 blocks: `--sparsity from-checkpoint` rewrites
    exactly those linears to BSR, prunes nothing, and the artifact verifies against PyTorch on the
    checkpoint itself (what `compile.verify` can do only for an unchanged model)."""
    from safetensors.torch import load_file, save_file

    from compile.verify import verify
    from tests.support.artifacts import compile_artifact

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


def test_sparse_bench_times_a_cell_of_the_pruning_table(tiny_bert_dir, tmp_path, capsys):
    """The benchmark end to end on the tiny BERT: the dense build and one cell of the pruning table."""
    import json

    from loadtest import sparse_bench

    common = ["--model", str(tiny_bert_dir), "--shape", "2x16", "--blocks", "16x1", "--repeats", "1"]
    assert sparse_bench.main([*common, "--sparsities", "0.75", "--out", str(tmp_path / "table")]) == 0
    table = json.loads((tmp_path / "table" / "sparse_bench.json").read_text())
    assert [row["config"] for row in table["rows"]] == ["dense", "0.75@16x1"]
    assert table["rows"][1]["sparsity"]["rewritten"] == 2 * 3 and table["rows"][1]["median_ms"] > 0
    assert "| 0.75 |" in capsys.readouterr().out


V3 = make_target("cpu", mcpu="x86-64-v3")
BLOCK = (16, 1)


def _half_zero_blocks(n: int, k: int) -> np.ndarray:
    weight = np.random.default_rng(0).standard_normal((n, k)).astype("float32")
    weight[:16, ::2] = 0.0  # half of the first block row's blocks
    weight[16:, 1::2] = 0.0
    return weight


def test_a_sparse_enough_linear_runs_on_the_bsr_kernel():
    """Untimed, on AVX2 (16 x 1 blocks: two ymm per block column): the C kernel over fp32 blocks, [M, N] out."""
    k, n = 8, 32
    weight = _half_zero_blocks(n, k)
    arrays = bsr.pack("f32", weight, BLOCK)
    builder = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((6, k), "float32"))
    parts = [relax.Var(f"w_bsr_{part}", relax.TensorType(a.shape, str(a.dtype))) for part, a in arrays.items()]
    with builder.function("main", [x, *parts], attrs={"num_input": 1}):
        with builder.dataflow():
            kernel = bsr.bsr_kernel("f32", tvm.tirx.Var("m", "int64"), k, n, arrays, BLOCK, 8)
            y = builder.emit_output(relax.call_tir(builder.add_func(kernel, "bsr_matmul"), [x, *parts],
                                                   R.Tensor((6, n), "float32")))
        builder.emit_func_output(y)
    weights = SparseWeights([tvm.runtime.tensor(weight)])
    sparsified = SparsifyLinears(weights, SparseChoice(BLOCK, 0.5, V3))(linear_module(k, n))
    tvm.ir.assert_structural_equal(sparsified, builder.get())
    assert [w.numpy().tolist() for w in weights.params] == [a.tolist() for a in arrays.values()]
    assert (weights.report["rewritten"], weights.report["kept_dense"], weights.report["density"]) == (1, 0, 0.5)


def test_a_denser_linear_stays_dense():
    before = linear_module(8, 32)
    weights = SparseWeights([tvm.runtime.tensor(_half_zero_blocks(32, 8))])
    tvm.ir.assert_structural_equal(SparsifyLinears(weights, SparseChoice(BLOCK, 0.25, V3))(before), before)
    assert (weights.report["rewritten"], weights.report["kept_dense"]) == (0, 1)


def _ffn_sparse_checkpoint(source, out, density: float = 0.1):
    """`source` with both FFN weights of every layer zero but for `density` of their 16 x 1 blocks (the
    attention output and Q/K/V stay dense): a checkpoint only partly sparse."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    weights = load_file(str(out / "model.safetensors"))
    for name, weight in weights.items():
        if name.endswith(("intermediate.dense.weight", "output.dense.weight")) and "attention" not in name:
            weights[name] = torch.from_numpy(prune_blocks(weight.numpy(), density, (16, 1)))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_partly_sparse_checkpoint_packed_in_int8_runs_each_weight_on_its_chosen_kernel(
        whole_panels_bert_dir, tmp_path, monkeypatch):
    """Packed layout, int8 linears, `--sparsity from-checkpoint`, with the timer injected: the FFN's first
    weight is timed fastest on int8 blocks, its second fastest dense. Each runs on that kernel (its
    precision's gate admits int8 blocks), the dense weights stay on the int8 kernel, and the artifact agrees
    with PyTorch on the unchanged checkpoint. Attention's products are asked for (fp32): none is timed."""
    from artifact.loader import load_artifact
    from compile.phases import transform
    from compile.sparse_choice import DENSE
    from tests.support.artifacts import compile_artifact, least_cosine_to_pytorch

    checkpoint = _ffn_sparse_checkpoint(whole_panels_bert_dir, tmp_path / "checkpoint")
    hidden = 96

    def timer(weight, block, names, precision):
        first = weight.shape[1] == hidden  # intermediate.dense: [4 * hidden, hidden]
        times = {DENSE: 1.0, "bsr-f32": 0.8, "bsr-bf16w": 0.7, "bsr-i8w": 0.5, "bsr-vnni": 0.6}
        return {name: times.get(name, 0.9) if first else 1.0 + (name != DENSE) for name in names}

    monkeypatch.setattr(transform, "measured_times", lambda target, linear_passes: timer)
    manifest, _ = compile_artifact(checkpoint, tmp_path / "artifact", ["packed-16"], layout="packed",
                                   precision="int8", attention_products="fp32", sparsity="from-checkpoint",
                                   block="16x1")
    sparsity = manifest.sparsity
    by_weight = {c.weight: c for c in sparsity.choices}
    assert len(by_weight) == 2 * 2  # the FFN's two weights in both layers; the rest is dense
    for name, record in by_weight.items():
        first = "intermediate" in name
        holds = {c.name: c.holds for c in record.candidates}
        assert holds[DENSE] and holds["bsr-f32"]
        if record.precision == "int8":
            assert holds["bsr-i8w"] and record.chosen == ("bsr-i8w" if first else DENSE)
        else:  # kept out of int8 by its plan: no int8 blocks for it either
            assert not holds["bsr-i8w"] and record.chosen in ("bsr-f32", "bsr-bf16w", DENSE)
        assert record.bsr == (record.chosen != DENSE) and record.density == pytest.approx(0.1, abs=0.01)
    assert sparsity.rewritten == sum(c.bsr for c in sparsity.choices) >= 1
    assert manifest.precision.precision == "int8" and manifest.precision.linears >= 1
    assert manifest.validated
    model = load_artifact(tmp_path / "artifact")
    assert least_cosine_to_pytorch(model, checkpoint, [(2, 16), (1, 9)]) >= 0.99
