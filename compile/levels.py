"""One artifact for several x86 CPU levels (artifact/levels.py): the whole compile once per LLVM CPU."""

from __future__ import annotations

from artifact.levels import Level, LevelIndex
from artifact.manifest import Manifest

from .build import check_mcpu
from .config import CompileConfig
from .phases.libraries import BuildRecord
from .pipeline import compile_model
from .progress import Progress
from .staging import atomic_directory


def compile_levels(config: CompileConfig, progress: Progress | None = None) -> list[tuple[Manifest, list[BuildRecord]]]:
    """Compile `config` once per CPU of `config.cpu_levels` into `config.out`/CPU, and the index the
    loader chooses from (more CPU features first), atomically: every level or none. Levels this
    machine cannot run are built, not validated or timed (as any cross-compile)."""
    for mcpu in config.cpu_levels:
        check_mcpu(mcpu)  # a misspelt last name fails now, not after the first levels' compiles
    results = []
    with atomic_directory(config.out) as staging:
        for mcpu in config.cpu_levels:
            level = config.model_copy(update={"mcpu": mcpu, "out": staging / mcpu})
            results.append(compile_model(level, progress.for_level(mcpu) if progress is not None else None))
        manifests = sorted((manifest for manifest, _ in results), key=lambda m: len(m.target.cpu_features), reverse=True)
        LevelIndex(levels=[Level(mcpu=m.target.mcpu, directory=m.target.mcpu, cpu_features=m.target.cpu_features)
                           for m in manifests]).write(staging)
    return results
