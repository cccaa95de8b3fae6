"""A model by its Hub name: `bert-serve --model-id` and `bert-compile --model ORG/NAME`, with the real huggingface_hub
client against a stand-in for the Hub on 127.0.0.1 (tests/support/hub_stand_in.py) that serves the bundled MiniLM as
acme/minilm at two commits (main and the tag v1, beside ONNX, TensorFlow and duplicate PyTorch weights that must not be
fetched), a private copy, a GPT-2 and a repository without weights.

The first start compiles into the compile cache, later ones load from it (also offline and with the Hub unreachable),
two first starts at once compile once, a damaged entry is compiled again, and every way a model cannot be had is one
line and exit 2. Orderings are held by the stand-in (a file's download waits for the test), never by sleeps; the
test compile is small (fp32, one packed bound, not validated: the test compares the served embeddings with
sentence-transformers itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from artifact.hub import CHECKPOINT_FILES, is_repo_id
from artifact.manifest import MODEL_TYPES, Manifest, ModelEntry
from compile.config import default_model_dir
from loadtest.servers import REPO, free_port, wait_until
from service.settings import Settings
from tests.support.hub_stand_in import TOKEN, HubStandIn, Repo, checkpoint_files, commit_sha

pytestmark = pytest.mark.slow  # collected first: see conftest.py

MAIN, V1 = commit_sha("main"), commit_sha("v1")
NOT_FETCHED = {"onnx/model.onnx": b"onnx", "openvino/openvino_model.xml": b"<xml/>", "tf_model.h5": b"h5",
               "flax_model.msgpack": b"flax", "pytorch_model.bin": b"a second copy of the weights"}
TEST_COMPILE = """
task: embed
target: cpu
layout: packed
buckets: ["packed-16"]
max_batch: 16
precision: fp32
strategy: concat
validate: false
"""
SENTENCES = ["The striker scored twice and the team won the final.", "Heavy rain is expected across the region."]
COMPILING = "msg=[compile "  # bert-compile's progress lines, in the server's log


@pytest.fixture(scope="module")
def hub():
    minilm = checkpoint_files(default_model_dir())
    bert_config = json.loads(minilm["config.json"])
    gpt2 = {"config.json": json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).encode(),
            "model.safetensors": b"weights"}
    nomic = {"config.json": json.dumps({"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "auto_map": {
        "AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"}}).encode(),
        "model.safetensors": b"weights"}
    repos = {
        "acme/minilm": Repo({V1: {**minilm, **NOT_FETCHED}, MAIN: {**minilm, **NOT_FETCHED, "README.md": b"v2"}},
                            {"main": MAIN, "v1": V1}),
        "acme/private-minilm": Repo({V1: minilm}, {"main": V1}, private=True),
        "acme/gpt2": Repo({V1: gpt2}, {"main": V1}),
        "acme/nomic": Repo({V1: nomic}, {"main": V1}),
        "acme/no-weights": Repo({V1: {"config.json": json.dumps(bert_config).encode(),
                                      "tokenizer.json": minilm["tokenizer.json"]}}, {"main": V1}),
    }
    with HubStandIn(repos) as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def compile_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.yaml"
    path.write_text(TEST_COMPILE)
    return path


def hub_env(hub_home: Path, endpoint: str, **more: str) -> dict[str, str]:
    """The Hub's variables for a server or compile: its own cache, no token, online unless told."""
    return {"HF_HOME": str(hub_home), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "", **more}


@pytest.fixture(scope="module")
def expected():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_dir()), device="cpu").encode(SENTENCES, normalize_embeddings=True)


def assert_serves_minilm(url: str, expected) -> None:
    response = httpx.post(f"{url}/embed", json={"inputs": SENTENCES}, timeout=60)
    assert response.status_code == 200, response.text
    got = np.asarray(response.json())
    assert ((got * expected).sum(1) / np.linalg.norm(got, axis=1)).min() >= 0.9999


@contextlib.contextmanager
def started(args: list[str], env: dict[str, str], log: Path):
    """`python -m service ARGS` on a free port, not waited for: yields (process, url); stopped on exit."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *args],
                                   stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **env})
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def answer(url: str, path: str) -> httpx.Response | None:
    """The server's answer on `path`, None while it does not listen yet."""
    try:
        return httpx.get(f"{url}{path}", timeout=10)
    except httpx.TransportError:
        return None


def wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    def ready() -> bool:
        assert process.poll() is None, log.read_text()[-4000:]
        response = answer(url, "/ready")
        return response is not None and response.status_code == 200

    wait_until(ready, timeout=1200, what="/ready 200")


def model_args(cache: Path, config: Path, model: str = "acme/minilm", *more: str) -> list[str]:
    """The server's arguments; its log at info, where the compile's progress lines are."""
    return ["--model-id", model, "--config", str(config), "--artifact-cache", str(cache), "--log-level", "info", *more]


