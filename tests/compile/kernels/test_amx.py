"""The AMX tiles (compile/kernels/amx.py): the bf16 and int8 linears' 32 x 32 whole-K calls.

Code generation is checked on every host (a library built for sapphirerapids holds tdpbf16ps and
tdpbusd tiles and calls them; a K the tile's step does not divide keeps the AVX-512 tile). Execution
needs a CPU with AMX and skips elsewhere: the int8 tile must be exact in int32 (the dequantised
result then within fp32 rounding; the bf16 tile's numerics are tests/compile/kernels/test_bf16.py's, beside the
AVX-512 tile's), and a model compiled for this CPU runs its linears on the tiles within each
precision's gate of PyTorch fp32.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.sym import Analyzer

from artifact import cpu_features
from artifact.cpu_features import FEATURES, linux_flag
from artifact.errors import ArtifactError
from artifact.loader import load_artifact
from compile.build import make_target
from compile.capabilities import Capabilities
from compile.kernels import amx, bf16, int8
from compile.kernels.linking import linked_objects
from compile.precision import GATES
from tests.support.kernels import int8_linear_inputs, int8_weight_operands
from tests.support.tvm_run import build_kernel, call_kernel

HOST = make_target("cpu")
AMX_CPU = make_target("cpu", mcpu="sapphirerapids")  # a CPU LLVM knows to have AMX: code is generated on any host


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


def _rows(m):
    return tirx.Var("m", "int64") if m is None else _i64(m)


def _export(func, schedule, target, path):
    sch = schedule(func)
    assert sch is not None
    library = build_kernel(sch.mod, target)
    library.export_library(str(path), addons=linked_objects(sch.mod))
    return path


def _bf16_linear(m, n: int, k: int, target, path):
    x = te.placeholder((_rows(m), _i64(k)), bf16.STORAGE, name="x")
    panels = te.placeholder((n // bf16.PANEL, k // bf16.PAIR, bf16.PANEL, bf16.PAIR), bf16.STORAGE, name="p")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    product = bf16.bf16_matmul_te(x, panels)
    y = te.compute(product.shape, lambda i, j: product[i, j] + bias[j], name="T_add")
    schedule = lambda f: bf16.schedule_bf16_matmul(f, amx_tiles=Capabilities.of(target).amx)  # noqa: E731
    return _export(te.create_prim_func([x, panels, bias, y]), schedule, target, path)


def _int8_linear(m, n: int, k: int, target, path):
    kernel = int8.VNNI
    inputs = int8_linear_inputs(_rows(m), n, k, kernel)
    bias = te.placeholder((n,), "float32", name="bias")
    y = int8.int8_matmul_te(*inputs)
    out = te.compute(y.shape, lambda i, j: y[i, j] + bias[j], name="add_bias")
    schedule = lambda f: int8.schedule_int8_matmul(f, kernel, Capabilities.of(target).amx)  # noqa: E731
    return _export(te.create_prim_func([*inputs, bias, out]), schedule, target, path)


def _function(assembly: str, symbol: str) -> str:
    body = assembly[assembly.index(f"<{symbol}>:"):]
    return body[:body.index("\n\n")]


def _disassemble(path) -> str:
    return subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def test_amx_is_what_a_target_with_its_three_features_runs():
    assert Capabilities.of(AMX_CPU).amx
    assert not Capabilities.of(make_target("cpu", mcpu="znver4")).amx  # AVX512_BF16 and VNNI, no AMX
    assert not Capabilities.of(make_target("cpu", mcpu="x86-64-v3")).amx
    assert Capabilities.of(AMX_CPU).linears_kernel("bf16") == amx.BF16_DESCRIPTION
    assert Capabilities.of(AMX_CPU).linears_kernel("int8") == amx.INT8_DESCRIPTION
    assert Capabilities.of(make_target("cpu", mcpu="znver4")).linears_kernel("int8") == int8.VNNI.description


def test_the_tiles_are_tdpbf16ps_and_tdpbusd_in_the_library(tmp_path):
    for build, symbol, instruction in ((_bf16_linear, amx.BF16.symbol, "tdpbf16ps"),
                                       (_int8_linear, amx.INT8.symbol, "tdpbusd")):
        assembly = _disassemble(build(32, 64, 128, AMX_CPU, tmp_path / f"{instruction}.so"))
        tile = _function(assembly, symbol)
        # per step of K: 2 row tiles x 2 panel tiles into the 2 x 2 accumulators, which start at zero in
        # the tiles (never loaded) and are stored once; the loop's step loads the next step's first row tile
        # and prefetches its panel, the last step (peeled) does neither: 4 + 4 products, 1 + 4 + 3 loads;
        # the configuration loaded where the thread's differs
        assert tile.count(instruction) == 8 and tile.count("tileloadd") == 8 and tile.count("tilezero") == 4
        assert tile.count("tilestored") == 4 and "sttilecfg" in tile and "ldtilecfg" in tile
        assert "prefetcht0" in tile
        assert re.search(rf"call\s.*<{symbol}", assembly)  # the matmul runs its blocks through the tile


def test_a_k_the_amx_step_does_not_divide_keeps_the_avx512_tile(tmp_path):
    assembly = _disassemble(_bf16_linear(32, 64, 48, AMX_CPU, tmp_path / "k48.so"))  # 48 % 32 != 0
    assert re.search(rf"call\s.*<{bf16.TILE_SYMBOL}", assembly)
    assert not re.search(rf"call\s.*<{amx.BF16.symbol}", assembly)
    assembly = _disassemble(_int8_linear(32, 64, 96, AMX_CPU, tmp_path / "k96.so"))  # 96 % 64 != 0
    assert "vpdpbusd" in assembly and not re.search(rf"call\s.*<{amx.INT8.symbol}", assembly)


@pytest.mark.parametrize("m", [32, None])
def test_the_tiles_read_their_activations_in_blocks_of_one_row_tile(m):
    """A row tile loads 16 rows x 64 bytes: the linear's copy of its activations (the padded one, or one
    made where M needs no padding) writes them so, one block after another, each contiguous."""
    n, k = 64, 256
    inputs = int8_linear_inputs(_rows(m), n, k, int8.VNNI)
    func = te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)])
    sch = int8.schedule_int8_matmul(func, int8.VNNI, amx_tiles=True)
    call = sch.get(sch.get_sblock(f"{int8.MATMUL}_o"))  # the block tensorize made the tile call
    assert amx.INT8.symbol in str(call.body)
    activations = call.match_buffers[0]
    blocked = activations.source.source  # a copy: the given activations are [M, K]
    assert [int(d) for d in blocked.shape[1:]] == [k // 64, 16, 64] and blocked.dtype == "uint8"
    rows = inputs[0].shape[0]
    assert Analyzer().can_prove_equal(blocked.shape[0], (rows + 31) // 32 * 2)  # 16-row blocks, rows padded to 32


@pytest.mark.requires("amx")
@pytest.mark.parametrize("m", [32, 13, None])
def test_amx_int8_linear_is_exact_in_int32(tmp_path, m):
    n, k, kernel = 96, 192, int8.VNNI
    rng = np.random.default_rng(1)
    rows = m or 45
    quantized = rng.integers(-127, 128, (n, k)).astype(np.int8)
    panels, column_sum = int8_weight_operands(quantized, kernel)
    codes, zero = rng.integers(0, 256, (rows, k)), rng.integers(0, 256, rows).astype(np.int32)
    x_scale = rng.uniform(0.01, 0.1, rows).astype(np.float32)
    w_scale = rng.uniform(0.01, 0.1, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    library = tvm.runtime.load_module(str(_int8_linear(m, n, k, HOST, tmp_path / "linear.so")))
    given = [codes.astype(np.uint8), x_scale, zero, panels, w_scale, column_sum, bias]
    (out,) = call_kernel(library, given, [((rows, n), "float32")])
    exact = ((codes - zero[:, None]) @ quantized.T.astype(np.int64)).astype(np.float64)
    np.testing.assert_allclose(out, exact * x_scale[:, None] * w_scale[None, :] + bias, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def amx_model(tmp_path_factory):
    """A model whose every linear fits the tiles (hidden 64, FFN 128), compiled in bf16 and int8 for this CPU
    (its tests require amx)."""
    from loadtest.random_checkpoint import save_sentence_transformer
    from tests.support.artifacts import compile_artifact
    from tests.support.checkpoints import TINY_SIZES

    root = tmp_path_factory.mktemp("amx")
    checkpoint = save_sentence_transformer(root / "model", seed=4, config={
        **TINY_SIZES, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128})
    for name in ("bf16", "int8"):
        compile_artifact(checkpoint, root / name, ["packed-32"], layout="packed", precision=name,
                         generic_shapes=["3x20"])
    return checkpoint, root


@pytest.mark.requires("amx")
@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_a_model_on_amx_tiles_matches_pytorch(amx_model, name):
    from tests.support.artifacts import least_cosine_to_pytorch

    checkpoint, root = amx_model
    model = load_artifact(root / name)
    manifest = model.manifest
    assert manifest.precision.kernel == (amx.BF16_DESCRIPTION if name == "bf16" else amx.INT8_DESCRIPTION)
    symbols = subprocess.run(["nm", str(root / name / manifest.buckets[0].library)], capture_output=True,
                             text=True, check=True).stdout
    assert (amx.BF16 if name == "bf16" else amx.INT8).symbol in symbols
    # the bucket, the generic library
    assert least_cosine_to_pytorch(model, checkpoint, [(2, 16), (3, 20)]) >= GATES[name].cosine_min


@pytest.mark.requires("amx")
def test_loader_refuses_an_amx_artifact_on_a_cpu_without_amx(amx_model, monkeypatch):
    _, root = amx_model
    flags = {linux_flag(feature) for feature in FEATURES} - {"amx_bf16", "amx_tile"}
    monkeypatch.setattr(cpu_features, "host_flags", lambda *args: flags)
    with pytest.raises(ArtifactError, match="needs CPU features amx-tile, amx-bf16 this CPU lacks"):
        load_artifact(root / "bf16")
