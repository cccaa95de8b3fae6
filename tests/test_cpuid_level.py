"""loadtest/cpuid_level.py: a command run with `cpuid` answering without the features an LLVM CPU
lacks, so that the peers of a build for that CPU pick the kernels they pick on it. Where this
host cannot hold `cpuid` (no `cpuid_fault`, or a feature the level has missing), the refusal is
what is tested."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from artifact.cpu_features import host_flags
from loadtest import cpuid_level

V3_FLAGS = {"avx2", "fma", "bmi2", "movbe", "f16c", "cpuid_fault"}


def _holds(level: str) -> bool:
    return cpuid_level.refusal(level, cpuid_level.level_features(level), host_flags()) is None


# What the runtimes in a process see of the CPU: PyTorch's kernel level, OpenVINO's default
# precision and the kernels of a matmul it compiled, the machine line benchmarks print, and how
# many `cpuid` the held process answered around 20 OpenVINO calls (none may come while a
# benchmark times).
PROBE = """
import ctypes, json, os
import numpy as np, openvino as ov, torch
from openvino import opset13 as ops
from loadtest.machine import describe, line
x = ops.parameter([64, 256], np.float32)
compiled = ov.Core().compile_model(ov.Model([ops.matmul(x, ops.constant(np.ones((256, 256), np.float32)), False, True)],
                                            [x]), "CPU")
request = compiled.create_infer_request()
request.infer({0: np.ones((64, 256), np.float32)})
shim = [ctypes.CDLL(path) for path in os.environ.get("LD_PRELOAD", "").split() if "cpuid_level" in path]
answered = lambda: shim[0].cpuid_level_answered() if shim else None
before = answered()
for _ in range(20):
    request.infer({0: np.ones((64, 256), np.float32)})
