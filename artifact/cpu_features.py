"""The x86 CPU features an artifact's libraries may use, and whether this CPU has them.

A library compiled for one CPU (`--mcpu znver4`, or the build machine's own CPU by default) may
use any instruction that CPU has; loaded on a CPU without them it dies with SIGILL at the first
such instruction. So the compile stage records which of `FEATURES` LLVM says the target's CPU
has (`target_features`, needs TVM's compiler), and the loader compares them with this CPU's
(`missing_on_host`, reads /proc/cpuinfo: needs neither the compiler nor TVM at all).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

# LLVM's names of the features code generation may use for BERT's kernels (vector widths,
# FMA, conversions, VNNI / BF16 / FP16 dot products, AMX tiles), and the AVX-512 extensions LLVM
# may pick for shuffles, byte permutes and counts on a CPU that has them (`vpermb` is VBMI's: code
# for Ice Lake would die on a Skylake-SP that has every other AVX-512 feature here).
FEATURES: tuple[str, ...] = (
    "sse4.2", "avx", "avx2", "fma", "f16c", "bmi2",
    "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vnni", "avx512bf16", "avx512fp16",
    "avx512vbmi", "avx512vbmi2", "avx512ifma", "avx512vpopcntdq", "avx512bitalg", "gfni", "vaes", "vpclmulqdq",
    "amx-tile", "amx-int8", "amx-bf16", "amx-fp16", "avxvnni",
)

# LLVM feature name -> the flag Linux lists in /proc/cpuinfo, where the two differ.
_LINUX_FLAGS = {
    "sse4.2": "sse4_2",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "amx-tile": "amx_tile",
    "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16",
    "avxvnni": "avx_vnni",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "amx-fp16": "amx_fp16",
    # leaf-7 features beyond FEATURES, which `loadtest.cpuid_level` hides from other runtimes
    "avx5124vnniw": "avx512_4vnniw",
    "avx5124fmaps": "avx512_4fmaps",
    "avx512vp2intersect": "avx512_vp2intersect",
    "amx-complex": "amx_complex",
    "avxifma": "avx_ifma",
    "avxvnniint8": "avx_vnni_int8",
    "avxneconvert": "avx_ne_convert",
    "avx10.1-256": "avx10",
}

CPUINFO = Path("/proc/cpuinfo")


def linux_flag(feature: str) -> str:
    """The /proc/cpuinfo flag of an LLVM feature name (`avx512vnni` -> `avx512_vnni`)."""
    return _LINUX_FLAGS.get(feature, feature)


def target_features(target) -> list[str]:
    """The `FEATURES` the CPU of an llvm target (or of a CUDA target's llvm host) has, per LLVM.

    Needs TVM's compiler library, imported here and not at module import, so the loader can use
    the rest of this module with TVM's runtime alone.
    """
    from tvm.target.codegen import llvm_cpu_has_features

    llvm = target.host or target
    if llvm.kind.name != "llvm":
        return []
    return [feature for feature in FEATURES if llvm_cpu_has_features(feature, llvm)]


def host_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """This CPU's flags from /proc/cpuinfo, or None where they cannot be read (not Linux, no
    readable cpuinfo, or one without an x86 `flags` line)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def missing_on_host(required: Iterable[str], flags: set[str] | None = None) -> list[str] | None:
    """The `required` LLVM features this CPU lacks (in the given order); None when this CPU's flags
    cannot be read. `flags` defaults to `host_flags()`."""
    flags = host_flags() if flags is None else flags
    if flags is None:
        return None
    return [feature for feature in required if linux_flag(feature) not in flags]
