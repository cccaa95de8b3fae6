"""Combining strategies: the batched pass, per-strategy numerics, and `auto` choosing by time."""

import numpy as np
import pytest
import tvm
from tvm import relax

from artifact.bucketing import Bucket
from artifact.loader import LibraryRunner, load_artifact, load_weights
from artifact.manifest import Manifest
from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper
from compile.opcount import count_ops, tracked_counts
from compile.passes.canonicalize import canonicalize
from compile.passes.combine import combine_parallel_matmuls
from compile.passes.combine_batched import batch_parallel_linears
from compile.passes.lift import lift_and_transform
from compile.passes.strategy import STRATEGIES, apply_strategy
from compile.phases.libraries import Candidates, choose_strategies
from compile.phases.transform import save_weights
from compile.validate import library_diff
from tests.support.artifacts import compile_artifact
from tests.support.relax_modules import BiasFirstQKV, UnequalWidths
from tests.support.tvm_run import build_reference, run

pytestmark = pytest.mark.slow  # collected first: see conftest.py



def _random_args(mod):
    rng = np.random.default_rng(0)
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]


def test_batched_pass_makes_one_batch_matmul_and_is_exact():
    result = batch_parallel_linears(canonicalize()(BiasFirstQKV))
    assert (result.combined_groups, result.refused_groups) == (1, 0)
    counts = count_ops(result.mod)
    assert counts["relax.matmul"] == 1 and counts["relax.stack"] == 2 and counts["relax.split"] == 1
    (matmul,) = [b.value for blk in result.mod["main"].body.blocks for b in blk.bindings
                 if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul"]
    assert [int(d) for d in matmul.ty.shape] == [3, 8, 8]  # [branches, M, N]
    args = _random_args(BiasFirstQKV)
    for expected, actual in zip(run(build_reference(BiasFirstQKV), *args), run(build_reference(result.mod), *args)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_batched_pass_refuses_unequal_widths_that_concat_takes():
    batched = batch_parallel_linears(UnequalWidths)
    assert (batched.combined_groups, batched.refused_groups) == (0, 1)
    assert tracked_counts(batched.mod)["matmul"] == 2
    concat = combine_parallel_matmuls()(UnequalWidths)
    assert tracked_counts(concat)["matmul"] == 1
    args = _random_args(UnequalWidths)
    for expected, actual in zip(run(build_reference(UnequalWidths), *args), run(build_reference(concat), *args)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_batched_pass_on_minilm_combines_every_layer(minilm_imported):
    result = batch_parallel_linears(canonicalize()(minilm_imported.mod))
    assert (result.combined_groups, result.refused_groups) == (6, 0)
    assert tracked_counts(result.mod)["matmul"] == 36


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_matches_pytorch_on_minilm(minilm_imported, minilm_dir, tmp_path, strategy):
    lifted = lift_and_transform(apply_strategy(minilm_imported.mod, strategy), minilm_imported.params)
    expected_matmuls = {"concat": 36, "batched": 36, "off": 48}[strategy]
    assert tracked_counts(lifted.mod)["matmul"] == expected_matmuls
    library = tmp_path / "generic.so"
    build_reference(lifted.mod).export_library(str(library))
    # Through the artifact's weight file: lifted names repeat (batched has two "lv73"), which
    # once made the saved file silently lose a tensor.
    entry = save_weights(tmp_path, strategy, lifted)
    runner = LibraryRunner(library, tvm.cpu(), load_weights(tmp_path / entry.file, entry.names, tvm.cpu()))
    wrapper = load_wrapper(inspect_checkpoint(minilm_dir, "embed"), "embed")
    assert library_diff(runner, wrapper, Bucket.of(2, 9), 30522, seed=3)[0] <= 1e-4


@pytest.mark.parametrize("strategy", ["batched", "off"])
def test_each_strategy_compiles_and_validates_a_tiny_bert(tiny_bert_dir, tmp_path, strategy):
    manifest, _ = compile_artifact(tiny_bert_dir, tmp_path / strategy, ["2x8"], strategy=strategy)
    assert manifest.validated and manifest.buckets[0].max_abs_diff <= 1e-4
    assert manifest.buckets[0].strategy == manifest.generic.strategy == strategy
    assert manifest.buckets[0].strategy_ms is None  # a fixed strategy records only its name
    assert list(manifest.weights) == [strategy]


@pytest.fixture(scope="module")
def auto_artifact(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("auto") / "artifact"
    compile_artifact(tiny_bert_dir, out, ["1x8", "4x16"], strategy="auto", strategy_repeats=3)
    return out


def test_auto_times_three_strategies_and_shares_one_unless_another_gains_the_margin(auto_artifact):
    out = auto_artifact
    manifest = Manifest.read(out)
    entries = [*manifest.buckets, manifest.generic]
    shared, margin = manifest.strategy_choice.shared, manifest.strategy_choice.margin
    assert shared == min(STRATEGIES, key=lambda s: sum(e.strategy_ms[s] for e in entries))
    for entry in entries:
        assert set(entry.strategy_ms) == set(STRATEGIES)
        fastest = min(entry.strategy_ms, key=entry.strategy_ms.get)
        gains = entry.strategy_ms[shared] > entry.strategy_ms[fastest] * (1 + margin)
        assert entry.strategy == (fastest if gains else shared)
    assert set(manifest.weights) == {e.strategy for e in entries}
    assert sorted(p.name for p in (out / "lib").iterdir()) == ["bucket_1x8.so", "bucket_4x16.so", "generic.so"]


def _candidates(name, **strategy_ms):
    return Candidates(name, {s: f"lib/{name}.{s}.so" for s in strategy_ms}, [], [], [], strategy_ms=strategy_ms)


def test_a_library_leaves_the_shared_weight_set_only_for_more_than_the_margin():
    pending = [_candidates("a", concat=10.0, off=12.0), _candidates("b", concat=20.0, off=19.0),
               _candidates("c", concat=30.0, off=31.0)]
    chosen, shared = choose_strategies(pending, margin=0.05)
    assert shared == "concat"  # 60 ms in all against 62
    assert chosen == {"a": "concat", "b": "off", "c": "concat"}  # b: 20 > 19 x 1.05
    assert choose_strategies(pending, margin=0.1)[0] == {"a": "concat", "b": "concat", "c": "concat"}
    untimed = [Candidates("d", {"concat": "lib/d.so"}, [], [], [])]
    assert choose_strategies(untimed, margin=0.05) == ({"d": "concat"}, "concat")



def test_every_library_of_an_auto_artifact_matches_pytorch_as_loaded(auto_artifact, tiny_bert_dir, tmp_path):
    """Each library, with the weight set of the strategy it chose, read back from disk (the buckets'
    latencies as an idle machine measures them, so that each shape goes where the test says)."""
    from tests.support.artifacts import with_latencies

    model = load_artifact(with_latencies(auto_artifact, tmp_path / "timed", {(1, 8): 1.0, (4, 16): 2.0}))
    wrapper = load_wrapper(inspect_checkpoint(tiny_bert_dir, "embed"), "embed")
    for shape, path in [((1, 6), "bucket-1x8"), ((3, 12), "bucket-4x16"), ((2, 30), "generic")]:
        inputs = example_inputs(*shape, 30522, seed=2)
        result = model.run(inputs[0].numpy(), inputs[1].numpy())
        assert result.path == path
        expected = wrapper(*inputs).detach().numpy()
        np.testing.assert_allclose(result.output, expected, atol=1e-4, rtol=0)


def test_strategy_table_lists_every_library(auto_artifact):
    from loadtest.strategy_table import markdown_table

    table = markdown_table(Manifest.read(auto_artifact)).splitlines()
    assert table[0] == "| library | concat ms | batched ms | off ms | chosen |"
    assert table[2].startswith("| bucket 1x8 |") and table[4].startswith("| generic (timed at 3x5) |")
    assert all(row.rstrip(" |").split("| ")[-1] in STRATEGIES for row in table[2:])
