"""The int8 row quantizer (compile/kernels/row_quantize.py) against numpy, with and without a folded
smoothing multiply, on the written kernel and on the generic rules' schedule of its TE form (a row
width the lanes do not divide); and the quantize pass folding SmoothQuant's multiply into it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te, tirx
from tvm.script import relax as R

from artifact.cpu_features import missing_on_host, target_features
from compile.build import make_target
from compile.capabilities import Capabilities
from compile.int8_simulation import fake_quantized_linear
from compile.kernels import int8, row_quantize
from compile.lowering import tir_pipeline
from compile.opcount import count_ops
from compile.passes.quantize import quantize_linears
from compile.passes.smooth import smooth_linears
from compile.schedule import cpu_pipeline, schedule_func

LEVELS = [make_target("cpu", mcpu="x86-64-v3"), make_target("cpu", mcpu="x86-64-v4")]  # 8 and 16 lanes


def _runnable(target):
    missing = missing_on_host(target_features(target))
    if missing:
        pytest.skip(f"compiled for {target.attrs['mcpu']}; this CPU lacks {', '.join(missing)}, so it is not run")


def _expected(values: np.ndarray, multiplier: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """What the quantizer computes, in numpy: each row's [min(x, 0), max(x, 0)] onto [0, 255]."""
    x = values if multiplier is None else values * multiplier
    low, high = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
    scale = (np.maximum(high - low, np.float32(1e-30)) / np.float32(255)).astype("float32")
    inverse = np.float32(1) / scale  # the kernel multiplies by the row's reciprocal
    zero = np.round(-low * inverse).astype("int32")
    codes = np.clip(np.round(x * inverse[:, None]) + zero[:, None], 0, 255).astype("uint8")
    return codes, scale, zero


@pytest.mark.parametrize("target", LEVELS, ids=lambda t: str(t.attrs["mcpu"]))
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("odd_width", [False, True], ids=["written kernel", "generic rules"])
def test_row_quantizer_maps_each_rows_range_onto_the_bytes(target, smoothed, odd_width):
    """Bit for bit numpy's: the scale, the zero point (an all-zero row does not divide by zero; an
    all-positive row's is 0) and every code, at a symbolic row count. Where the lanes divide the
    width the written kernel takes the TE form's place; elsewhere the generic rules schedule it."""
    lanes = Capabilities.of(target).lanes
    width = 5 * lanes + (3 if odd_width else 0)
    m = tirx.Var("m", "int64")
    x = te.placeholder((m, width), "float32", name="x")
    multiplier = te.placeholder((width,), "float32", name="multiplier") if smoothed else None
    func = te.create_prim_func([x, *([multiplier] if smoothed else []), *row_quantize.quantize_rows_te(x, multiplier)])
    assert (row_quantize.schedule_row_quantize(func, lanes) is None) == odd_width
    scheduled = schedule_func(func, target)
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=target, tir_pipeline=tir_pipeline(target))
    _runnable(target)

    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, width)).astype("float32")
    values[2] = 0.0
    values[3] = np.abs(values[3])  # all positive: zero point 0
    values[4] = np.maximum(values[4], -0.17)  # GELU-like: a short negative tail
    scales = rng.uniform(0.2, 5.0, width).astype("float32") if smoothed else None
    out = [tvm.runtime.tensor(np.zeros((6, width), "uint8")), tvm.runtime.tensor(np.zeros(6, "float32")),
           tvm.runtime.tensor(np.zeros(6, "int32"))]
    lib["main"](tvm.runtime.tensor(values), *([tvm.runtime.tensor(scales)] if smoothed else []), *out)
    codes, scale, zero = _expected(values, scales)
    np.testing.assert_array_equal(out[1].numpy(), scale)
    np.testing.assert_array_equal(out[2].numpy(), zero)
    np.testing.assert_array_equal(out[0].numpy(), codes)
    assert zero[3] == 0 and all(codes[row].min() == 0 for row in (0, 1, 4))  # the range's ends are codes
    assert all(codes[row].max() >= 254 for row in (0, 1, 3, 4))


@tvm.script.ir_module
class SmoothedFFN:
    """Layer norm -> linear -> GELU -> linear, widths every int8 kernel's panels fit (96 = 4 x 24 = 3 x 32)."""

    @R.function
    def main(x: R.Tensor((7, 96), "float32"), p_ln_weight: R.Tensor((96,), "float32"),
             p_ln_bias: R.Tensor((96,), "float32"), p_up_weight: R.Tensor((192, 96), "float32"),
             p_down_weight: R.Tensor((96, 192), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.nn.layer_norm(x, p_ln_weight, p_ln_bias, axes=[-1])
            up = R.matmul(h, R.permute_dims(p_up_weight))
            down = R.matmul(R.nn.gelu(up), R.permute_dims(p_down_weight))
            R.output(down)
        return down


def test_quantize_pass_folds_the_smoothing_multiply_into_the_row_quantizer():
    """Both linears smoothed: their two per-call multiplies by 1 / s leave the graph for the
    quantizer's own parameter, and the int8 model (built by our CPU pipeline for x86-64-v3, so on the
    written kernel) computes what the int8 plan's simulation of the kernels does."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in SmoothedFFN["main"].params]
    args[3] *= 0.1
    args[4] *= 0.1
    scales = {"up": rng.uniform(0.2, 5.0, 96).astype("float32"), "down": rng.uniform(0.2, 5.0, 192).astype("float32")}
    smoothed, _ = smooth_linears(SmoothedFFN, scales)
    target = LEVELS[0]  # the AVX2 kernel: TVM code only (AMX's and VNNI's tiles link C micro-kernels)
    quantized, count = quantize_linears(smoothed, target)
    assert count == 2
    calls = [gv.name_hint for gv in quantized.get_global_vars()]
    assert sum(name.startswith(row_quantize.SMOOTHED_ROW_QUANTIZE) for name in calls) == 2
    assert not any(name.startswith(row_quantize.ROW_QUANTIZE) for name in calls)
    # per call, smoothing multiplied twice (1 / s) and the weights twice (W x s, lifted out later)
    assert count_ops(smoothed)["relax.multiply"] - count_ops(quantized).get("relax.multiply", 0) == 2

    built = tvm.compile(quantized, target, relax_pipeline=cpu_pipeline(target), tir_pipeline=tir_pipeline(target))
    _runnable(target)
    ours = relax.VirtualMachine(built, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()
    x, ln_weight, ln_bias, up, down = (torch.from_numpy(a) for a in args)
    h = torch.nn.functional.layer_norm(x, [96], ln_weight, ln_bias)
    linear = {name: torch.nn.Linear(*w.shape[::-1], bias=False) for name, w in (("up", up), ("down", down))}
    for name, w in (("up", up), ("down", down)):
        linear[name].weight.data = w
    pairs, scale = int8.AVX2.int16_pairs, {name: torch.from_numpy(v) for name, v in scales.items()}
    with torch.no_grad():  # the kernels' arithmetic, smoothing by the same vectors (compile/int8_simulation.py)
        hidden = torch.nn.functional.gelu(fake_quantized_linear(linear["up"], h, scale["up"], pairs))
        expected = fake_quantized_linear(linear["down"], hidden, scale["down"], pairs).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
