"""`python -m loadtest.plan_fidelity --artifacts DIR`: how closely an int8 artifact's library loses
what its compile's int8 plan simulated, row by row on the rows the plan measured (the shipped sentences
and random token rows: `accuracy_rows`).

The plan (compile/int8_plan.py) admits linear groups to int8 while its simulation
(compile/int8_simulation.py) keeps the accuracy floor, with `SIMULATION_TOLERANCE` of the simulated
loss to spare (more where the plan's first library showed it needed more: the manifest's
`quantization.plan_margin`). This runs that simulation again with the artifact's choices (its smoothing, the
groups it kept and their precision, attention's products) and the artifact's generic library on the
same rows, and prints each one's loss of cosine to the fp32 model (1 - cosine, in float64): the
ratios are what the tolerance must cover."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from artifact.errors import ArtifactError
from compile.errors import CompileError

from .machine import describe, line

PROG = "python -m loadtest.plan_fidelity"


def _losses(actual: np.ndarray, reference: np.ndarray) -> np.ndarray:
    actual, reference = actual.astype(np.float64), reference.astype(np.float64)
    return 1.0 - (actual * reference).sum(1) / np.linalg.norm(actual, axis=1) / np.linalg.norm(reference, axis=1)


def library_and_simulated_losses(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """Per row the plan measured, (the generic library's loss, its plan's simulated loss) of an int8 embedding
    artifact, both against the fp32 PyTorch model of the checkpoint it was compiled from."""
    import tvm

    from artifact.loader import load_artifact
    from compile.capabilities import Capabilities
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.int8_plan import quantizable_modules
    from compile.int8_simulation import Simulation
    from compile.passes.quantize import accuracy_rows

    model = load_artifact(directory)
    manifest, quantization = model.manifest, model.manifest.quantization
    if quantization is None or manifest.task != "embed" or manifest.target.kind != "cpu":
        raise ArtifactError(f"{directory} is not an int8 CPU embedding artifact: it has no int8 plan to check")
    info = inspect_checkpoint(Path(manifest.model.path), "embed")
    wrapper = load_wrapper(info, "embed")
    kernel = Capabilities.of(tvm.target.Target(manifest.target.tvm_target)).int8_kernel
    imported = export_and_import(wrapper, manifest.generic.max_batch, info.max_seq, manifest.model.vocab_size)
    kept = {unit.unit: unit.precision for unit in quantization.kept}
    attention = manifest.precision.attention
    rows = accuracy_rows(info, "embed")  # the plan's calibration and gate
    simulation = Simulation(wrapper, rows, quantizable_modules(imported.mod, kernel),
                            lambda actual, reference: {"actual": actual},
                            kernel.int16_pairs, next(iter(kept.values()), "fp32"),
                            attention.products if attention else "fp32")
    simulation.calibrate()
    simulated = simulation.accuracy(quantization.smoothing_alpha or 0.0, set(kept))["actual"]
    step = manifest.generic.max_batch
    built = np.concatenate([model.run_generic(*(x[i:i + step] for x in rows[:3])).output
                            for i in range(0, len(rows[0]), step)])
    return _losses(built, simulation.reference), _losses(simulated, simulation.reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        built, simulated = library_and_simulated_losses(args.artifacts)
    except (ArtifactError, CompileError, FileNotFoundError) as exc:  # CompileError: its checkpoint is gone
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    ratios = built / simulated
    print(f"{args.artifacts.name}, {len(built)} rows (shipped sentences, random token rows), "
          "loss = 1 - cosine to the fp32 model\n")
    print("| | library | simulation | library / simulation |\n|---|---|---|---|")
    print(f"| least cosine's loss | {built.max():.4g} | {simulated.max():.4g} | {built.max() / simulated.max():.3f} |")
    print(f"| each row's loss / simulated | | | {ratios.min():.3f}-{ratios.max():.3f} "
          f"(median {np.median(ratios):.3f}) |")
    print(f"\nCPU: {line(describe())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