def only_entry(cache: Path) -> Path:
    entries = [path for path in (cache / "acme--minilm").iterdir() if path.is_dir()]
    assert len(entries) == 1, entries
    return entries[0]


@pytest.fixture(scope="module")
def first_start(hub, compile_config, expected, tmp_path_factory):
    """The first `bert-serve --model-id acme/minilm`, its weights' download held until the test has seen the server
    answer /health and /ready while the compile is under way; then released, compiled and served."""
    root = tmp_path_factory.mktemp("first-start")
    cache, hub_home, log = root / "artifacts", root / "hub", root / "server.log"
    gate = hub.hold("model.safetensors")
    try:
        with started(model_args(cache, compile_config), hub_env(hub_home, hub.url), log) as (process, url):
            assert gate.arrived.wait(300), log.read_text()
            wait_until(lambda: answer(url, "/health") is not None, timeout=300, what="listening")
            while_compiling = {path: answer(url, path) for path in ("/health", "/ready", "/info")}
            gate.release()
            wait_ready(process, url, log)
            assert_serves_minilm(url, expected)
            info = httpx.get(f"{url}/info").json()
    finally:
        gate.release()
        hub.gates.clear()
    return SimpleNamespace(cache=cache, hub_home=hub_home, log=log.read_text(), while_compiling=while_compiling,
                           info=info, entry=only_entry(cache))


def test_first_start_compiles_while_health_says_200_and_ready_503(first_start):
    health, ready, info = (first_start.while_compiling[path] for path in ("/health", "/ready", "/info"))
    assert health.status_code == 200
    assert ready.status_code == 503 and "compiling acme/minilm" in ready.json()["error"], ready.text
    assert info.status_code == 503
    assert COMPILING in first_start.log and "Traceback" not in first_start.log


def test_first_start_serves_the_commit_it_compiled(first_start, hub):
    assert first_start.info["model_id"] == "acme/minilm" and first_start.info["model_sha"] == MAIN
    manifest = Manifest.read(first_start.entry)
    assert (manifest.model.repo_id, manifest.model.sha) == ("acme/minilm", MAIN)
    snapshot = first_start.hub_home / "hub" / "models--acme--minilm" / "snapshots" / MAIN
    assert not any((snapshot / name).exists() for name in NOT_FETCHED)
    assert not set(hub.fetched("acme/minilm")) & set(NOT_FETCHED)
    assert (snapshot / "1_Pooling" / "config.json").is_file() and (snapshot / "model.safetensors").is_file()


def test_second_start_loads_from_the_cache_without_compiling(first_start, hub, compile_config, serve, expected):
    key = first_start.entry / "cache-key.json"
    written = key.stat().st_mtime_ns, (first_start.entry / "manifest.json").stat().st_mtime_ns
    env = hub_env(first_start.hub_home, hub.url)
    with serve([], *model_args(first_start.cache, compile_config), env=env) as server:
        assert_serves_minilm(server.url, expected)
        assert httpx.get(f"{server.url}/info").json()["model_sha"] == MAIN
    assert COMPILING not in server.log.read_text()
    assert (key.stat().st_mtime_ns, (first_start.entry / "manifest.json").stat().st_mtime_ns) == written
    assert only_entry(first_start.cache) == first_start.entry


