"""The compile cache behind `bert-serve --model-id`: a Hub model compiled once per commit, CPU, config and version.

An entry is ARTIFACT_CACHE/ORG--NAME/COMMIT-KEY/: the artifact `bert-compile` wrote there (through a staging
directory renamed at the end, as its --out always is), then cache-key.json, the whole key, written last, once every
file matched the manifest's sha256. An entry without that file (a compile that died), with another key, or with a
file missing or changed is never loaded: it is compiled again. The key holds what changes the compiled code: the
commit, the x86 features of this CPU (artifact/cpu_features.py: the libraries may use any of them), the compile
config and the project's version. One process compiles an entry while the others wait on its lock file
(COMMIT-KEY.lock, beside it), then load what it wrote.

The compile runs as a child process (`python -m compile`, with TVM's compiler and torch, which the server itself
does not load), its progress in the server's log on stderr, while the server answers /health 200 and /ready 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from importlib import metadata as package_metadata
from pathlib import Path
from typing import AsyncIterator, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from artifact.cpu_features import FEATURES, missing_on_host
from artifact.errors import ArtifactError
from artifact.hashing import file_sha256
from artifact.hub import HubModel, resolve
from artifact.levels import artifact_for_this_cpu
from artifact.manifest import write_json_atomically
from compile.config import CompileConfig, load_config
from compile.errors import CompileError

from .runtime import VERSION
from .settings import Settings

log = logging.getLogger(__name__)
compile_log = logging.getLogger("service.compile")  # bert-compile's output, line by line

DEFAULT_COMPILE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
KEY_FILE = "cache-key.json"
DTYPE_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}  # TEI's --dtype as the compile's --precision
COMPILER_PACKAGES = ("torch", "transformers")  # what compiling needs beyond the server's own dependencies
LOCK_POLL_S = 0.25  # how often a process waiting for another's compile tries the lock
COMPILE_STOP_S = 30.0  # how long a compile may take to clean up after SIGTERM before it is killed


class CacheError(Exception):
    """The compile cache cannot give this model: reported as one line."""


class CacheKey(BaseModel):
    """Everything a compiled entry depends on; an entry is loaded only where all of it is the same."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repo_id: str
    sha: str  # the commit
    cpu_features: list[str] | None  # FEATURES this CPU has (None: its flags cannot be read)
    config_sha256: str  # of the validated compile config
    version: str  # of bert-tvm-serve

    def entry(self, cache: Path) -> Path:
        digest = hashlib.sha256(self.model_dump_json().encode()).hexdigest()
        return cache / self.repo_id.replace("/", "--") / f"{self.sha[:12]}-{digest[:12]}"


def default_artifact_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bert-tvm-serve"


def this_cpu() -> list[str] | None:
    missing = missing_on_host(FEATURES)
    return None if missing is None else [feature for feature in FEATURES if feature not in missing]


def tei_choices(settings: Settings) -> dict[str, str]:
    """TEI's --dtype and --pooling, given with --model-id: what they make the compile build (its `precision`
    and `pooling`), refused here, before anything is downloaded or compiled, where this CPU or a BERT cannot."""
    chosen = {}
    if settings.dtype is not None:
        if settings.dtype not in DTYPE_PRECISIONS:
            raise CacheError(f"--dtype {settings.dtype}: --model-id compiles for this CPU, which computes in float32 or "
                             "bfloat16 (or int8); use --dtype float32 or bfloat16, or leave --dtype out for the fastest "
                             "precision that keeps its accuracy gate")
        if settings.dtype == "bfloat16" and missing_on_host(["avx512bf16"]) != []:
            raise CacheError("--dtype bfloat16: this CPU lacks AVX512_BF16 (bf16 needs it here); use --dtype float32, "
                             "or leave --dtype out")
        chosen["precision"] = DTYPE_PRECISIONS[settings.dtype]
    if settings.pooling is not None:
        if settings.pooling not in ("cls", "mean", "splade"):
            raise CacheError(f"--pooling {settings.pooling}: a BERT-family model pools by cls, mean or splade (a "
                             "masked-LM checkpoint) here; use one of those, or leave --pooling out for the checkpoint's")
        chosen["pooling"] = settings.pooling
    return chosen


