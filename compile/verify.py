"""`python -m compile.verify --artifacts DIR`: validate an existing artifact where it will run.

A CUDA artifact compiles on a machine without a GPU, so its libraries cannot be compared with
PyTorch there. This re-runs the compile stage's comparison on this machine's device (PyTorch in
the artifact's dtype, on the same GPU when its torch build has CUDA) for every bucket at its own
shape and for the generic library at the shapes the manifest names; with `--record`, the
differences and the device go into the manifest. Needs only TVM's runtime, so it runs on a serving machine without the compiler.
Exit codes: 0 all within tolerance, 1 a library is over it, 2 the artifact cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifact.errors import ArtifactError

from .config import RELATIVE_TOLERANCES
from .errors import CompileError, ValidationError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m compile.verify", description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True, help="artifact directory")
    parser.add_argument("--record", action="store_true", help="write the differences into manifest.json")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def verify(directory: Path, seed: int = 0, record: bool = False) -> dict[str, dict[str, float]]:
    """Max |tvm - torch| per library and shape; raises ValidationError past the manifest's tolerance."""
    import torch

    from artifact.loader import device_name, load_artifact

    from .bucketing import parse_bucket
    from .checkpoint import inspect_checkpoint, load_wrapper
    from .validate import checked_diff

    model = load_artifact(directory)
    manifest = model.manifest
    if manifest.sparsity is not None and manifest.sparsity.mode == "pruned":
        raise ArtifactError("pruned artifacts are validated at compile time only (the oracle needs the pruning)")
    if model.refused:
        raise ArtifactError(f"libraries failed verification: {model.refused}")
    pooling = manifest.pooling if manifest.task == "embed" else "auto"
    info = inspect_checkpoint(Path(manifest.model.path), manifest.task, pooling)
    # PyTorch on the same GPU where it can (a CPU build of torch, as in the Docker image, cannot).
    torch_device = "cuda" if manifest.target.kind == "cuda" and torch.cuda.is_available() else "cpu"
    wrapper = load_wrapper(info, manifest.task, manifest.dtype).to(torch_device)
    vocab, tolerance = manifest.model.vocab_size, manifest.tolerance
    relative = manifest.linear_precision in RELATIVE_TOLERANCES  # held to a row-relative error
    diffs: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for index, entry in enumerate(manifest.buckets):
            bucket = entry.bucket
            diff = checked_diff(f"bucket {bucket.name}", model.runners[bucket], wrapper, bucket, vocab,
                                seed + index, tolerance, manifest.layout, relative)
            diffs[f"bucket_{bucket.name}"] = {bucket.name: diff}
            entry.max_abs_diff = diff
        generic = {}
        for index, shape_name in enumerate(manifest.generic.max_abs_diff, len(manifest.buckets)):
            generic[shape_name] = checked_diff("generic", model.generic, wrapper, parse_bucket(shape_name), vocab,
                                               seed + index, tolerance, manifest.layout, relative)
        diffs["generic"] = generic
    if record:
        manifest.generic.max_abs_diff = generic
        manifest.validated = True
        manifest.validated_on = device_name(model.device)
        manifest.write(model.directory)  # of a multi-level artifact, the level this CPU ran
    return diffs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        diffs = verify(args.artifacts, args.seed, args.record)
    except ValidationError as exc:
        print(f"verify: FAILED: {exc}", file=sys.stderr)
        return 1
    except (ArtifactError, CompileError) as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    for library, shapes in diffs.items():
        print(f"{library}: " + ", ".join(f"{shape} {diff:.2e}" for shape, diff in shapes.items()))
    print(f"verify: every library of {args.artifacts} is within tolerance"
          + ("; recorded in manifest.json" if args.record else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
