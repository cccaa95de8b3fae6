"""Artifacts for several x86 CPU levels: one directory that loads on any of them, fastest code first.

`bert-compile --mcpu x86-64-v3,x86-64-v4` compiles the whole artifact once per LLVM CPU into a
subdirectory named after it (weights included: the panels the kernels stream are as wide as the
level's vectors) and lists the levels in `levels.json`, the most demanding first. Every reader of
an artifact directory goes through `resolve`, which returns the artifact to use on this CPU: the
directory itself for a single-level artifact, else the first level whose CPU features it has all
of. A CPU that has none of them is refused with one line naming what it lacks.
`artifact_for_this_cpu` adds the manifest and, for a reader that runs the compiled code, the
check that this CPU has every feature that code may use: the one way readers open an artifact.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .cpu_features import host_flags, missing_on_host
from .errors import ArtifactError
from .manifest import Manifest, TargetEntry, write_json_atomically

LEVELS_FILE = "levels.json"
SCHEMA_VERSION = 1

log = logging.getLogger(__name__)


class Level(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mcpu: str
    directory: str  # the level's artifact, relative to the multi-level directory
    cpu_features: list[str]  # what its code may use (its manifest's target.cpu_features)


class LevelIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    levels: list[Level]  # the most demanding first: the first one this CPU can run is the fastest

    def write(self, directory: Path) -> None:
        write_json_atomically(self, Path(directory) / LEVELS_FILE)

    @classmethod
    def read(cls, directory: Path) -> "LevelIndex":
        path = Path(directory) / LEVELS_FILE
        try:
            index = cls.model_validate(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ArtifactError(f"{path} is not a valid level index: {where}: {error['msg']}") from None
        if index.schema_version != SCHEMA_VERSION or not index.levels:
            raise ArtifactError(f"{path} lists no levels this build reads (schema_version {index.schema_version})")
        for level in index.levels:
            if Path(level.directory).name != level.directory or level.directory in ("", ".", ".."):
                raise ArtifactError(f"{path}: level {level.mcpu}'s directory {level.directory!r} is not a subdirectory name")
        return index


def is_multi_level(directory: Path) -> bool:
    return (Path(directory) / LEVELS_FILE).is_file()


def resolve(directory: Path | str, flags: set[str] | None = None) -> Path:
    """The artifact directory to load on this CPU (`flags`: its /proc/cpuinfo flags, default read
    here): `directory` itself, or the first of its levels whose features this CPU has. Where the
    flags cannot be read, the least demanding level, with a warning."""
    directory = Path(directory)
    if not is_multi_level(directory):
        return directory
    levels = LevelIndex.read(directory).levels
    flags = host_flags() if flags is None else flags
    if flags is None:
        least = levels[-1]
        log.warning("cannot read this CPU's features; loading %s's least demanding level, %s", directory, least.mcpu)
        return directory / least.directory
    for level in levels:
        if not missing_on_host(level.cpu_features, flags):
            return directory / level.directory
    least = levels[-1]
    raise ArtifactError(
        f"{directory} holds libraries for {', '.join(level.mcpu for level in levels)}; this CPU lacks "
        f"{', '.join(missing_on_host(least.cpu_features, flags))} even for {least.mcpu}: recompile it here"
    )


def check_cpu_features(directory: Path, target: TargetEntry) -> None:
    """Refuse (ArtifactError) an artifact whose CPU code needs features this CPU lacks: loading and
    running it would die with SIGILL. Where this CPU's features cannot be read, warn and go on."""
    if not target.cpu_features:
        return  # an older manifest, or code for no x86 CPU
    missing = missing_on_host(target.cpu_features)
    if missing is None:
        log.warning("cannot read this CPU's features (no /proc/cpuinfo flags); not checking that it has %s, "
                    "which %s was compiled for (%s)", ", ".join(target.cpu_features), directory, target.mcpu)
    elif missing:
        raise ArtifactError(
            f"{directory} was compiled for {target.mcpu} and needs CPU features {', '.join(missing)} this CPU "
            "lacks; recompile it here (bert-compile without --mcpu)"
        )


def artifact_for_this_cpu(directory: Path | str, *, runs_code: bool = True) -> tuple[Path, Manifest]:
    """The artifact directory to load on this CPU (`resolve`) and its manifest; with `runs_code`,
    refused (ArtifactError) where its code needs CPU features this CPU lacks. A reader of the
    checkpoint or tokenizer only (the PyTorch backend) passes False."""
    directory = resolve(directory)
    manifest = Manifest.read(directory)
    if runs_code:
        check_cpu_features(directory, manifest.target)
    return directory, manifest
