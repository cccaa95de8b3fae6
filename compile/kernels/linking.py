"""Which C objects a library links: those defining the symbols its generated code calls.

A kernel calls a C routine by name (`call_extern`); the object that defines the name is linked into the
library (`build_library`'s addons), and an object nothing calls is left out. So the choice follows what the
schedules and the attention kernel actually wrote, not a second reading of the options that made them.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from . import amx, attention_amx, attention_bf16, attention_int8, bf16, bsr, int8, launch
from .objects import CObject

PREFIX = "bert_"  # every symbol of c/ starts so: a call of one no object defines is a bug, not a libm routine
_CALL_EXTERN = tvm.ir.Op.get("tirx.call_extern")


# the objects built one way for every target
SINGLE = (launch.CLAIMS, bf16.TILE_OBJECT, attention_bf16.OBJECT, amx.TILES_OBJECT, attention_amx.OBJECT, *bsr.OBJECTS)


def library_objects(int8_kernel: int8.Int8Kernel | None) -> tuple[CObject, ...]:
    """Every object a library may link, the int8 products in the variant of its CPU's int8 kernel."""
    return (*SINGLE, *((attention_int8.c_object(int8_kernel),) if int8_kernel is not None else ()))


def every_object() -> tuple[CObject, ...]:
    """Every object of every variant (what the C is tested as)."""
    return (*SINGLE, *(attention_int8.c_object(kernel) for kernel in int8.KERNELS))


def extern_symbols(mod: tvm.IRModule) -> set[str]:
    """The names the PrimFuncs of `mod` call with `call_extern`."""
    symbols = set()

    def record(call: tvm.ir.expr.Call):
        if call.op.same_as(_CALL_EXTERN):
            symbols.add(call.args[0].value)

    for _, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, [(tvm.ir.expr.Call, record)])
    return symbols


def linked_objects(mod: tvm.IRModule, int8_kernel: int8.Int8Kernel | None = None) -> list[str]:
    """The object files a library built from `mod` (lowered: its kernels written and scheduled) links:
    each object defining a symbol its kernels call, the int8 products built for `int8_kernel`'s CPUs."""
    called = extern_symbols(mod)
    objects = [obj for obj in library_objects(int8_kernel) if obj.symbols & called]
    undefined = {symbol for symbol in called if symbol.startswith(PREFIX)}.difference(
        *(obj.symbols for obj in objects))
    if undefined:
        raise RuntimeError(f"no C object here defines {', '.join(sorted(undefined))}")
    return [str(obj.build()) for obj in objects]
