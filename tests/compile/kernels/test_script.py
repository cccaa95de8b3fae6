"""`kernels.script`: TVMScript's prim_func without its stack walk parses to the same PrimFunc, and
the import machinery's frames resolve to their modules without scanning `sys.modules`."""

from __future__ import annotations

import inspect

import tvm_ffi
from tvm.script import tirx as T

from compile.kernels import script


def _scale(n: int, factor: float, ours: bool = True):
    """A kernel whose buffer shapes are closure variables only its annotations use (PEP 563 hides
    those from the closure: the parser finds them in the enclosing frames)."""
    shape = (n,)
    if ours:
        @script.prim_func(s_tir=True, private=True)
        def scale(x: T.Buffer(shape, "float32"), y: T.Buffer(shape, "float32")):
            for i in T.serial(n):
                y[i] = x[i] * T.float32(factor)
    else:
        @T.prim_func(s_tir=True, private=True)
        def scale(x: T.Buffer(shape, "float32"), y: T.Buffer(shape, "float32")):
            for i in T.serial(n):
                y[i] = x[i] * T.float32(factor)
    return scale


def test_prim_func_parses_as_tvmscript_does():
    ours, theirs = _scale(8, 2.0), _scale(8, 2.0, ours=False)
    assert tvm_ffi.structural_equal(ours, theirs, map_free_vars=True)
    assert "global_symbol" not in (ours.attrs or {})  # private, read from the decorator's keywords
    assert not tvm_ffi.structural_equal(ours, _scale(16, 2.0), map_free_vars=True)


def test_frozen_import_frames_resolve_to_their_modules():
    script.name_frozen_import_frames()
    frame = inspect.currentframe()
    for name in script.FROZEN_IMPORT_MODULES:
        assert inspect.getmodule(frame, f"<frozen {name}>").__name__ == name
