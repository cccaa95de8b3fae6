"""The machine a benchmark ran on, recorded next to its figures: the CPU's name (`lscpu`), the LLVM
CPU that TVM compiles for on it, its vector features (the loader's own reading of /proc/cpuinfo),
the cores this process may use, and the level `cpuid` was held to (`loadtest.cpuid_level`), if any."""

from __future__ import annotations

import os
import platform
import subprocess

from artifact.cores import usable_cores
from artifact.cpu_features import host_flags

from .cpuid_level import LEVEL_ENV


def describe() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = host_flags() or set()
    return {"cpu": fields.get("Model name", "").strip() or platform.processor() or platform.machine(),
            "llvm_mcpu": _llvm_cpu(), "cores": usable_cores(), "avx512": "avx512f" in flags,
            "vnni": "avx512_vnni" in flags, "cpuid_level": os.environ.get(LEVEL_ENV)}


def _llvm_cpu() -> str | None:
    """LLVM's name for this CPU, with the features of that model a VM hides (`emeraldrapids (without
    amx-tile, ...)`, `compile.capabilities.cpu_name`); None where TVM runs without its compiler library (a
    serving host, `TVM_USE_RUNTIME_LIB=1`): LLVM lives in that library."""
    from tvm.base import _RUNTIME_ONLY

    if _RUNTIME_ONLY:
        return None
    from compile.build import make_target
    from compile.capabilities import cpu_name

    return cpu_name(make_target("cpu"))


def line(machine: dict) -> str:
    """`AMD EPYC (LLVM mcpu znver4, 2 cores, AVX-512 yes, VNNI yes)`, and `, cpuid held to x86-64-v3`
    after it where it was."""
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    held = f", cpuid held to {machine['cpuid_level']}" if machine.get("cpuid_level") else ""
    return (f"{machine['cpu']} (LLVM mcpu {machine['llvm_mcpu'] or 'n/a'}, {machine['cores']} cores, "
            f"AVX-512 {yes(machine['avx512'])}, VNNI {yes(machine['vnni'])}){held}")
