"""Compiled artifacts for tests: compiled with the suite's small bounds, copied with fixed latencies,
and compared with PyTorch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from compile.config import CompileConfig

# The tiny artifact's buckets timed as an idle machine times them: a bigger bucket takes longer.
TINY_LATENCIES = {(1, 8): 1.0, (2, 16): 1.5, (4, 16): 2.0}


def compile_artifact(model: Path, out: Path, buckets: list[str], task: str = "embed", **settings):
    """compile.pipeline.compile_model of `model` into `out` (generic bounds 16 rows; three small
    validation shapes unless `generic_shapes` is given)."""
    from compile.pipeline import compile_model

    config = CompileConfig(model=model, out=out, buckets=buckets, task=task, max_batch=16,
                           generic_shapes=settings.pop("generic_shapes", ["3x5", "2x11", "5x20"]), **settings)
    return compile_model(config)


def with_latencies(artifact: Path, out: Path, latencies: dict[tuple[int, int], float]) -> Path:
    """A copy of a padded `artifact` whose buckets' recorded latencies are `latencies` ((batch, seq)
    -> ms): what routes a batch then depends on the test, not on how busy the machine was when
    the artifact was compiled and timed."""
    shutil.copytree(artifact, out)
    data = json.loads((out / "manifest.json").read_text())
    for bucket in data["buckets"]:
        bucket["latency_ms"] = latencies[bucket["batch"], bucket["seq"]]
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def least_cosine_to_pytorch(model, checkpoint: Path, shapes: list[tuple[int, int]]) -> float:
    """The least cosine of a loaded artifact's embeddings (`model`, artifact.loader) to the PyTorch
    fp32 model of `checkpoint`, over random token rows of each (batch, seq) of `shapes`."""
    import numpy as np
    import torch

    from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper

    wrapper = load_wrapper(inspect_checkpoint(checkpoint, "embed"), "embed")
    least = 1.0
    for batch, seq in shapes:
        inputs = example_inputs(batch, seq, model.manifest.model.vocab_size, seed=batch)
        served = model.run(inputs[0].numpy(), inputs[1].numpy()).output
        with torch.no_grad():
            expected = wrapper(*inputs).numpy()
        cosine = np.sum(served * expected, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(expected, axis=1)
        least = min(least, float(cosine.min()))
    return least
