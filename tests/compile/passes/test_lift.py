"""compile/passes/lift.py: weight-only work (transposes, concatenations) lifted out of `main`, done once."""

from compile.opcount import tracked_counts
from compile.passes.canonicalize import canonicalize
from compile.passes.combine import combine_parallel_matmuls
from compile.passes.lift import lift_and_transform


def test_lift_moves_weight_work_out_of_main(minilm_imported):
    mod = combine_parallel_matmuls()(canonicalize()(minilm_imported.mod))
    lifted = lift_and_transform(mod, minilm_imported.params)
    counts = tracked_counts(lifted.mod)
    assert counts["matmul"] == 36 and counts["concat"] == 0
    assert counts["permute_dims"] == 54 - 6 * 4  # 4 weight transposes per layer now happen once, offline
    assert len(lifted.weights) == len(lifted.weight_names) == len(lifted.mod["main"].params) - 4
    qkv = [w for w in lifted.weights if w.shape == (384, 3 * 384)]
    assert len(qkv) == 6  # one pre-transposed, concatenated Q/K/V weight per layer