def compile_config(path: Path | None, chosen: Mapping[str, str] | None = None) -> tuple[Path, CompileConfig]:
    """The compile config a --model-id compiles with (default: the repository's configs/default.yaml), with
    `chosen` (`tei_choices`) over it."""
    if path is None and not DEFAULT_COMPILE_CONFIG.is_file():
        raise CacheError(f"no compile config: {DEFAULT_COMPILE_CONFIG} is not here; give one with --config")
    path = Path(path or DEFAULT_COMPILE_CONFIG).absolute()
    config = load_config(path, dict(chosen or {}))
    if config.target != "cpu":
        raise CacheError(f"--model-id compiles for this CPU, and {path} is for target {config.target}: compile "
                         "that with bert-compile and serve it with --artifacts")
    return path, config


def config_sha256(config: CompileConfig) -> str:
    return hashlib.sha256(config.model_dump_json(exclude={"model", "out"}).encode()).hexdigest()


def entry_problem(entry: Path, key: CacheKey, *, finished: bool = True) -> str | None:
    """Why `entry` must not be loaded, or None where it may: not there, unfinished (no key file), of another key,
    from another commit, or with a file the manifest lists missing or changed. `finished` False: a compile's output,
    whose key file is still to be written."""
    if not entry.is_dir():
        return "not compiled yet"
    if finished:
        try:
            stored = CacheKey.model_validate_json((entry / KEY_FILE).read_text())
        except FileNotFoundError:
            return f"unfinished (no {KEY_FILE})"
        except ValidationError:
            return f"its {KEY_FILE} is unreadable"
        if stored != key:
            return f"compiled for another key ({KEY_FILE})"
    try:
        directory, manifest = artifact_for_this_cpu(entry)
    except ArtifactError as exc:
        return str(exc)
    if manifest.model.sha != key.sha:
        return f"its manifest names commit {manifest.model.sha}, not {key.sha}"
    for name, sha256 in manifest.hashed_files().items():
        if not (directory / name).is_file():
            return f"{name} is missing"
        if file_sha256(directory / name) != sha256:
            return f"{name} does not match the manifest's sha256"
    if not (directory / manifest.tokenizer / "tokenizer.json").is_file():
        return "its tokenizer is missing"
    return None


def hub_artifact(settings: Settings, environ: Mapping[str, str]) -> tuple[Settings, "CompileJob | None"]:
    """--model-id's cache entry: the settings that serve it (as --artifacts ENTRY --served-name ORG/NAME), and the
    compile to run first where the cache does not hold it yet (None: it does). Before the server listens, so that
    every reason it cannot be had is one line (HubError, CacheError, CompileError). `environ`: the environment the
    server started with, which a compile runs in."""
    model = HubModel(settings.model_id, settings.revision, settings.hf_token, settings.huggingface_hub_cache)
    chosen = tei_choices(settings)
    config_path, config = compile_config(settings.config, chosen)
    snapshot = resolve(model)
    key = CacheKey(repo_id=snapshot.repo_id, sha=snapshot.sha, cpu_features=this_cpu(),
                   config_sha256=config_sha256(config), version=VERSION)
    cache = (settings.artifact_cache or default_artifact_cache()).absolute()
    entry = key.entry(cache)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot write the artifact cache {cache} (--artifact-cache): {exc.strerror or exc}") from None
    names = settings.served_names or [model.repo_id]
    served = settings.model_copy(update={"artifacts": [entry], "served_names": names})
    problem = entry_problem(entry, key)
    if problem is None:
        log.info("%s at commit %s: loading its artifact from the compile cache, %s", model.repo_id, snapshot.sha, entry)
        return served, None
    missing = [name for name in COMPILER_PACKAGES if not _installed(name)]
    if missing:
        raise CacheError(f"{model.repo_id} at commit {snapshot.sha} is not compiled in {cache} for this CPU and "
                         f"config, and compiling needs {' and '.join(missing)} (the project's `compile` extra): "
                         "install them, or give --artifact-cache a cache that holds it")
    return served, CompileJob(key, entry, config_path, replace(model, revision=snapshot.sha), dict(environ), chosen)