@pytest.mark.parametrize("offline", ["1", "0"], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_restart_without_the_hub_loads_from_the_cache(first_start, compile_config, serve, expected, offline):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = hub_env(first_start.hub_home, unreachable, HF_HUB_OFFLINE=offline)
    with serve([], *model_args(first_start.cache, compile_config), env=env) as server:
        assert_serves_minilm(server.url, expected)
        assert httpx.get(f"{server.url}/info").json()["model_sha"] == MAIN
    assert COMPILING not in server.log.read_text()


def test_two_first_starts_at_once_compile_once(hub, compile_config, expected, tmp_path):
    """The second server starts while the first compiles (its download held): it waits for the first's compile
    (/ready says so) and loads what it wrote."""
    cache, env = tmp_path / "artifacts", hub_env(tmp_path / "hub", hub.url)
    args = model_args(cache, compile_config, "acme/minilm", "--revision", "v1")
    gate = hub.hold("model.safetensors")
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    try:
        with started(args, env, logs[0]) as (first, first_url):
            assert gate.arrived.wait(300), logs[0].read_text()
            with started(args, env, logs[1]) as (second, second_url):
                def second_waits() -> bool:
                    assert second.poll() is None, logs[1].read_text()
                    ready = answer(second_url, "/ready")
                    return ready is not None and "waiting for another process" in ready.json()["error"]

                wait_until(second_waits, timeout=300, what="the second server waiting for the first's compile")
                gate.release()
                for process, url, log in ((first, first_url, logs[0]), (second, second_url, logs[1])):
                    wait_ready(process, url, log)
                    assert_serves_minilm(url, expected)
                    assert httpx.get(f"{url}/info").json()["model_sha"] == V1
    finally:
        gate.release()
        hub.gates.clear()
    assert [COMPILING in log.read_text() for log in logs] == [True, False]
    entry = only_entry(cache)
    assert sorted(path.name for path in entry.parent.iterdir()) == sorted([entry.name, f"{entry.name}.lock"])


def test_a_damaged_entry_is_compiled_again(first_start, hub, compile_config, serve, expected, tmp_path):
    cache = tmp_path / "artifacts"
    shutil.copytree(first_start.cache, cache)
    entry = cache / first_start.entry.relative_to(first_start.cache)
    weights = next(entry.glob("weights*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # a disk that filled up
    stale = entry.parent / f".{entry.name}.staging-died"  # what a compile killed with SIGKILL leaves
    stale.mkdir()
    with serve([], *model_args(cache, compile_config), env=hub_env(first_start.hub_home, hub.url),
               timeout=1200) as server:
        assert_serves_minilm(server.url, expected)
    log = server.log.read_text()
    assert "cannot be loaded" in log and weights.name in log and COMPILING in log
    assert not stale.exists() and only_entry(cache) == entry


def damaged_copies(first_start, tmp_path):
    """What makes an entry unloadable, each applied to a copy of the compiled one."""
    def without(name):
        return lambda entry: (entry / name).unlink()

    def rewritten(change):
        def apply(entry):
            key = json.loads((entry / "cache-key.json").read_text())
            (entry / "cache-key.json").write_text(json.dumps({**key, **change}))
        return apply

    def flipped(entry):
        library = next((entry / "lib").iterdir())
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))

    return {"unfinished (no cache-key.json)": without("cache-key.json"),
            "not an artifact directory": without("manifest.json"),
            "another key": rewritten({"version": "0.0.1"}),
            "does not match the manifest's sha256": flipped,
            "its tokenizer is missing": lambda entry: shutil.rmtree(entry / "tokenizer")}


def test_entry_problem_names_what_makes_an_entry_unloadable(first_start, tmp_path):
    from service.model_cache import CacheKey, entry_problem

    key = CacheKey.model_validate_json((first_start.entry / "cache-key.json").read_text())
    assert entry_problem(first_start.entry, key) is None
    assert entry_problem(tmp_path / "absent", key) == "not compiled yet"
    for expected_problem, damage in damaged_copies(first_start, tmp_path).items():
        copy = tmp_path / expected_problem.replace(" ", "-")
        shutil.copytree(first_start.entry, copy)
        damage(copy)
        assert expected_problem in entry_problem(copy, key)
    other_cpu = key.model_copy(update={"cpu_features": ["avx2"]})
    assert other_cpu.entry(first_start.cache) != first_start.entry
    assert "another key" in entry_problem(first_start.entry, other_cpu)


def one_line_error(command: list[str], env: dict[str, str]) -> str:
    """Run a command that must refuse in one line with exit 2 and no traceback: that line."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **env})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("model, more, offline, message", [
    ("acme/missing", [], "0", "no model acme/missing on {hub}"),
    ("acme/private-minilm", [], "0", "is private or gated on {hub} (or does not exist): give a token"),
    ("acme/private-minilm", ["--hf-token", "hf_wrong"], "0", "{hub} refused the token given (--hf-token or HF_TOKEN)"),
    ("acme/gpt2", [], "0", "acme/gpt2 is a gpt2 model (GPT2LMHeadModel); only the BERT family compiles here: "
                           + ", ".join(MODEL_TYPES)),
    ("acme/nomic", [], "0", "acme/nomic needs trust_remote_code: its config.json maps model_type 'nomic_bert' to code "
                            "of its own (NomicBertConfig, NomicBertModel), which is not compiled; supported: "
                            + ", ".join(MODEL_TYPES) + ", as transformers implements them"),
    ("acme/no-weights", [], "0", f"acme/no-weights has no model.safetensors or pytorch_model.bin at commit {V1}"),
    ("acme/minilm", ["--revision", "v9"], "0", "acme/minilm has no revision 'v9' on {hub}"),
    ("acme/minilm", [], "1", "HF_HUB_OFFLINE is set and acme/minilm is not in the Hub cache"),
    ("acme/minilm", [], "unreachable", "cannot reach {hub} (ConnectError) and acme/minilm is not in the Hub cache"),
], ids=["404", "401-no-token", "401-wrong-token", "not-bert", "remote-code", "no-weights", "no-revision", "offline-not-cached",
        "no-network-not-cached"])
def test_a_model_that_cannot_be_had_is_one_line_and_exit_2(hub, compile_config, tmp_path, model, more, offline,
                                                           message):
    endpoint = f"http://127.0.0.1:{free_port()}" if offline == "unreachable" else hub.url  # nothing listens there
    env = hub_env(tmp_path / "hub", endpoint, HF_HUB_OFFLINE="1" if offline == "1" else "0")
    line = one_line_error([sys.executable, "-m", "service", *model_args(tmp_path / "artifacts", compile_config, model),
                           *more], env)
    assert line.startswith("bert-serve: error: ") and message.format(hub=endpoint) in line, line


def test_bert_compile_refuses_a_missing_hub_model_in_one_line(hub, tmp_path):
    line = one_line_error([sys.executable, "-m", "compile", "--model", "acme/missing", "--out", str(tmp_path / "out")],
                          hub_env(tmp_path / "hub", hub.url))
    assert line == f"bert-compile: error: no model acme/missing on {hub.url} (nor a directory of that name here)"


def test_a_token_reads_a_private_model(hub, tmp_path):
    code = ("from artifact.hub import HubModel, resolve; import sys; "
            "print(resolve(HubModel('acme/private-minilm', token=sys.argv[1])).sha)")
    result = subprocess.run([sys.executable, "-c", code, TOKEN], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, **hub_env(tmp_path / "hub", hub.url)})
    assert result.returncode == 0 and result.stdout.strip() == V1, result.stderr


def test_the_manifest_records_a_hub_checkpoints_repository_and_commit(tmp_path):
    fields = {"weights_sha256": "0" * 64, "architecture": "BertModel", "hidden_size": 384,
              "max_position_embeddings": 512, "vocab_size": 30522, "pad_token_id": 0}
    from_hub = ModelEntry(path=f"/cache/hub/models--BAAI--bge-small-en-v1.5/snapshots/{MAIN}", **fields)
    assert (from_hub.repo_id, from_hub.sha) == ("BAAI/bge-small-en-v1.5", MAIN)
    local = ModelEntry(path=str(tmp_path / "checkpoint"), **fields)
    assert (local.repo_id, local.sha) == (None, None)
    manifest = json.loads((REPO / "docs" / "minilm-cpu-manifest.json").read_text())  # written before these fields
    assert ModelEntry.model_validate(manifest["model"]).sha is None


def test_checkpoint_files_leave_other_formats_out():
    from huggingface_hub.utils import filter_repo_objects

    repository = ["config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json",
                  "2_Dense/model.safetensors", *NOT_FETCHED]
    assert set(filter_repo_objects(repository, allow_patterns=[*CHECKPOINT_FILES, "model.safetensors"])) == {
        "config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json", "2_Dense/model.safetensors"}


def test_model_types_are_the_compiled_families():
    from compile.families import FAMILIES

    assert MODEL_TYPES == tuple(FAMILIES)


def test_a_directory_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("acme/minilm") and is_repo_id("minilm")
    (tmp_path / "acme" / "minilm").mkdir(parents=True)
    assert not is_repo_id("acme/minilm")
    assert not is_repo_id("/abs/path") and not is_repo_id("a/b/c") and not is_repo_id("acme--x/y")


def test_settings_read_teis_model_variables_and_want_one_model_source():
    settings = Settings.load({}, {"MODEL_ID": "acme/minilm", "REVISION": "v1"})
    assert (settings.model_id, settings.revision, settings.artifacts) == ("acme/minilm", "v1", [])
    assert Settings.load({}, {"MODEL_ID": "a/b", "BERT_SERVE_MODEL_ID": "c/d"}).model_id == "c/d"
    assert Settings.load({"model_id": "e/f"}, {"MODEL_ID": "a/b"}).model_id == "e/f"
    # the command line's model replaces the environment's, whichever way each names it
    replaced = Settings.load({"model_id": "e/f"}, {"BERT_SERVE_ARTIFACTS": "/opt/bert/artifacts"})
    assert (replaced.model_id, replaced.artifacts) == ("e/f", [])
    assert Settings.load({"artifacts": [Path("x")]}, {"MODEL_ID": "a/b"}).model_id is None
    for flags, environ in (({}, {}), ({"model_id": "a/b", "artifacts": [Path("x")]}, {}),
                           ({}, {"BERT_SERVE_MODEL_ID": "a/b", "BERT_SERVE_ARTIFACTS": "x"})):
        with pytest.raises(ValueError, match="--artifacts DIR .* or --model-id ORG/NAME"):
            Settings.load(flags, environ)


def test_the_artifact_cache_defaults_to_the_users_cache_directory(monkeypatch, tmp_path):
    from service.model_cache import default_artifact_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_artifact_cache() == tmp_path / "bert-tvm-serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_artifact_cache() == Path.home() / ".cache" / "bert-tvm-serve"
