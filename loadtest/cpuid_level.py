"""`python -m loadtest.cpuid_level x86-64-v3 COMMAND...`: run COMMAND with every `cpuid` it runs
answering as an x86-64-v3 CPU (AVX2 and FMA, no AVX-512, AMX or AVX-VNNI).

The runtimes we are compared with pick their kernels from `cpuid`. `ONEDNN_MAX_CPU_ISA` holds
back only OpenVINO's oneDNN: its MLAS linears and its own JIT kernels still run AVX-512 code,
and PyTorch and ONNX Runtime have no such switch. Held by `cpuid`, every peer in the process
runs the code it runs on an AVX2-only CPU, on the same cores as our x86-64-v3 build. What it
cannot change is the hardware: the AVX2 code runs on this CPU's execution units, not on an AVX2
CPU's. `cpuid_level.c`, preloaded, does the holding (Linux, a CPU with `cpuid_fault`); it is
compiled with the C compiler that links our libraries.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from artifact.cpu_features import host_flags

PROG = "python -m loadtest.cpuid_level"
LEVEL_ENV = "BERT_CPUID_LEVEL"  # set in the command's environment: machine.describe() records it
SHIM_SOURCE = Path(__file__).with_name("cpuid_level.c")
LEVEL_FLAGS = {"x86-64-v3": {"avx2", "fma", "bmi2", "movbe", "f16c"}}  # what the level keeps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("level", choices=sorted(LEVEL_FLAGS), help="the level `cpuid` answers as")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("a command to run is required")
    return args


def refusal(level: str, flags: set[str] | None) -> str | None:
    """Why this host cannot run a command held to `level`, or None where it can."""
    if flags is None:
        return "needs Linux on x86 with a readable /proc/cpuinfo"
    if "cpuid_fault" not in flags:
        return "this CPU (or its hypervisor) cannot make cpuid fault: no cpuid_fault in /proc/cpuinfo"
    if missing := LEVEL_FLAGS[level] - flags:
        return f"this CPU lacks {', '.join(sorted(missing))}: it is below {level} already"
    if shutil.which("cc") is None:
        return "needs a C compiler (cc) to build the preloaded library"
    return None


def build_shim(directory: Path) -> Path:
    library = directory / "cpuid_level.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(SHIM_SOURCE)], check=True,
                   capture_output=True)
    return library


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := refusal(args.level, host_flags()):
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cpuid-level-") as scratch:
        library = build_shim(Path(scratch))
        preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
        env = {**os.environ, "LD_PRELOAD": preload, LEVEL_ENV: args.level}
        try:
            status = subprocess.run(args.command, env=env).returncode
        except OSError as exc:
            print(f"{PROG}: error: cannot run {args.command[0]}: {exc.strerror}", file=sys.stderr)
            return 2
    return 128 - status if status < 0 else status  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    raise SystemExit(main())
