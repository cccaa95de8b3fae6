"""artifact/cpu_features.py and the loader's refusal of artifacts compiled for a CPU this one is not.

An artifact whose code uses instructions this CPU lacks must be refused with one clear line
(ArtifactError; `python -m compile.verify` and the server exit 2), never loaded to die with SIGILL.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import tvm
from conftest import compile_artifact, server_refusal
from test_verify import run_verify

from artifact import cpu_features
from artifact.cpu_features import FEATURES, host_flags, linux_flag, missing_on_host, target_features
from artifact.errors import ArtifactError
from artifact.loader import load_artifact
from artifact.manifest import Manifest
from compile.build import host_cpu, host_llvm, make_target

FOREIGN_CPUS = ["znver4", "sapphirerapids", "graniterapids"]


def test_llvm_names_map_to_linux_cpuinfo_flags():
    assert {feature: linux_flag(feature) for feature in FEATURES} == {
        "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi2": "bmi2",
        "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
        "avx512cd": "avx512cd", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
        "avx512fp16": "avx512_fp16", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
        "avx512ifma": "avx512ifma", "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bitalg": "avx512_bitalg",
        "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "amx-tile": "amx_tile", "amx-int8": "amx_int8",
        "amx-bf16": "amx_bf16", "amx-fp16": "amx_fp16", "avxvnni": "avx_vnni",
    }


def test_levels_that_differ_in_an_avx512_extension_are_told_apart():
    """Code for Ice Lake may use VBMI's byte permutes, which a Skylake-SP lacks; Granite Rapids' AMX-FP16
    is what Sapphire Rapids lacks: each pair records different features, so the loader can refuse."""
    from compile.build import make_target

    def features(mcpu):
        return set(target_features(make_target("cpu", mcpu=mcpu)))

    assert {"avx512vbmi", "avx512vbmi2", "gfni"} <= features("icelake-server") - features("skylake-avx512")
    assert features("graniterapids") - features("sapphirerapids") == {"amx-fp16"}


def test_host_flags_read_the_first_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx2 avx512_vnni\nbugs\t\t: none\n\n"
                       "processor\t: 1\nflags\t\t: fpu sse4_2 avx2 avx512_vnni\n")
    assert host_flags(cpuinfo) == {"fpu", "sse4_2", "avx2", "avx512_vnni"}
    assert host_flags(tmp_path / "absent") is None
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert host_flags(tmp_path / "arm") is None  # no x86 flags line: cannot check


def test_missing_features_keep_the_manifest_order():
    flags = {"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni"}
    assert missing_on_host(["sse4.2", "avx512f", "avx512vnni"], flags) == []
    assert missing_on_host(["avx512f", "avx512bw", "amx-tile", "avx2"], flags) == ["avx512bw", "amx-tile"]


def test_target_features_follow_mcpu():
    assert target_features(make_target("cpu", mcpu="x86-64")) == []
    assert target_features(make_target("cpu", mcpu="haswell")) == ["sse4.2", "avx", "avx2", "fma", "f16c", "bmi2"]
    znver4 = target_features(make_target("cpu", mcpu="znver4"))
    assert {"avx512f", "avx512bw", "avx512vnni", "avx512bf16"} <= set(znver4) and "amx-tile" not in znver4
    # a CUDA target's host code is llvm too
    assert target_features(make_target("cuda", mcpu="znver4")) == znver4


def test_this_cpus_target_turns_off_what_the_cpu_hides():
    """A VM may hide features its CPU model has (an Emerald Rapids guest without AMX or AVX512_BF16);
    LLVM's name for the CPU implies them, so the default target turns them off: code built here runs here."""
    flags = host_flags()
    if flags is None:
        pytest.skip("this CPU's flags cannot be read")
    assert missing_on_host(target_features(make_target("cpu"))) == []
    claimed = target_features(make_target("cpu", mcpu=host_cpu()))
    if not claimed:
        pytest.skip("LLVM's name for this CPU implies none of the recorded features")
    hidden = claimed[-1]
    target = tvm.target.Target(host_llvm(flags - {linux_flag(hidden)}))
    assert target.attrs["mcpu"] == host_cpu() and f"-{hidden}" in target.attrs["mattr"]
    assert hidden not in target_features(target) and set(target_features(target)) < set(claimed)


def test_a_vm_that_hides_avx512_gets_this_cpus_avx2_code():
    """Some clouds turn AVX-512 off on CPUs that have it: the default target then has 8 lanes and the
    AVX2 int8 and fp32 kernels, whatever LLVM's name for the CPU implies."""
    from compile.capabilities import Capabilities
    from compile.kernels import int8

    flags = host_flags()
    if flags is None or "avx512f" not in flags:
        pytest.skip("this CPU has no AVX-512 to hide")
    hidden = {flag for flag in flags if flag.startswith("avx512")}
    target = tvm.target.Target(host_llvm(flags - hidden))
    assert not any(feature.startswith("avx512") for feature in target_features(target))
    capabilities = Capabilities.of(target)
    assert capabilities.lanes == 8 and capabilities.int8_kernel in (int8.AVX2, int8.AVX_VNNI)
    assert not capabilities.bf16


