"""C objects beside the generated code: compiled once per process by the C compiler that links
every library, linked into the libraries (`build_library`'s addons) and, for the kernels this
process builds and runs itself (tvm.compile's JIT: the compile's timings, the tests), loaded into
the process, where the JIT looks for the symbols its code calls and no library brings them.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path


@functools.cache
def c_object(name: str, source: str, flags: tuple[str, ...]) -> Path:
    """`source` compiled once per process, with `flags`, to an object file the libraries link (kept in
    a scratch directory until the process exits)."""
    from tvm.support import cc

    directory = Path(tempfile.mkdtemp(prefix=f"bert-{name}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path, obj = directory / f"{name}.c", directory / f"{name}.o"
    path.write_text(source)
    compiler = cc.get_cc() or "gcc"
    result = subprocess.run([compiler, "-x", "c", "-O3", "-fPIC", *flags, "-c", str(path), "-o", str(obj)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode
        raise RuntimeError(f"the C compiler ({compiler}) cannot build the {name}: {last}")
    return obj


@functools.cache
def load_in_process(obj: Path) -> None:
    """Make the symbols `obj` defines resolvable by code this process JIT-compiles (linked to a shared
    library beside it, loaded with RTLD_GLOBAL): without them, calling such code ends the process."""
    from tvm.support import cc

    shared = obj.with_suffix(".so")
    cc.create_shared(str(shared), [str(obj)])  # as export_library links a library
    ctypes.CDLL(str(shared), mode=ctypes.RTLD_GLOBAL)
