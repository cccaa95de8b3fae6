"""One artifact for several x86 CPU levels (`bert-compile --mcpu A,B`): every level is built, the
loader and the server pick the most demanding one this CPU has every feature of, and a CPU below
all of them is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from artifact import levels
from artifact.cpu_features import host_flags, linux_flag, missing_on_host, target_features
from artifact.errors import ArtifactError
from artifact.levels import LEVELS_FILE, Level, LevelIndex, resolve
from artifact.loader import load_artifact
from artifact.manifest import Manifest
from compile.build import make_target
from compile.config import CompileConfig
from compile.verify import verify
from tests.support.commands import REPO, run_cli
from tests.support.service import server_refusal

pytestmark = pytest.mark.slow  # collected first: see conftest.py

V3, V4 = "x86-64-v3", "x86-64-v4"
V3_FEATURES = ["sse4.2", "avx", "avx2", "fma", "f16c", "bmi2"]
V4_FEATURES = V3_FEATURES + ["avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"]


def _flags(features: list[str]) -> set[str]:
    return {linux_flag(feature) for feature in features} | {"fpu", "sse2"}


@pytest.fixture
def two_levels(tmp_path):
    """A level index over two (empty) level directories: enough for `resolve`."""
    for name in (V4, V3):
        (tmp_path / name).mkdir()
    LevelIndex(levels=[Level(mcpu=V4, directory=V4, cpu_features=V4_FEATURES),
                       Level(mcpu=V3, directory=V3, cpu_features=V3_FEATURES)]).write(tmp_path)
    return tmp_path


def test_a_cpu_gets_the_most_demanding_level_it_has_every_feature_of(two_levels):
    assert resolve(two_levels, _flags(V4_FEATURES + ["avx512_vnni"])) == two_levels / V4
    assert resolve(two_levels, _flags(V4_FEATURES[:-1])) == two_levels / V3  # AVX-512 without CD
    assert resolve(two_levels, _flags(V3_FEATURES)) == two_levels / V3


def test_a_cpu_below_every_level_is_refused_naming_what_it_lacks(two_levels):
    with pytest.raises(ArtifactError, match=f"holds libraries for {V4}, {V3}; this CPU lacks avx2, fma even for {V3}"):
        resolve(two_levels, _flags(["sse4.2", "avx", "f16c", "bmi2"]))


def test_unreadable_cpu_flags_load_the_least_demanding_level(two_levels, monkeypatch, caplog):
    monkeypatch.setattr(levels, "host_flags", lambda *args: None)
    assert resolve(two_levels) == two_levels / V3
    assert "least demanding level, x86-64-v3" in caplog.text


def test_a_single_level_artifact_resolves_to_itself(tmp_path):
    assert resolve(tmp_path) == tmp_path


def test_a_level_outside_the_artifact_is_refused(two_levels):
    data = json.loads((two_levels / LEVELS_FILE).read_text())
    data["levels"][0]["directory"] = "../elsewhere"
    (two_levels / LEVELS_FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="not a subdirectory name"):
        resolve(two_levels, _flags(V4_FEATURES))


def test_cpu_levels_come_from_a_comma_list_or_a_yaml_list():
    assert CompileConfig(mcpu=f"{V3}, {V4}").cpu_levels == [V3, V4]
    assert CompileConfig(mcpu=[V3, V4]).cpu_levels == [V3, V4]
    assert CompileConfig().cpu_levels == [None]
    for bad, message in ((f"{V3},{V3}", "named twice"), (f"{V3},", "empty CPU name")):
        with pytest.raises(ValueError, match=message):
            CompileConfig(mcpu=bad)
    with pytest.raises(ValueError, match="target cpu only"):
        CompileConfig(mcpu=f"{V3},{V4}", target="cuda")


@pytest.mark.parametrize("mcpu", ["znver99", f"{'x86-64-v3'},znver99"])
def test_a_cpu_llvm_does_not_know_is_refused_before_compiling(tiny_bert_dir, tmp_path, mcpu):
    out = tmp_path / "never"
    result = run_cli("--model", str(tiny_bert_dir), "--mcpu", mcpu, "--buckets", "1x8", "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bert-compile: error: --mcpu znver99 is not a CPU LLVM knows; e.g. x86-64-v3 (AVX2), x86-64-v4 (AVX-512), "
        "znver4, sapphirerapids"]
    assert not out.exists()


@pytest.fixture(scope="module")
def multi_level(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("levels") / "tiny-levels"
    result = subprocess.run([sys.executable, "-m", "compile", "--model", str(tiny_bert_dir), "--mcpu", f"{V3},{V4}",
                             "--buckets", "1x8", "--max-batch", "8", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    (out.parent / "compile.log").write_text(result.stderr)  # its progress lines
    return out


def _host_runs(features: list[str]) -> bool:
    return missing_on_host(features) == []


def test_each_levels_progress_counts_its_own_steps(multi_level):
    """One line per step, `[compile LEVEL i/n]`, counted from 1 for each level (not on past n)."""
    steps = [line.split("]")[0] + "]" for line in (multi_level.parent / "compile.log").read_text().splitlines()
             if line.startswith("[compile ") and line.endswith(" ...")]
    for mcpu in (V3, V4):
        mine = [step for step in steps if step.startswith(f"[compile {mcpu} ")]
        total = int(mine[0].split("/")[1].rstrip("]"))
        assert mine == [f"[compile {mcpu} {i}/{total}]" for i in range(1, total + 1)]
    assert len(steps) == sum(1 for step in steps if step.startswith((f"[compile {V3} ", f"[compile {V4} ")))


def test_every_level_is_built_for_its_cpu_and_indexed_most_demanding_first(multi_level):
    index = LevelIndex.read(multi_level)
    assert [(level.mcpu, level.directory) for level in index.levels] == [(V4, V4), (V3, V3)]
    for level in index.levels:
        manifest = Manifest.read(multi_level / level.directory)
        assert manifest.target.mcpu == level.mcpu
        assert level.cpu_features == manifest.target.cpu_features == target_features(make_target("cpu", mcpu=level.mcpu))
        # validated and timed exactly where this CPU can run it (every x86 CI machine runs v3)
        assert manifest.validated == _host_runs(level.cpu_features)
        assert (manifest.buckets[0].latency_ms is not None) == _host_runs(level.cpu_features)
    assert Manifest.read(multi_level / V3).validated
    # the kernels' panels are as wide as each level's vectors: the weight sets differ
    assert (Manifest.read(multi_level / V4).weights["concat"].sha256
            != Manifest.read(multi_level / V3).weights["concat"].sha256)


def test_the_loader_runs_the_best_level_this_cpu_has_and_it_agrees_with_pytorch(multi_level):
    expected = V4 if _host_runs(V4_FEATURES) else V3
    if host_flags() is None:
        expected = V3
    model = load_artifact(multi_level)
    assert model.manifest.target.mcpu == expected and model.directory == multi_level / expected
    tolerance = model.manifest.tolerance
    for directory in {multi_level, multi_level / V3}:  # the chosen level, and the AVX2 one every x86 runs
        diffs = verify(directory)
        assert diffs and all(diff <= tolerance for shapes in diffs.values() for diff in shapes.values())


def test_the_server_serves_the_best_level_and_reports_it(multi_level, serve):
    expected = load_artifact(multi_level).manifest.target.mcpu
    with serve([multi_level]) as server:
        info = httpx.get(f"{server.url}/info").json()
        assert [model["target"]["mcpu"] for model in info["models"]] == [expected]
        assert info["models"][0]["model_id"] == "tiny-levels"  # the directory given, not the level's
        assert info["models"][0]["artifact"] == str(multi_level / expected)
        response = httpx.post(f"{server.url}/embed", json={"inputs": ["one artifact, any x86 server"]})
        assert response.status_code == 200 and len(response.json()[0]) == 32


def test_the_server_refuses_a_cpu_below_every_level_before_listening(multi_level, tmp_path):
    """Every level made to need a feature no CPU here has (an AMX tile): exit 2, one line."""
    copy = tmp_path / "tiny-levels"
    shutil.copytree(multi_level, copy)
    index = LevelIndex.read(copy)
    for level in index.levels:
        level.cpu_features.append("amx-tile")
    index.write(copy)
    if missing_on_host(["amx-tile"]) != ["amx-tile"]:
        pytest.skip("this CPU has AMX tiles (or its features cannot be read)")
    assert server_refusal(copy) == [
        f"bert-serve: error: {copy} holds libraries for {V4}, {V3}; this CPU lacks amx-tile even for {V3}: "
        "recompile it here"]


def test_a_malformed_level_index_is_refused_in_one_line(tmp_path):
    (tmp_path / LEVELS_FILE).write_text(json.dumps({"levels": [{"mcpu": 1}]}))
    assert server_refusal(tmp_path) == [
        f"bert-serve: error: {tmp_path / LEVELS_FILE} is not a valid level index: levels.0.mcpu: "
        "Input should be a valid string"]