def test_an_artifact_compiled_for_this_cpu_records_its_features_and_loads(tiny_embed_artifact):
    manifest = Manifest.read(tiny_embed_artifact)
    assert manifest.target.cpu_features == target_features(make_target("cpu"))
    assert manifest.target.mcpu == make_target("cpu").attrs["mcpu"]
    assert missing_on_host(manifest.target.cpu_features) in ([], None)
    assert load_artifact(tiny_embed_artifact).buckets


def test_loader_refuses_when_this_cpu_lacks_a_recorded_feature(tiny_embed_artifact, monkeypatch):
    features = Manifest.read(tiny_embed_artifact).target.cpu_features
    if not features:
        pytest.skip("this CPU has none of the recorded features (not x86)")
    lacking = features[-1]
    flags = {linux_flag(feature) for feature in FEATURES} - {linux_flag(lacking)}
    monkeypatch.setattr(cpu_features, "host_flags", lambda *args: flags)
    with pytest.raises(ArtifactError) as error:
        load_artifact(tiny_embed_artifact)
    message = str(error.value)
    assert "\n" not in message
    assert f"{tiny_embed_artifact} was compiled for {Manifest.read(tiny_embed_artifact).target.mcpu}" in message
    assert f"needs CPU features {lacking} this CPU lacks" in message


def test_loader_warns_and_loads_where_cpu_features_are_unknown(tiny_embed_artifact, monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "host_flags", lambda *args: None)
    with caplog.at_level(logging.WARNING, logger="artifact.levels"):
        assert load_artifact(tiny_embed_artifact).buckets
    assert "cannot read this CPU's features" in caplog.text


def test_a_manifest_without_cpu_features_still_loads(tiny_embed_artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, copy)
    data = json.loads((copy / "manifest.json").read_text())
    del data["target"]["cpu_features"]
    (copy / "manifest.json").write_text(json.dumps(data))
    assert Manifest.read(copy).target.cpu_features == []
    assert load_artifact(copy).buckets


def _foreign_cpu() -> tuple[str, list[str]]:
    """The first CPU of FOREIGN_CPUS with a recorded feature this one lacks, and those features."""
    for mcpu in FOREIGN_CPUS:
        missing = missing_on_host(target_features(make_target("cpu", mcpu=mcpu)))
        if missing:
            return mcpu, missing
    pytest.skip(f"this CPU has every feature of {', '.join(FOREIGN_CPUS)} (or its features cannot be read)")


@pytest.fixture(scope="module")
def foreign_artifact(tiny_bert_dir, tmp_path_factory):
    """A tiny artifact compiled for a CPU this one is not: the compile must neither run nor
    validate its libraries here (that would be SIGILL), only build them."""
    mcpu, missing = _foreign_cpu()
    out = tmp_path_factory.mktemp("foreign") / f"tiny-{mcpu}"
    compile_artifact(tiny_bert_dir, out, ["1x8"], mcpu=mcpu, generic_shapes=["3x5"])
    return out, mcpu, missing


def test_compiling_for_another_cpu_builds_without_running(foreign_artifact):
    out, mcpu, missing = foreign_artifact
    manifest = Manifest.read(out)
    assert manifest.target.mcpu == mcpu
    assert manifest.target.cpu_features == target_features(make_target("cpu", mcpu=mcpu))
    assert not manifest.validated and manifest.buckets[0].max_abs_diff is None
    assert manifest.buckets[0].latency_ms is None and manifest.generic.cost_model is None


def test_loader_refuses_an_artifact_for_another_cpu(foreign_artifact):
    out, mcpu, missing = foreign_artifact
    with pytest.raises(ArtifactError, match=f"compiled for {mcpu} and needs CPU features {', '.join(missing)} "):
        load_artifact(out)


def test_verify_exits_with_one_line_for_another_cpu(foreign_artifact):
    out, mcpu, missing = foreign_artifact
    result = run_verify("--artifacts", str(out))
    assert result.returncode == 2, (result.returncode, result.stderr)  # an error, not a signal (SIGILL: -4)
    assert result.stderr.strip() == (
        f"verify: error: {out} was compiled for {mcpu} and needs CPU features {', '.join(missing)} this CPU "
        "lacks; recompile it here (bert-compile without --mcpu)"
    )


def test_the_server_refuses_an_artifact_for_another_cpu_before_listening(foreign_artifact):
    out, mcpu, missing = foreign_artifact
    assert server_refusal(out) == [
        f"bert-serve: error: {out} was compiled for {mcpu} and needs CPU features {', '.join(missing)} this CPU "
        "lacks; recompile it here (bert-compile without --mcpu)"]


def test_ray_serve_refuses_an_artifact_for_another_cpu_before_starting_ray(foreign_artifact, monkeypatch, capsys):
    """The same check as the server's, before Ray starts replicas that would each die on it."""
    from service import ray_serve

    out, mcpu, missing = foreign_artifact
    monkeypatch.setattr(ray_serve.ray, "init", lambda **_: pytest.fail("Ray started for an artifact it cannot run"))
    assert ray_serve.main(["--artifacts", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ray_serve: error: {out} was compiled for {mcpu} and needs CPU features {', '.join(missing)} this CPU "
        "lacks; recompile it here (bert-compile without --mcpu)")
