"""loadtest/cpuid_level.py: a command run with `cpuid` held to x86-64-v3, so that the peers of an
x86-64-v3 build pick the kernels they pick on an AVX2-only CPU. Where this host cannot hold
`cpuid` (no `cpuid_fault`), the refusal is what is tested."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from artifact.cpu_features import host_flags
from loadtest import cpuid_level

V3_FLAGS = {"avx2", "fma", "bmi2", "movbe", "f16c", "avx512f", "cpuid_fault"}
HOLDS = cpuid_level.refusal("x86-64-v3", host_flags()) is None

# What the runtimes in a process see of the CPU: PyTorch's kernel level, OpenVINO's capabilities,
# the machine line benchmarks print, and how many `cpuid` the held process answered around 20
# OpenVINO calls (none may come while a benchmark times).
PROBE = """
import ctypes, json, os
import numpy as np, openvino as ov, torch
from openvino import opset13 as ops
from loadtest.machine import describe, line
x = ops.parameter([4, 64], np.float32)
request = ov.Core().compile_model(ov.Model([ops.matmul(x, ops.constant(np.ones((64, 64), np.float32)), False, False)],
                                           [x]), "CPU").create_infer_request()
request.infer({0: np.ones((4, 64), np.float32)})
shim = [ctypes.CDLL(path) for path in os.environ.get("LD_PRELOAD", "").split() if "cpuid_level" in path]
answered = lambda: shim[0].cpuid_level_answered() if shim else None
before = answered()
for _ in range(20):
    request.infer({0: np.ones((4, 64), np.float32)})
after = answered()
print(json.dumps({"torch": torch.backends.cpu.get_cpu_capability(),
                  "openvino": ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
                  "line": line(describe()), "answered": [before, after]}))
"""


def _probe(*prefix: str) -> dict:
    result = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HOLDS, reason="this host cannot hold cpuid to x86-64-v3 (the refusal is tested instead)")
def test_peers_see_an_avx2_cpu_under_the_held_cpuid():
    held = _probe(sys.executable, "-m", "loadtest.cpuid_level", "x86-64-v3")
    assert held["torch"] == "AVX2"
    assert "BF16" not in held["openvino"] and "FP32" in held["openvino"]
    assert held["line"].endswith(", cpuid held to x86-64-v3")
    before, after = held["answered"]
    assert before > 0 and after == before  # it answered the runtimes' start, and nothing while they ran
    plain = _probe()
    assert plain["answered"] == [None, None] and "cpuid held" not in plain["line"]
    if "avx512f" in host_flags():  # the same runtimes, unheld, see this CPU's AVX-512
        assert plain["torch"] == "AVX512"


@pytest.mark.skipif(not HOLDS, reason="this host cannot hold cpuid to x86-64-v3 (the refusal is tested instead)")
def test_the_command_exit_status_is_passed_on(capsys):
    assert cpuid_level.main(["x86-64-v3", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert cpuid_level.main(["x86-64-v3", "/nonexistent/command"]) == 2
    assert capsys.readouterr().err == (
        "python -m loadtest.cpuid_level: error: cannot run /nonexistent/command: No such file or directory\n")


@pytest.mark.parametrize("flags,reason", [
    (V3_FLAGS - {"cpuid_fault"},
     "this CPU (or its hypervisor) cannot make cpuid fault: no cpuid_fault in /proc/cpuinfo"),
    (V3_FLAGS - {"avx2", "fma"}, "this CPU lacks avx2, fma: it is below x86-64-v3 already"),
    (None, "needs Linux on x86 with a readable /proc/cpuinfo"),
])
def test_a_host_that_cannot_hold_cpuid_is_refused_in_one_line(flags, reason, monkeypatch, capsys):
    monkeypatch.setattr(cpuid_level, "host_flags", lambda: flags)
    assert cpuid_level.main(["x86-64-v3", sys.executable, "-c", "raise SystemExit(0)"]) == 2
    assert capsys.readouterr().err == f"python -m loadtest.cpuid_level: error: {reason}\n"


def test_the_host_itself_is_refused_or_held():
    """On this host, the command line either holds cpuid or says in one line why it cannot."""
    result = subprocess.run([sys.executable, "-m", "loadtest.cpuid_level", "x86-64-v3", sys.executable, "-c",
                             "import os; print(os.environ['BERT_CPUID_LEVEL'])"], capture_output=True, text=True,
                            timeout=120)
    if HOLDS:
        assert (result.returncode, result.stdout) == (0, "x86-64-v3\n")
    else:
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith("python -m loadtest.cpuid_level: error: ") and result.stderr.count("\n") == 1


@pytest.mark.parametrize("argv,message", [(["x86-64-v3"], "a command to run is required"),
                                          (["x86-64-v4", "true"], "argument level: invalid choice")])
def test_a_bad_command_line_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cpuid_level.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err
