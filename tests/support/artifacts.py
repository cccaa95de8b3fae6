"""Compiled artifacts for tests: compiled with the suite's small bounds, copied with fixed latencies,
and compared with PyTorch."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable

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


def shared_directory(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """`name` made once per test run by `make(path)` and shared by every worker of the run (pytest-xdist
    runs workers as processes, each with its own session fixtures): the first worker to ask makes it
    under a file lock, the others wait and reuse it. A directory left by a failed `make` is made again."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if path.exists():
                shutil.rmtree(path)
            make(path)
            done.touch()
    return path


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