def _installed(package: str) -> bool:
    try:
        package_metadata.version(package)
    except package_metadata.PackageNotFoundError:
        return False
    return True


@dataclass
class CompileJob:
    """Compiling one cache entry (service.runtime.PendingArtifact), run by the server in the background."""

    key: CacheKey
    entry: Path
    config: Path
    model: HubModel  # at the commit
    environ: dict[str, str]
    chosen: dict[str, str] = field(default_factory=dict)  # config keys --dtype and --pooling set (`tei_choices`)
    status: str = "about to compile"

    @property
    def what(self) -> str:
        return f"{self.key.repo_id} at commit {self.key.sha[:12]}"

    async def run(self) -> None:
        async with self._locked():
            problem = await asyncio.to_thread(entry_problem, self.entry, self.key)
            if problem is None:
                log.info("%s was compiled by another process meanwhile: loading it from %s", self.what, self.entry)
                return
            self._clear(problem)
            self.status = f"compiling {self.what} for this CPU (progress in the server's log)"
            log.info("compiling %s for this CPU into the compile cache, %s; later starts load it from there",
                     self.what, self.entry)
            returncode = await self._compile()
            if returncode != 0:
                raise CacheError(f"compiling {self.what} failed (bert-compile exited {returncode}; its error is above)")
            written = await asyncio.to_thread(entry_problem, self.entry, self.key, finished=False)
            if written is not None:
                raise CacheError(f"compiling {self.what} wrote an artifact that cannot be loaded: {written}")
            write_json_atomically(self.key, self.entry / KEY_FILE)

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """The entry's lock, waited for without blocking the event loop (nor the server's shutdown)."""
        with open(self.entry.with_name(f"{self.entry.name}.lock"), "a") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.status = f"waiting for another process compiling {self.what} into {self.entry}"
                    await asyncio.sleep(LOCK_POLL_S)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _clear(self, problem: str) -> None:
        """Remove what cannot be loaded: the damaged entry, and the staging directories of compiles that died
        (`compile.staging.atomic_directory`'s; nobody else compiles this entry while the lock is held)."""
        if self.entry.exists():
            log.warning("the compile cache's %s cannot be loaded (%s): compiling it again", self.entry, problem)
            shutil.rmtree(self.entry)
        for stale in self.entry.parent.glob(f".{self.entry.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)

    async def _compile(self) -> int:
        """`python -m compile` into the entry, its progress lines logged as the server's (plain text or JSON, as
        --log-format says). Cancelled (the server stops), it is asked to stop, which removes its staging directory."""
        command = [sys.executable, "-m", "compile", "--config", str(self.config), "--model", self.model.repo_id,
                   "--revision", self.key.sha, "--out", str(self.entry)]
        if self.model.cache_dir is not None:
            command += ["--huggingface-hub-cache", str(self.model.cache_dir)]
        for key, value in self.chosen.items():
            command += [f"--{key}", value]
        environ = {**self.environ, **({"HF_TOKEN": self.model.token} if self.model.token else {})}  # not in argv
        process = await asyncio.create_subprocess_exec(*command, env=environ, stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            async for line in process.stdout:
                compile_log.info("%s", line.decode(errors="replace").rstrip())
            return await process.wait()
        except asyncio.CancelledError:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), COMPILE_STOP_S)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
            raise