after = answered()
kernels = [op.get_rt_info()["primitiveType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()
           if "primitiveType" in op.get_rt_info()]
print(json.dumps({"torch": torch.backends.cpu.get_cpu_capability(),
                  "precision": compiled.get_property("INFERENCE_PRECISION_HINT").to_string(),
                  "matmul": [kernel for kernel in kernels if "gemm" in kernel or "mlas" in kernel],
                  "line": line(describe()), "answered": [before, after]}))
"""


def _probe(*prefix: str) -> dict:
    result = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@functools.cache
def _unheld() -> dict:
    return _probe()


def _held(level: str) -> dict:
    held = _probe(sys.executable, "-m", "loadtest.cpuid_level", level)
    assert held["line"].endswith(f", cpuid held to {level}")
    before, after = held["answered"]
    assert before > 0 and after == before  # it answered the runtimes' start, and nothing while they ran
    return held


@pytest.mark.skipif(not _holds("x86-64-v3"), reason="this host cannot hold cpuid to x86-64-v3 (refusals tested)")
def test_peers_see_an_avx2_cpu_under_x86_64_v3():
    held = _held("x86-64-v3")
    assert held["torch"] == "AVX2" and held["precision"] == "f32"
    assert held["matmul"] and not any("avx512" in kernel or "amx" in kernel for kernel in held["matmul"])
    plain = _unheld()
    assert plain["answered"] == [None, None] and "cpuid held" not in plain["line"]
    if "avx512f" in host_flags():  # the same runtimes, unheld, see this CPU's AVX-512
        assert plain["torch"] == "AVX512"


@pytest.mark.skipif(not _holds("znver4"), reason="this host cannot hold cpuid to znver4 (refusals tested)")
def test_peers_see_bf16_without_amx_under_znver4():
    held = _held("znver4")
    assert held["torch"] == "AVX512" and held["precision"] == "bf16"  # OpenVINO's default where BF16 is
    assert any("avx512" in kernel for kernel in held["matmul"]) and not any("amx" in k for k in held["matmul"])
    if "amx_tile" in host_flags():  # unheld, the same matmul runs on this CPU's AMX tiles
        assert any("amx" in kernel for kernel in _unheld()["matmul"])


@pytest.mark.skipif(not _holds("x86-64-v3"), reason="this host cannot hold cpuid to x86-64-v3 (refusals tested)")
def test_the_command_exit_status_is_passed_on(capsys):
    assert cpuid_level.main(["x86-64-v3", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert cpuid_level.main(["x86-64-v3", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"]) == 137
    assert cpuid_level.main(["x86-64-v3", "/nonexistent/command"]) == 2
    assert capsys.readouterr().err == (
        "python -m loadtest.cpuid_level: error: cannot run /nonexistent/command: No such file or directory\n")


def test_a_level_hides_exactly_the_leaf_7_features_its_cpu_lacks():
    v3, znver4 = cpuid_level.level_features("x86-64-v3"), cpuid_level.level_features("znver4")
    assert v3 == set()  # AVX2 and FMA live in other leaves: nothing of leaf 7's vector features
    assert {"avx512f", "avx512bw", "avx512vnni", "avx512bf16"} <= znver4
    assert not znver4 & {"amx-tile", "amx-int8", "amx-bf16", "avx512fp16", "avxvnni"}
    masks = cpuid_level.hidden_masks(znver4)
    assert masks[0, "edx"] & (1 << 24) and masks[0, "edx"] & (1 << 23)  # AMX tiles and AVX512-FP16 hidden
    assert not masks[0, "ebx"] & (1 << 16) and not masks[1, "eax"] & (1 << 5)  # AVX512F and BF16 kept
    assert masks[1, "eax"] & (1 << 4)  # AVX-VNNI, which znver4 lacks, hidden
    assert all(mask == sum(1 << bit for subleaf, register, bit in cpuid_level.CPUID_BITS.values()
                           if (subleaf, register) == key)
               for key, mask in cpuid_level.hidden_masks(v3).items())


@pytest.mark.parametrize("level,flags,reason", [
    ("x86-64-v3", V3_FLAGS - {"cpuid_fault"},
     "this CPU (or its hypervisor) cannot make cpuid fault: no cpuid_fault in /proc/cpuinfo"),
    ("x86-64-v3", V3_FLAGS - {"avx2", "fma"}, "this CPU lacks avx2, fma, which x86-64-v3 has"),
    ("cooperlake", V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
     "this CPU lacks avx512_bf16, which cooperlake has"),
    ("x86-64-v3", None, "needs Linux on x86 with a readable /proc/cpuinfo"),
])
def test_a_host_that_cannot_hold_cpuid_is_refused_in_one_line(level, flags, reason, monkeypatch, capsys):
    monkeypatch.setattr(cpuid_level, "host_flags", lambda: flags)
    assert cpuid_level.main([level, sys.executable, "-c", "raise SystemExit(0)"]) == 2
    assert capsys.readouterr().err == f"python -m loadtest.cpuid_level: error: {reason}\n"


def test_a_shim_cc_cannot_build_is_one_line(monkeypatch, tmp_path, capsys):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpuid_level, "SHIM_SOURCE", broken)
    monkeypatch.setattr(cpuid_level, "refusal", lambda *args: None)
    assert cpuid_level.main(["x86-64-v3", sys.executable, "-c", "raise SystemExit(0)"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m loadtest.cpuid_level: error: cc cannot build the preloaded library: ")
    assert error.count("\n") == 1


def test_the_host_itself_is_refused_or_held():
    """On this host, the command line either holds cpuid or says in one line why it cannot."""
    result = subprocess.run([sys.executable, "-m", "loadtest.cpuid_level", "x86-64-v3", sys.executable, "-c",
                             "import os; print(os.environ['BERT_CPUID_LEVEL'])"], capture_output=True, text=True,
                            timeout=120)
    if _holds("x86-64-v3"):
        assert (result.returncode, result.stdout) == (0, "x86-64-v3\n")
    else:
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith("python -m loadtest.cpuid_level: error: ") and result.stderr.count("\n") == 1


@pytest.mark.parametrize("level,reason", [
    ("x86-64-v9", "x86-64-v9 is not a CPU LLVM knows; e.g. x86-64-v3 (AVX2), znver4, cooperlake"),
    ("x86-64-v2", "x86-64-v2 has no AVX2 and FMA: cpuid can be held to x86-64-v3 and the CPUs above it"),
])
def test_a_level_that_cannot_be_held_to_is_refused(level, reason, capsys):
    assert cpuid_level.main([level, "true"]) == 2
    assert capsys.readouterr().err == f"python -m loadtest.cpuid_level: error: {reason}\n"


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exited:
        cpuid_level.main(["x86-64-v3"])
    assert exited.value.code == 2 and "a command to run is required" in capsys.readouterr().err
