"""compile/passes/combine.py: CombineParallelMatmul on the importer's Q/K/V shape (after canonicalisation)
and on the real MiniLM graph: op counts and numerics."""

import re

from compile.opcount import count_ops, tracked_counts
from compile.passes.canonicalize import canonicalize
from compile.passes.combine import combine_parallel_matmuls
from tests.support.relax_modules import BiasFirstQKV, calls_of
from tests.support.tvm_run import build_reference, run


def test_combine_does_nothing_without_canonicalisation():
    combined = combine_parallel_matmuls()(BiasFirstQKV)
    assert tracked_counts(combined)["matmul"] == 3
    assert tracked_counts(combined)["concat"] == 0


def test_canonicalisation_lets_combine_fire():
    canonical = canonicalize()(BiasFirstQKV)
    assert count_ops(canonical)["relax.reshape"] == 1  # the three branch reshapes became one
    combined = combine_parallel_matmuls()(canonical)
    counts = tracked_counts(combined)
    assert counts["matmul"] == 1
    assert counts["concat"] == 2  # weights and biases
    assert counts["permute_dims"] == 1  # reordered after the concat: one linear-layer pattern


def test_passes_are_numerically_neutral():
    import numpy as np

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(p.ty.shape and [int(d) for d in p.ty.shape]).astype("float32")
            for p in BiasFirstQKV["main"].params]
    expected = run(build_reference(BiasFirstQKV), *args)
    actual = run(build_reference(combine_parallel_matmuls()(canonicalize()(BiasFirstQKV))), *args)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_minilm_import_has_48_matmuls(minilm_imported):
    assert tracked_counts(minilm_imported.mod) == {"matmul": 48, "concat": 0, "permute_dims": 66}


def _layer(names):
    return int(re.search(r"layer_(\d+)_", names[0]).group(1))


def test_minilm_pipeline_combines_qkv_of_every_layer(minilm_imported):
    mod = combine_parallel_matmuls()(canonicalize()(minilm_imported.mod))
    assert tracked_counts(mod) == {"matmul": 36, "concat": 12, "permute_dims": 54}
    groups = []
    for concat in calls_of(mod, "relax.concat"):
        names = [v.name for v in concat.args[0].fields]
        groups.append(names)
    weight_groups = {_layer(names): names for names in groups if names[0].endswith("_weight")}
    bias_groups = {_layer(names): names for names in groups if names[0].endswith("_bias")}
    assert sorted(weight_groups) == sorted(bias_groups) == list(range(6))
    for names in [*weight_groups.values(), *bias_groups.values()]:
        assert [re.search(r"self_(query|key|value)", n).group(1) for n in names] == ["query", "key", "value"]
