"""C objects beside the generated code: the files of `c/` (a vector micro-kernel where TVM's code generator
cannot express it, the claim counter), each compiled once per process by the C compiler that links every
library, linked into the libraries that call one of its symbols (compile/kernels/linking.py) and, for the
kernels this process builds and runs itself (tvm.compile's JIT: the compile's timings, the tests), loaded into
the process, where the JIT looks for the symbols its code calls and no library brings them.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).with_name("c")  # the kernels' C and its headers (package data)


@dataclass(frozen=True)
class CObject:
    """One file of `c/` as one object: the symbols it defines (those the generated code calls, by which a
    library's objects are chosen), the instruction sets it needs (`-m` flags) and its variant and constants
    (`-D` macros, values as C reads them)."""

    source: str  # file name in c/
    symbols: frozenset[str]
    isa: tuple[str, ...] = ()
    macros: tuple[tuple[str, object], ...] = ()
    variant: str = ""  # told apart in the object's name where one file builds several

    @property
    def name(self) -> str:
        return Path(self.source).stem + (f"_{self.variant}" if self.variant else "")

    @property
    def flags(self) -> tuple[str, ...]:
        return (*self.isa, *(f"-D{name}={_c_literal(value)}" for name, value in self.macros))

    def build(self) -> Path:
        """The object file, compiled once per process (a RuntimeError where the C compiler cannot)."""
        return c_object(self.name, (SOURCES / self.source).read_text(), self.flags)


def _c_literal(value) -> str:
    """`value` as a C constant: floats single precision, as the kernels compute."""
    return f"{value!r}f" if isinstance(value, float) else str(value)


@functools.cache
def scratch_directory() -> Path:
    """This process's directory of objects, removed when it exits; the build workers it forks
    (compile/workers.py) share it, so that an object one of them compiled is there for the others."""
    directory = Path(tempfile.mkdtemp(prefix="bert-objects-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


@functools.cache
def c_object(name: str, source: str, flags: tuple[str, ...]) -> Path:
    """`source` (C, which may include the headers of `c/`) compiled once per process and its build
    workers, with `flags`, to an object file the libraries link (in `scratch_directory`)."""
    from tvm.support import cc

    directory = scratch_directory()
    stem = f"{name}-{hashlib.sha256(repr((source, flags)).encode()).hexdigest()[:16]}"
    obj = directory / f"{stem}.o"
    if obj.is_file():  # another worker compiled it
        return obj
    unique = f"{stem}.{os.getpid()}"
    path, written = directory / f"{unique}.c", directory / f"{unique}.o"
    path.write_text(source)
    compiler = cc.get_cc() or "gcc"
    result = subprocess.run([compiler, "-x", "c", "-O3", "-fPIC", f"-I{SOURCES}", *flags, "-c", str(path),
                             "-o", str(written)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode
        raise RuntimeError(f"the C compiler ({compiler}) cannot build the {name}: {last}")
    os.replace(written, obj)  # whole, or not there: workers may compile the same object at once
    return obj


@functools.cache
def load_in_process(obj: Path) -> None:
    """Make the symbols `obj` defines resolvable by code this process JIT-compiles (linked to a shared
    library beside it, loaded with RTLD_GLOBAL): without them, calling such code ends the process."""
    from tvm.support import cc

    shared = obj.with_suffix(".so")
    cc.create_shared(str(shared), [str(obj)])  # as export_library links a library
    ctypes.CDLL(str(shared), mode=ctypes.RTLD_GLOBAL)
