"""`kernels.script`: TVMScript's prim_func without its stack walk parses to the same PrimFunc, a
macro finds the parser TVMScript's own walk finds, and the import machinery's frames resolve to
their modules without scanning `sys.modules`."""

from __future__ import annotations

import inspect

import tvm_ffi
from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro

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


def _doubled(n: int):
    """A kernel that uses a macro (hygienic: it sees its closure, not the kernel's names)."""
    factor = 2.0

    @T.macro
    def double(y, i):
        y[i] = y[i] * T.float32(factor)

    @script.prim_func(s_tir=True, private=True)
    def doubled(y: T.Buffer((n,), "float32")):
        for i in T.serial(n):
            double(y, i)
    return doubled


def test_a_macro_finds_the_parser_tvmscript_finds(monkeypatch):
    """Each use of a macro gets the parser `inspect.getouterframes` finds (TVMScript's walk), and
    the kernel is the one written without the macro."""
    found, ours, name = [], ScriptMacro._find_parser_def, ScriptMacro.parser_object_name
    assert ours is not None and ours.__module__ == script.__name__

    def both(macro):
        theirs = next(info.frame.f_globals[name] for info in inspect.getouterframes(inspect.currentframe())
                      if info.frame.f_globals.get(name) is not None)
        found.append((ours(macro), theirs))
        return theirs

    monkeypatch.setattr(ScriptMacro, "_find_parser_def", both)
    kernel = _doubled(8)

    @script.prim_func(s_tir=True, private=True)
    def inline(y: T.Buffer((8,), "float32")):
        for i in T.serial(8):
            y[i] = y[i] * T.float32(2.0)

    assert found and all(a is b for a, b in found)
    assert tvm_ffi.structural_equal(kernel, inline, map_free_vars=True)
