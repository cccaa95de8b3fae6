"""The kernels' C (compile/kernels/c/) as C: every file compiles warning-free in every variant the C compiler
can build, defines exactly the symbols the generated code may call, refuses a variant it cannot be, and ships
with the package; a library links the objects whose symbols its kernels call (compile/kernels/linking.py)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import tvm
from tvm import tirx
from tvm.support import cc

from compile.kernels import attention_int8, bf16, int8, launch, linking
from compile.kernels.objects import SOURCES, CObject
from tests.support.commands import REPO

COMPILER = cc.get_cc() or "gcc"
OBJECTS = linking.every_object()


def _compile(obj: CObject, directory: Path, *extra: str) -> subprocess.CompletedProcess:
    """`obj`'s file compiled as the libraries' objects are, plus `extra`."""
    return subprocess.run([COMPILER, "-x", "c", "-O3", "-fPIC", f"-I{SOURCES}", *obj.flags, *extra, "-c",
                           str(SOURCES / obj.source), "-o", str(directory / f"{obj.name}.o")],
                          capture_output=True, text=True, check=False)


def _compiler_takes(isa: tuple[str, ...], directory: Path) -> bool:
    empty = directory / "empty.c"
    empty.write_text("int bert_probe;\n")
    return subprocess.run([COMPILER, "-x", "c", *isa, "-c", str(empty), "-o", str(directory / "empty.o")],
                          capture_output=True, check=False).returncode == 0


@pytest.mark.parametrize("obj", OBJECTS, ids=[obj.name for obj in OBJECTS])
def test_each_file_compiles_without_a_warning_in_each_variant(obj, tmp_path):
    """-Wall -Werror in every variant the compiler takes the instruction sets of; where it does not, the
    object is refused with the compiler's reason (which the capabilities then read as "not here")."""
    if not _compiler_takes(obj.isa, tmp_path):
        with pytest.raises(RuntimeError, match=f"cannot build the {obj.name}"):
            obj.build()
        pytest.skip(f"{COMPILER} does not take {' '.join(obj.isa)}: refused, as checked")
    result = _compile(obj, tmp_path, "-Wall", "-Wextra", "-Werror")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("obj", OBJECTS, ids=[obj.name for obj in OBJECTS])
def test_each_object_defines_the_symbols_it_declares(obj, tmp_path):
    """The symbols a library's objects are chosen by are those the object exports, no more, no fewer."""
    if not _compiler_takes(obj.isa, tmp_path):
        pytest.skip(f"{COMPILER} does not take {' '.join(obj.isa)}")
    listing = subprocess.run(["nm", "--defined-only", "--extern-only", str(obj.build())], capture_output=True,
                             text=True, check=True).stdout
    assert {line.split()[-1] for line in listing.splitlines() if line.strip()} == obj.symbols


def test_every_file_of_c_is_built_or_included():
    sources = {path.name for path in SOURCES.glob("*.c")}
    assert sources == {obj.source for obj in OBJECTS}
    included = {name for path in SOURCES.glob("*.[ch]") for name in re.findall(r'#include "(\w+\.h)"',
                                                                              path.read_text())}
    assert included == {path.name for path in SOURCES.glob("*.h")}


def test_a_variant_the_instruction_sets_cannot_run_is_refused_by_the_c(tmp_path):
    """The int8 products' zmm tile without AVX512BW, an unknown width, or a build without the constants the
    Python side owns: each an #error that names it, not a silently different kernel."""
    zmm = attention_int8.c_object(int8.VNNI)
    macros = tuple(item for item in zmm.macros if item[0] != "BERT_LANES")
    cases = {"needs AVX512BW": CObject(zmm.source, zmm.symbols, ("-mavx2", "-mfma"), zmm.macros),
             "is 8 (ymm) or 16 (zmm)": CObject(zmm.source, zmm.symbols, zmm.isa, (*macros, ("BERT_LANES", 4))),
             "constants BERT_EXP_": CObject(zmm.source, zmm.symbols, zmm.isa, (("BERT_LANES", 16),))}
    for reason, obj in cases.items():
        result = _compile(obj, tmp_path)
        assert result.returncode != 0 and reason in result.stderr, result.stderr


def test_the_package_ships_the_c():
    """An installed wheel compiles the kernels from its own copy of c/."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {str(path.parent.relative_to(REPO)).replace("/", ".") for top in setuptools["packages"]
                for path in (REPO / top.replace(".", "/")).rglob("__init__.py")}
    assert packages <= set(setuptools["packages"])
    patterns = setuptools["package-data"]["compile.kernels"]
    for path in SOURCES.iterdir():
        assert any(fnmatch(str(path.relative_to(SOURCES.parent)), pattern) for pattern in patterns), path


def _calling(*symbols: str) -> tvm.IRModule:
    calls = [tirx.Evaluate(tirx.call_extern("int32", symbol)) for symbol in symbols]
    return tvm.IRModule({"main": tirx.PrimFunc([], tirx.SeqStmt(calls) if len(calls) > 1 else calls[0])})


def test_a_library_links_the_objects_whose_symbols_it_calls():
    module = _calling(launch.CLAIM, bf16.TILE_SYMBOL, "expf")  # a libm routine: no object of ours
    assert linking.extern_symbols(module) == {launch.CLAIM, bf16.TILE_SYMBOL, "expf"}
    assert linking.linked_objects(module, int8.AVX2) == [str(launch.claims_object()), str(bf16.kernels_object())]
    tile = attention_int8.TILE.format(head=32)
    assert linking.linked_objects(_calling(tile), int8.AVX2) == [str(attention_int8.kernels_object(int8.AVX2))]
    with pytest.raises(RuntimeError, match=f"no C object here defines {tile}"):
        linking.linked_objects(_calling(tile))  # a CPU without an int8 kernel has no int8 products
    with pytest.raises(RuntimeError, match="no C object here defines bert_nowhere"):
        linking.linked_objects(_calling("bert_nowhere"), int8.AVX2)
