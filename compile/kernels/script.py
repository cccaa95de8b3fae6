"""TVMScript parsed cheaply in a process that has torch loaded.

TVMScript's `T.prim_func` builds `inspect.stack()` on every use, which reads the source of every
frame on the stack and looks up each frame's module. A frame of the import machinery (`<frozen
importlib._bootstrap>`) has no file, so each lookup scans all of `sys.modules` (thousands with
torch): parsing a kernel during an import costs 0.3-0.7 s, and MetaSchedule's import of TVM's
tensor intrinsics (`--tune`) 35-40 s instead of 5.

- `name_frozen_import_frames` tells `inspect` which modules those frames belong to, which takes
  the scans out of every later stack walk, and `import_from_new_thread` imports a module of
  TVMScript from a stack a few frames deep (a stack walk costs per frame): the tuner does both
  before MetaSchedule starts, and in MetaSchedule's build workers.
- `prim_func` is `T.prim_func` without the stack walk: the parser needs only the frames themselves
  (to find names that PEP 563 hides from a closure), so it gets those, as `inspect.stack()` would
  list them, without reading any source. Use it as `@script.prim_func(s_tir=True)`: the parser
  reads `s_tir` and `private` from the decorator's keywords, as it does for `T.prim_func`.
- A macro (`T.macro`) finds the parser that expands it by walking out from its call to the first
  frame whose globals hold the parser. TVMScript walks with `inspect.getouterframes`, which reads
  the source lines of every frame, hundreds of them deep inside the parser, at every use of a
  macro; `_find_parser` walks the frames themselves, in the same order, from the same frame.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from types import SimpleNamespace

from tvm.script.parser._core import parse, utils
from tvm.script.parser.core.parser import ScriptMacro

DISPATCH_TOKEN = "tirx"  # the parser's dialect for a function decorated with this
FROZEN_IMPORT_MODULES = ("importlib._bootstrap", "importlib._bootstrap_external")


def name_frozen_import_frames() -> None:
    """Map the import machinery's frame file names to their modules in `inspect`'s own cache."""
    for name in FROZEN_IMPORT_MODULES:
        inspect.modulesbyfile.setdefault(f"<frozen {name}>", name)


def import_from_new_thread(module: str) -> None:
    """Import `module` (once per process) from a new thread, whose stack is a few frames deep."""
    name_frozen_import_frames()
    if module not in sys.modules:
        importer = threading.Thread(target=importlib.import_module, args=(module,), name=f"import {module}")
        importer.start()
        importer.join()


def prim_func(s_tir: bool = False, private: bool = False, check_well_formed: bool = True):
    """Parse the decorated function as a TIR PrimFunc (see the module's docstring)."""
    del s_tir, private  # read from the decorator's source by the parser
    frame, stack = sys._getframe(0), []
    while frame is not None:  # stack[0] is this call, then its callers: inspect.stack()'s order
        stack.append(SimpleNamespace(frame=frame))
        frame = frame.f_back

    def decorate(func):
        extra_vars = utils.inspect_function_capture(func)
        utils.resolve_closure_vars(func, extra_vars, stack)
        parsed = parse(func, extra_vars, check_well_formed=check_well_formed)
        stack.clear()  # the frames are not kept alive with the decorator
        return parsed

    decorate.dispatch_token = DISPATCH_TOKEN
    return decorate


prim_func.dispatch_token = DISPATCH_TOKEN


def _find_parser(_macro: ScriptMacro):
    """`ScriptMacro._find_parser_def` without reading each frame's source (see the module's docstring)."""
    frame = sys._getframe(0)
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


ScriptMacro._find_parser_def = _find_parser
