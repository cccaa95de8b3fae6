"""PassRecorder: the instrument a compile's pass sequence runs under records the sequence's own passes
(not the passes they run inside) and the tracked op counts before and after each."""

import tvm
from test_passes import BiasFirstQKV
from tvm import relax

from compile.opcount import PassRecorder, tracked_counts
from compile.passes.strategy import strategy_passes


def test_the_recorder_sees_the_sequences_passes_and_their_counts():
    passes = [*strategy_passes("concat"), relax.transform.LiftTransformParams()]
    recorder = PassRecorder()
    with tvm.transform.PassContext(instruments=[recorder]):
        lifted = tvm.transform.Sequential(passes, name="compile_concat")(BiasFirstQKV)
    # CanonicalizeForCombine is itself a sequence of three passes: recorded once, by its name
    assert recorder.names() == ["CanonicalizeForCombine", "CombineParallelMatmul", "ReorderPermuteDimsAfterConcat",
                                "CanonicalizeBindings", "LiftTransformParams"]
    assert recorder.before == tracked_counts(BiasFirstQKV) == {"matmul": 3, "concat": 0, "permute_dims": 3}
    assert dict(recorder.after)["CombineParallelMatmul"]["matmul"] == 1
    assert recorder.after[-1][1] == tracked_counts(lifted)
