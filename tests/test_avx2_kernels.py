"""The x86-64-v3 (AVX2 + FMA) level's kernels, built for that level on any x86-64 machine: the
instructions in their assembly, the int8 kernels' exactness at their saturation bound (x86-64-v4's
too, AVX2's arithmetic on zmm; and AVX-VNNI's, an alderlake level's, over the whole int8 range), and the
register tiles each level's dense kernel takes (the AVX-512 one included, which must not move).
Numbers are checked where this CPU runs x86-64-v3 code (every x86-64 CPU the suite runs on)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from conftest import int8_linear_inputs, int8_weight_operands
from tvm import te

from artifact.cpu_features import missing_on_host, target_features
from compile.build import make_target
from compile.capabilities import Capabilities
from compile.kernels import dense, int8, rows
from compile.lowering import tir_pipeline

V3 = make_target("cpu", mcpu="x86-64-v3")
V4 = make_target("cpu", mcpu="x86-64-v4")
AVX_VNNI_CPU = make_target("cpu", mcpu="alderlake")  # AVX2 + AVX-VNNI, no AVX-512


def _instructions(lib) -> tuple[set[str], str]:
    asm = lib.mod.inspect_source("asm")
    return set(re.findall(r"^\s+(v\w+)\s", asm, re.MULTILINE)), asm


def _int8_library(kernel: int8.Int8Kernel, rows: int, n: int, k: int, target=V3):
    inputs = int8_linear_inputs(rows, n, k, kernel)
    func = te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)])
    return tvm.compile(int8.schedule_int8_matmul(func, kernel).mod, target=target, tir_pipeline=tir_pipeline(target))


def _run_here(target) -> None:
    missing = missing_on_host(target_features(target))
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")


def test_register_tiles_follow_the_lane_count():
    """16 ymm: 4 rows x 3 vectors (12 accumulators); 32 zmm: 8 rows x 3 vectors (24). An N that 3
    vectors do not divide takes 2 (4 x 2 x lanes: 64 columns at AVX-512)."""
    for target, tile_rows in ((V3, 4), (V4, 8)):
        lanes = Capabilities.of(target).lanes
        n = 2 * 3 * lanes * 4  # a multiple of every width
        assert dense._tile_sizes(n, lanes) == (tile_rows, 3 * lanes, False)
        assert dense.packed_panel_width(n, lanes) == 3 * lanes
        assert dense._tile_sizes(4 * 2 * lanes, lanes) == (tile_rows, 2 * lanes, False)


def test_x86_64_v3_dense_kernel_is_ymm_fma():
    lanes = Capabilities.of(V3).lanes
    m, n, k = 4 * 4, 3 * lanes * 2, 64
    nt = dense.packed_panel_width(n, lanes)
    x = te.placeholder((m, k), "float32", name="x")
    panels = te.placeholder((n // nt, k, nt), "float32", name="panels")
    sch = dense.schedule_matmul(te.create_prim_func([x, panels, dense.packed_matmul_te(x, panels)]), lanes)
    lib = tvm.compile(sch.mod, target=V3, tir_pipeline=tir_pipeline(V3))
    instructions, asm = _instructions(lib)
    assert any(i.startswith("vfmadd") for i in instructions)
    assert "zmm" not in asm and "ymm" in asm
    _run_here(V3)
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((m, k)).astype("float32"), rng.standard_normal((n, k)).astype("float32")
    packed = w.reshape(n // nt, nt, k).transpose(0, 2, 1).copy()
    out = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(packed), out)
    np.testing.assert_allclose(out.numpy(), a @ w.T, rtol=1e-4, atol=1e-4)


def _exact_int8_products(kernel: int8.Int8Kernel, lib, x: np.ndarray, weights: np.ndarray) -> None:
    """`lib` (an int8 linear of unit scales) gives x @ weights^T exactly."""
    rows, n = x.shape[0], weights.shape[0]
    out = tvm.runtime.tensor(np.zeros((rows, n), "float32"))
    panels, column_sum = int8_weight_operands(weights, kernel)
    given = [(x + 128).astype(int8.ACTIVATION), np.ones(rows, "float32"), np.full(rows, 128, np.int32), panels,
             np.ones(n, "float32"), column_sum]
    lib(*(tvm.runtime.tensor(a) for a in given), out)
    np.testing.assert_array_equal(out.numpy(), (x.astype(np.int64) @ weights.T.astype(np.int64)).astype("float32"))


def _pairs_summing_to(total: int, n: int, k: int, rng) -> np.ndarray:
    """[n, k] weight codes whose every pair (k = 2i, 2i + 1) has one sign and sums to +-`total` in
    magnitude, each code within int8's [-127, 127]."""
    first = rng.integers(total - 127, 128, (n, k // 2))
    signs = rng.choice([-1, 1], (n, k // 2))
    return (np.stack([first, total - first], axis=-1) * signs[..., None]).reshape(n, k)


@pytest.mark.parametrize("target,register", [(V3, "ymm"), (V4, "zmm")], ids=["x86-64-v3", "x86-64-v4"])
def test_int8_kernels_without_vnni_are_vpmaddubsw_and_exact_at_their_pair_bound(target, register):
    """x86-64-v3 takes AVX2's kernel, x86-64-v4 (AVX-512 without VNNI) the same arithmetic on zmm.
    Codes whose pairs of one sign sum to `PAIR_CODES` (128) against u8 activations of 255 are the
    largest int16 pair sums the weight scales allow (compile/passes/quantize.py): they must come out
    exact. One code more, and vpmaddubsw saturates: the bound is the instruction's."""
    kernel = Capabilities.of(target).int8_kernel
    assert kernel.int16_pairs and int8.PAIR_CODES == 128
    rows, n, k = 2 * kernel.rows, 2 * kernel.panel, 16 * kernel.group
    lib = _int8_library(kernel, rows, n, k, target)
    instructions, asm = _instructions(lib)
    assert {"vpmaddubsw", "vpmaddwd"} <= instructions and re.search(rf"vpmaddubsw\s+[^\n]*%{register}", asm)
    assert ("zmm" in asm) == (register == "zmm") and not any(i.startswith("vpdpbusd") for i in instructions)
    _run_here(target)
    rng = np.random.default_rng(1)
    x = rng.choice([-128, 127], (rows, k))  # u8 = 0 or 255
    x[0] = 127  # every product of row 0 at its largest
    _exact_int8_products(kernel, lib, x, _pairs_summing_to(int8.PAIR_CODES, n, k, rng).astype(np.int8))
    with pytest.raises(AssertionError):
        _exact_int8_products(kernel, lib, x, _pairs_summing_to(int8.PAIR_CODES + 1, n, k, rng).astype(np.int8))


def test_avx_vnni_int8_kernel_is_vex_vpdpbusd_on_ymm_and_exact_over_the_int8_range():
    """A CPU with AVX-VNNI and no AVX-512 takes VNNI's dot product on ymm, with 8-bit weights:
    vpdpbusd sums in int32 and never saturates."""
    kernel = Capabilities.of(AVX_VNNI_CPU).int8_kernel
    assert kernel is int8.AVX_VNNI and not kernel.int16_pairs
    rows, n, k = 2 * kernel.rows, 2 * kernel.panel, 16 * kernel.group
    lib = _int8_library(kernel, rows, n, k, AVX_VNNI_CPU)
    instructions, asm = _instructions(lib)
    assert re.search(r"\{vex\}\s+vpdpbusd\s+\(?%?\S*ymm", asm) and "vpmaddubsw" not in instructions
    assert "zmm" not in asm
    _run_here(AVX_VNNI_CPU)
    rng = np.random.default_rng(2)
    x = rng.choice([-128, 127], (rows, k))
    weights = np.where(rng.random((n, 1)) < 0.5, np.sign(x[0]) * 127, rng.integers(-127, 128, (n, k)))
    _exact_int8_products(kernel, lib, x, weights.astype(np.int8))


@pytest.mark.parametrize("target", [V3, V4], ids=["x86-64-v3", "x86-64-v4"])
def test_layer_norm_keeps_sixteen_partial_sums_at_every_vector_width(target):
    """Two ymm of partial sums per reduction at AVX2 (one zmm at AVX-512, as before): each partial's
    chain of dependent adds is width / 16 long at both widths. Numbers against PyTorch on x86-64-v3."""
    import torch

    lanes = Capabilities.of(target).lanes
    width = 24 * lanes
    x = te.placeholder((tvm.tirx.Var("t", "int64"), width), "float32", name="x")
    gamma, beta = (te.placeholder((width,), "float32", name=name) for name in ("gamma", "beta"))
    out = tvm.topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-12)
    sch = rows.schedule_rows(te.create_prim_func([x, gamma, beta, out]), lanes)
    partials = re.findall(r"_rf = T.sblock_alloc_buffer\(\((?:T\.int64\()?(\d+)", sch.mod["main"].script())
    assert partials == [str(max(lanes, 16))] * 2  # the sum's and the variance's
    lib = tvm.compile(sch.mod, target=target, tir_pipeline=tir_pipeline(target))
    _run_here(target)
    rng = np.random.default_rng(2)
    xs, g, b = (rng.standard_normal(shape).astype("float32") for shape in ((5, width), (width,), (width,)))
    result = tvm.runtime.tensor(np.zeros((5, width), "float32"))
    lib(*(tvm.runtime.tensor(a) for a in (xs * 3 + 1, g, b)), result)
    expected = torch.nn.functional.layer_norm(torch.from_numpy(xs * 3 + 1), (width,), torch.from_numpy(g),
                                              torch.from_numpy(b), 1e-12)
    np.testing.assert_allclose(result.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
