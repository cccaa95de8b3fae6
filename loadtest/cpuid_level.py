"""`python -m loadtest.cpuid_level CPU COMMAND...`: run COMMAND with every `cpuid` it runs answering
without the vector features LLVM's CPU `CPU` lacks (x86-64-v3: AVX2 and FMA, no AVX-512, AMX or
AVX-VNNI; znver4: AVX-512 with VNNI and BF16, no AMX or AVX512-FP16).

The runtimes we are compared with pick their kernels from `cpuid`. `ONEDNN_MAX_CPU_ISA` holds
back only OpenVINO's oneDNN: its MLAS linears and its own JIT kernels still run AVX-512 code,
and PyTorch and ONNX Runtime have no such switch. Held by `cpuid`, every peer in the process
runs the code it runs on a CPU with those features only, on the same cores as our build for that
CPU. What it cannot change is the hardware: the code runs on this CPU's execution units, caches
and clocks. `cpuid_level.c`, preloaded, does the holding (Linux, a CPU with `cpuid_fault`); it is
compiled with the C compiler that links our libraries, with the bits to clear.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from artifact.cpu_features import host_flags, linux_flag

PROG = "python -m loadtest.cpuid_level"
LEVEL_ENV = "BERT_CPUID_LEVEL"  # set in the command's environment: machine.describe() records it
SHIM_SOURCE = Path(__file__).with_name("cpuid_level.c")
REGISTERS = ("eax", "ebx", "ecx", "edx")

# LLVM's name of each vector feature `cpuid` leaf 7 reports -> (subleaf, register, bit).
CPUID_BITS: dict[str, tuple[int, str, int]] = {
    "avx512f": (0, "ebx", 16), "avx512dq": (0, "ebx", 17), "avx512ifma": (0, "ebx", 21), "avx512pf": (0, "ebx", 26),
    "avx512er": (0, "ebx", 27), "avx512cd": (0, "ebx", 28), "avx512bw": (0, "ebx", 30), "avx512vl": (0, "ebx", 31),
    "avx512vbmi": (0, "ecx", 1), "avx512vbmi2": (0, "ecx", 6), "avx512vnni": (0, "ecx", 11),
    "avx512bitalg": (0, "ecx", 12), "avx512vpopcntdq": (0, "ecx", 14),
    "avx5124vnniw": (0, "edx", 2), "avx5124fmaps": (0, "edx", 3), "avx512vp2intersect": (0, "edx", 8),
    "amx-bf16": (0, "edx", 22), "avx512fp16": (0, "edx", 23), "amx-tile": (0, "edx", 24), "amx-int8": (0, "edx", 25),
    "avxvnni": (1, "eax", 4), "avx512bf16": (1, "eax", 5), "amx-fp16": (1, "eax", 21), "avxifma": (1, "eax", 23),
    "avxvnniint8": (1, "edx", 4), "avxneconvert": (1, "edx", 5), "amx-complex": (1, "edx", 8),
    "avx10.1-256": (1, "edx", 19),
}
# What a level must keep of this CPU's, beyond leaf 7's (Linux's flag names).
BASE_FLAGS = {"avx2", "fma", "bmi2", "movbe", "f16c"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("level", help="an LLVM CPU name (x86-64-v3, znver4, ...): cpuid answers without what it lacks")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("a command to run is required")
    return args


def level_features(level: str) -> set[str]:
    """The features of `CPUID_BITS` that LLVM's CPU `level` has. ValueError: a CPU LLVM does not
    know, or one without AVX2 and FMA (which live outside leaf 7: they are never hidden)."""
    import tvm
    from tvm.target.codegen import llvm_cpu_has_features, llvm_get_cpu_archlist

    if level not in llvm_get_cpu_archlist(tvm.target.Target("llvm")):
        raise ValueError(f"{level} is not a CPU LLVM knows; e.g. x86-64-v3 (AVX2), znver4, cooperlake")
    target = tvm.target.Target({"kind": "llvm", "mcpu": level})
    if not all(llvm_cpu_has_features(feature, target) for feature in ("avx2", "fma")):
        raise ValueError(f"{level} has no AVX2 and FMA: cpuid can be held to x86-64-v3 and the CPUs above it")
    return {feature for feature in CPUID_BITS if llvm_cpu_has_features(feature, target)}


def refusal(level: str, kept: set[str], flags: set[str] | None) -> str | None:
    """Why this host (its /proc/cpuinfo `flags`) cannot run a command held to `level`, which keeps
    the features `kept`; None where it can."""
    if flags is None:
        return "needs Linux on x86 with a readable /proc/cpuinfo"
    if "cpuid_fault" not in flags:
        return "this CPU (or its hypervisor) cannot make cpuid fault: no cpuid_fault in /proc/cpuinfo"
    kept_flags = {linux_flag(feature) for feature in kept}
    if missing := sorted(BASE_FLAGS - flags) + sorted(kept_flags - flags):
        return f"this CPU lacks {', '.join(missing)}, which {level} has"
    if shutil.which("cc") is None:
        return "needs a C compiler (cc) to build the preloaded library"
    return None


def hidden_masks(kept: set[str]) -> dict[tuple[int, str], int]:
    """(subleaf, register) -> the bits of leaf 7 to clear: every feature of `CPUID_BITS` not kept."""
    masks = {(subleaf, register): 0 for subleaf in (0, 1) for register in REGISTERS}
    for feature, (subleaf, register, bit) in CPUID_BITS.items():
        if feature not in kept:
            masks[subleaf, register] |= 1 << bit
    return masks


def build_shim(directory: Path, kept: set[str]) -> Path:
    library = directory / "cpuid_level.so"
    defines = [f"-DHIDE_7_{subleaf}_{register.upper()}={mask:#x}u"
               for (subleaf, register), mask in hidden_masks(kept).items()]
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", *defines, "-o", str(library), str(SHIM_SOURCE)], check=True,
                   capture_output=True)
    return library


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kept = level_features(args.level)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if reason := refusal(args.level, kept, host_flags()):
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cpuid-level-") as scratch:
        try:
            library = build_shim(Path(scratch), kept)
        except subprocess.CalledProcessError as exc:
            last = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
            print(f"{PROG}: error: cc cannot build the preloaded library: {last[0]}", file=sys.stderr)
            return 2
        preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
        env = {**os.environ, "LD_PRELOAD": preload, LEVEL_ENV: args.level}
        try:
            status = subprocess.run(args.command, env=env).returncode
        except OSError as exc:
            print(f"{PROG}: error: cannot run {args.command[0]}: {exc.strerror}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # the command had the interrupt too
            return 130
    return 128 - status if status < 0 else status  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    raise SystemExit(main())
