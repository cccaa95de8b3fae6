"""compile/passes/fuse_attention.py and compile/kernels/attention.py: the attention core of both
layouts rewritten into one kernel call (Before/Expected), left alone where the kernel does not
apply, and numerically equal to the unfused graph at odd lengths and masks, static and symbolic
sequence bounds, for AVX2 and AVX-512 lane counts (code for a level this CPU lacks is compiled,
not run)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from artifact.packed_batch import pack_batch
from compile.build import build_library, make_target
from compile.capabilities import KernelConfig
from compile.kernels import attention, attention_amx, attention_bf16
from compile.kernels.attention import AttentionShape
from compile.kernels.launch import CLAIM
from compile.passes.fuse_attention import fuse_attention_in
from tests.support.tvm_run import build_scheduled, run, skip_unless_runs_here

pytestmark = pytest.mark.slow  # collected first: see conftest.py

HEADS, HEAD_SIZE = 3, 16  # a head size both AVX2 (8) and AVX-512 (16) lanes divide
TARGETS = {8: make_target("cpu", mcpu="x86-64-v3"), 16: make_target("cpu", mcpu="x86-64-v4")}
each_lane_count = pytest.mark.parametrize("lanes", sorted(TARGETS))
MIN = float(np.finfo(np.float32).min)
PRODUCT_CPUS = {"bf16": "znver4", "amx": "sapphirerapids"}  # CPUs LLVM knows to have AVX512_BF16, AMX
# fp32 products at each vector width: SSE's (and NEON's), AVX2's, AVX-512's
KERNELS = {lanes: KernelConfig.of(target) for lanes, target in {4: make_target("cpu", mcpu="x86-64"), **TARGETS}.items()}


def _products_on(products: str) -> KernelConfig:
    """The kernels of a CPU that has `products` (PRODUCT_CPUS), with attention's products in them."""
    return KernelConfig.of(make_target("cpu", mcpu=PRODUCT_CPUS[products]), products=products)


def _attention_module(layout: str, seq, *, heads: int = HEADS, head_size: int = HEAD_SIZE, mask_rows: int = 1,
                      upper_bound: int | None = None, window: int | None = None, far_value: float = MIN,
                      score_bias: str = "") -> tvm.IRModule:
    """The attention core as the importer writes it from our wrappers: Q/K/V split from one
    concatenated projection, per-head views, scores scaled (packed: divide, as PackedBertWrapper;
    padded: multiply, as transformers' eager attention), plus an additive mask (with `window`, a sliding
    window's, as compile.families.windowed writes it), softmax, the weighted sum, and the way back to
    [rows, hidden] (packed: a scatter to the packed rows). `score_bias` added to the scaled scores before
    the mask: "shared", a [1, heads, seq, seq] input; "batched", [batch, heads, seq, seq]; "relative", a
    [2 x seq, heads] table of relative positions skewed into [1, heads, seq, seq] by views, as
    compile/families.skewed writes MPNet's."""
    op, hidden = relax.op, heads * head_size
    batch = tirx.Var("b", "int64")
    tokens = tirx.Var("t", "int64") if layout == "packed" else batch * seq
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((tokens, 3 * hidden), "float32"))
    bias = relax.Var("bias", relax.TensorType((batch, 1, mask_rows, seq), "float32"))
    params = [qkv, bias]
    if score_bias:
        shape = (2 * seq, heads) if score_bias == "relative" else (1 if score_bias == "shared" else batch, heads, seq, seq)
        params.append(relax.Var("score_bias", relax.TensorType(shape, "float32")))
    if layout == "packed":
        gather = relax.Var("gather", relax.TensorType((batch, seq), "int64"))
        scatter = relax.Var("scatter", relax.TensorType((tokens,), "int64"))
        params += [gather, scatter]
    attrs = {"tir_var_upper_bound": {seq.name: upper_bound}} if upper_bound else None
    with bb.function("main", params, attrs=attrs):
        with bb.dataflow():
            parts = bb.emit(op.split(qkv, [hidden, 2 * hidden], axis=1))
            rows = bb.emit(op.reshape(gather, (batch * seq,))) if layout == "packed" else None

            def per_head(index: int) -> relax.Var:
                x = bb.emit(relax.TupleGetItem(parts, index))
                if layout == "packed":
                    x = bb.emit(op.take(x, rows, axis=0, mode="clip"))
                else:
                    x = bb.emit(op.reshape(x, (batch, seq, hidden)))
                x = bb.emit(op.reshape(x, (batch, seq, heads, head_size)))
                return bb.emit(op.permute_dims(x, [0, 2, 1, 3]))

            q, k, v = per_head(0), per_head(1), per_head(2)
            k_t = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
            scores = bb.emit(op.matmul(bb.emit(op.reshape(q, (batch * heads, seq, head_size))),
                                       bb.emit(op.reshape(k_t, (batch * heads, head_size, seq)))))
            scores = bb.emit(op.reshape(scores, (batch, heads, seq, seq)))
            scaled = (op.divide(scores, relax.const(math.sqrt(head_size), "float32")) if layout == "packed"
                      else op.multiply(scores, relax.const(1 / math.sqrt(head_size), "float32")))
            if score_bias:
                added = _skewed(bb, params[2], heads, seq) if score_bias == "relative" else params[2]
                scaled = op.add(bb.emit(scaled), added)
            mask = bias if window is None else _windowed(bb, bias, seq, window, far_value)
            probabilities = bb.emit(op.nn.softmax(bb.emit(op.add(bb.emit(scaled), mask)), axis=-1))
            context = bb.emit(op.matmul(bb.emit(op.reshape(probabilities, (batch * heads, seq, seq))),
                                        bb.emit(op.reshape(v, (batch * heads, seq, head_size)))))
            context = bb.emit(op.permute_dims(bb.emit(op.reshape(context, (batch, heads, seq, head_size))),
                                              [0, 2, 1, 3]))
            if layout == "packed":
                context = bb.emit(op.reshape(context, (batch * seq, hidden)))
                out = bb.emit_output(op.take(context, scatter, axis=0, mode="clip"))
            else:
                out = bb.emit_output(op.reshape(context, (batch, seq, hidden)))
        bb.emit_func_output(out)
    return bb.get()


def _skewed(bb: relax.BlockBuilder, table: relax.Var, heads: int, seq) -> relax.Var:
    """[1, heads, seq, seq] of a [2 x seq, heads] table, element [0, h, i, j] its row (j - i) mod 2 x seq, by
    the views the importer writes of compile/families.skewed."""
    op = relax.op
    repeated = bb.emit(op.broadcast_to(bb.emit(op.expand_dims(bb.emit(op.permute_dims(table, [1, 0])), [1])),
                                      (heads, 2 * seq - 1, 2 * seq)))
    rows = bb.emit(op.reshape(bb.emit(op.reshape(repeated, (heads, (2 * seq - 1) * 2 * seq))),
                              (heads, 2 * seq, 2 * seq - 1)))
    sliced = bb.emit(op.strided_slice(rows, [1, 2], [0, 0], [seq, seq], [1, 1], assume_inbound=True))
    return bb.emit(op.expand_dims(sliced, [0]))


def _windowed(bb: relax.BlockBuilder, bias: relax.Var, seq, window: int, far_value: float) -> relax.Var:
    """where(|i - j| > window, min, bias) over i, j of arange(seq), as the importer writes compile.families.windowed."""
    op = relax.op
    index = bb.emit(op.arange(0, seq, 1, dtype="int64"))
    distance = bb.emit(op.abs(bb.emit(op.subtract(bb.emit(op.expand_dims(index, [1])),
                                                     bb.emit(op.expand_dims(index, [0]))))))
    far = bb.emit(op.greater(distance, relax.const(window, "int64")))
    return bb.emit(op.where(far, bb.emit(relax.const(far_value, "float32")), bias))


def _expected_module(layout: str, seq: int, lanes: int) -> tvm.IRModule:
    """What the pass makes of `_attention_module(layout, seq)`: one call of the kernel, reading
    Q, K and V from the concatenation at their offsets (padded: a view back to [batch, seq, hidden])."""
    hidden = HEADS * HEAD_SIZE
    batch = tirx.Var("b", "int64")
    tokens = tirx.Var("t", "int64") if layout == "packed" else batch * seq
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((tokens, 3 * hidden), "float32"))
    bias = relax.Var("bias", relax.TensorType((batch, 1, 1, seq), "float32"))
    params = [qkv, bias]
    if layout == "packed":
        params += [relax.Var("gather", relax.TensorType((batch, seq), "int64")),
                   relax.Var("scatter", relax.TensorType((tokens,), "int64"))]
    packed = layout == "packed"
    shape = AttentionShape(batch=tirx.Var("batch", "int64"), seq=seq, rows=tirx.Var("rows", "int64"),
                           heads=HEADS, head_size=HEAD_SIZE, max_seq=seq, scale=1 / math.sqrt(HEAD_SIZE),
                           packed=packed, widths=(3 * hidden,) * 3, offsets=(0, hidden, 2 * hidden))
    with bb.function("main", params):
        with bb.dataflow():
            kernel = bb.add_func(attention.write_attention(shape, KERNELS[lanes]), attention.KERNEL_NAME)
            args = [qkv, qkv, qkv, bias] + ([params[2]] if packed else [])
            call = relax.call_tir(kernel, args, relax.TensorType((tokens, hidden), "float32"))
            out = bb.emit_output(call if packed else relax.op.reshape(bb.emit(call), (batch, seq, hidden)))
        bb.emit_func_output(out)
    return bb.get()


# ----------------------------------------------------------------------------- the rewrite


@each_lane_count
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_attention_core_becomes_one_kernel_call(layout, lanes):
    after, fused = fuse_attention_in(_attention_module(layout, 16), KERNELS[lanes])
    assert fused == 1
    tvm.ir.assert_structural_equal(after, _expected_module(layout, 16, lanes))


@pytest.mark.parametrize("case", ["head size the lanes do not divide", "mask per query", "unbounded sequence"])
def test_attention_the_kernel_cannot_run_is_left_as_it_was(case):
    if case == "head size the lanes do not divide":
        before = _attention_module("packed", 16, heads=2, head_size=24)
    elif case == "mask per query":
        before = _attention_module("packed", 16, mask_rows=16)
    else:
        before = _attention_module("padded", tirx.Var("s", "int64"))
    after, fused = fuse_attention_in(before, KERNELS[16])
    assert fused == 0
    tvm.ir.assert_structural_equal(after, before)


def test_minilm_attention_fuses_once_per_layer_in_both_layouts(minilm_dir, minilm_imported):
    """The padded import is the session's (conftest.py: the same export, shared with the other passes' tests)."""
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(minilm_dir, "embed")
    packed = export_and_import(load_wrapper(info, "embed"), 16, info.max_seq, info.config["vocab_size"], "packed")
    for layout, imported in (("packed", packed), ("padded", minilm_imported)):
        for strategy in ("concat", "off"):  # one Q/K/V source at three offsets, or three sources
            after, fused = fuse_attention_in(apply_strategy(imported.mod, strategy), KERNELS[16])
            assert fused == 6, (layout, strategy)
            calls = [c for c in _calls(after) if c in ("relax.nn.softmax", "relax.matmul")]
            assert calls.count("relax.nn.softmax") == 0


def _calls(mod: tvm.IRModule) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


# ----------------------------------------------------------------------------- numerics


def _inputs(layout: str, seq: int, masks: np.ndarray, seed: int, head_size: int = HEAD_SIZE):
    """Random Q/K/V rows and the additive mask for `masks` [batch, seq] (1: a real token)."""
    rng = np.random.default_rng(seed)
    bias = ((1.0 - masks[:, None, None, :]) * MIN).astype("float32")
    if layout == "packed":
        _, _, _, gather, _, scatter = pack_batch(np.ones_like(masks), masks)
        qkv = rng.standard_normal((int(masks.sum()), 3 * HEADS * head_size)).astype("float32") * 2
        return [qkv, bias, gather, scatter]
    qkv = rng.standard_normal((masks.shape[0] * seq, 3 * HEADS * head_size)).astype("float32") * 2
    return [qkv, bias]


def _masks(lengths: list[int], seq: int) -> np.ndarray:
    return (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype("int64")


@each_lane_count
@pytest.mark.parametrize("layout,seq,symbolic", [("packed", 16, False), ("packed", 13, False), ("packed", 40, True),
                                                 ("padded", 16, False), ("padded", 5, False), ("padded", 24, True)])
def test_fused_kernel_equals_the_unfused_graph(layout, seq, symbolic, lanes):
    """Sequences of 1 token to the full bound (packed: right-padded, as the loader packs them), bounds
    the lanes do not divide; padded also with holes in a mask and a row of padding only (a bucket's
    unused row). Against the unfused graph, and against float64."""
    target = TARGETS[lanes]
    bound = tirx.Var("s", "int64") if symbolic else seq
    module = _attention_module(layout, bound, upper_bound=64 if symbolic else None)
    assert fuse_attention_in(module, KERNELS[lanes])[1] == 1
    built = {fused: build_scheduled(module, target, kernels=KernelConfig.of(target, fused_attention=fused))
             for fused in (False, True)}
    skip_unless_runs_here(target)
    unfused, fused = _run_unfused_and_fused(built[False], built[True], layout, seq)
    # each within 3e-6 of float64 on these inputs (logits up to ~20); the kernel's exp is base 2, the
    # graph's base e, so their rounding errors do not cancel
    np.testing.assert_allclose(fused, unfused, rtol=1e-5, atol=4e-6)
    np.testing.assert_allclose(fused, _float64_attention(layout, seq), rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("layout,symbolic,lanes", [("packed", True, 8), ("padded", False, 16)])
def test_sliding_window_kernel_equals_float64(layout, symbolic, lanes):
    """A sliding-window mask (window 5, sequences of 1 to 40 tokens: windows that reach both ends,
    several query tiles) is recognised, written into the kernel's shape, and computed as numpy does."""
    seq, target = 40, TARGETS[lanes]
    bound = tirx.Var("s", "int64") if symbolic else seq
    module = _attention_module(layout, bound, upper_bound=64 if symbolic else None, window=5)
    after, fused = fuse_attention_in(module, KERNELS[lanes])
    assert fused == 1 and "where" not in _calls(after)
    kernels = [func for func in after.functions.values() if isinstance(func, tirx.PrimFunc)]
    hidden = HEADS * HEAD_SIZE
    shape = AttentionShape(batch=tirx.Var("batch", "int64"), seq=tirx.Var("seq", "int64") if symbolic else seq,
                           rows=tirx.Var("rows", "int64"), heads=HEADS, head_size=HEAD_SIZE, max_seq=64 if symbolic
                           else seq, scale=1 / math.sqrt(HEAD_SIZE), packed=layout == "packed",
                           widths=(3 * hidden,) * 3, offsets=(0, hidden, 2 * hidden), window=5)
    tvm.ir.assert_structural_equal(kernels, [attention.write_attention(shape, KERNELS[lanes])], map_free_vars=True)
    built = build_scheduled(module, target, kernels=KernelConfig.of(target, fused_attention=True))
    skip_unless_runs_here(target)
    _, got = _run_unfused_and_fused(built, built, layout, seq)
    np.testing.assert_allclose(got, _float64_attention(layout, seq, window=5), rtol=1e-5, atol=3e-6)


def test_a_band_that_does_not_mask_is_left_as_it_was():
    """where(|i - j| > 5, 0, mask) leaves far keys in: not a sliding window, so nothing fuses."""
    module = _attention_module("packed", 16, window=5, far_value=0.0)
    assert fuse_attention_in(module, KERNELS[16])[1] == 0


def _bf16_library(module: tvm.IRModule, path, products: str = "bf16") -> tvm.runtime.Module:
    """`module` built with attention's products in bf16 (`products` "bf16": for an AVX512_BF16 CPU;
    "amx": for an AMX one), linked with the micro-kernels (skips the test where this CPU cannot run it)."""
    kernels = _products_on(products)
    target = make_target("cpu", mcpu=PRODUCT_CPUS[products])
    build_library(module, target, path, kernels=kernels)
    skip_unless_runs_here(target)
    return tvm.runtime.load_module(str(path))


@pytest.mark.parametrize("products", ["bf16", "amx"])
@pytest.mark.parametrize("layout,seq,symbolic", [("packed", 13, False), ("packed", 40, True),
                                                 ("padded", 5, False), ("padded", 24, True)])
def test_bf16_products_keep_the_unfused_graphs_answers(products, layout, seq, symbolic, tmp_path):
    """Against the unfused fp32 graph: within what rounding each operand to 8 significant bits allows.
    These inputs are harsh (logits up to ~20, peaked softmaxes, values of scale 2): 2^-9 relative per
    operand moves outputs by up to ~0.07 here, a wrong pair or key offset by ~1."""
    bound = tirx.Var("s", "int64") if symbolic else seq
    head_size = 32 if products == "amx" else HEAD_SIZE
    module = _attention_module(layout, bound, head_size=head_size, upper_bound=64 if symbolic else None)
    unfused_lib = build_scheduled(module, TARGETS[16], kernels=KernelConfig.of(TARGETS[16], fused_attention=False))
    unfused, fused = _run_unfused_and_fused(unfused_lib, _bf16_library(module, tmp_path / "fused.so", products),
                                            layout, seq, head_size)
    np.testing.assert_allclose(fused, unfused, rtol=0, atol=0.15)
    assert np.abs(fused - unfused).mean() < 0.01


@pytest.mark.parametrize("layout,symbolic", [("packed", True), ("padded", False)])
def test_bf16_products_keep_a_sliding_windows_answers(layout, symbolic, tmp_path):
    """A windowed layer in an AMX library runs on the AVX512_BF16 micro-kernels over the keys in its tiles'
    reach (window 5, 40 keys), each query's window masked: within bf16's rounding of numpy's float64."""
    seq = 40
    bound = tirx.Var("s", "int64") if symbolic else seq
    module = _attention_module(layout, bound, upper_bound=64 if symbolic else None, window=5)
    shape = AttentionShape(tirx.Var("b", "int64"), seq, tirx.Var("t", "int64"), HEADS, HEAD_SIZE, seq, 0.25,
                           layout == "packed", (3 * HEADS * HEAD_SIZE,) * 3, (0, 48, 96), window=5)
    assert attention_bf16.SCORES.format(head=HEAD_SIZE) in _extern_calls(
        attention.write_attention(shape, _products_on("amx")))
    library = _bf16_library(module, tmp_path / "fused.so")
    _, fused = _run_unfused_and_fused(library, library, layout, seq)
    expected = _float64_attention(layout, seq, window=5)
    np.testing.assert_allclose(fused, expected, rtol=0, atol=0.15)
    assert np.abs(fused - expected).mean() < 0.01


@pytest.mark.parametrize("products,head_size", [("bf16", HEAD_SIZE), ("amx", 32), ("amx", 64), ("amx", 128)])
@pytest.mark.parametrize("seq,symbolic", [(13, False), (100, True)])  # 1-7 blocks of 16 keys
def test_bf16_products_round_exactly_the_operands_they_say(products, head_size, seq, symbolic, tmp_path):
    """Against numpy doing what the module docstrings say (queries x scale, keys, values and the
    exp'd scores rounded to bf16, the exp the micro-kernels' polynomial, everything else fp32): equal
    up to fp32 summation order, on the AVX-512 micro-kernels and on AMX tiles."""
    bound = tirx.Var("s", "int64") if symbolic else seq
    library = _bf16_library(_attention_module("packed", bound, head_size=head_size,
                                              upper_bound=128 if symbolic else None), tmp_path / "fused.so", products)
    masks = _run_masks("packed", seq)
    inputs = _inputs("packed", seq, masks, seed=seq, head_size=head_size)
    qkv, gather, hidden = inputs[0], inputs[2], HEADS * head_size
    expected = np.zeros((qkv.shape[0], hidden), np.float32)
    for b, length in enumerate(masks.sum(1)):
        rows = gather[b, :length]
        for h in range(HEADS):
            columns = slice(h * head_size, (h + 1) * head_size)
            head = [qkv[rows, offset:][:, columns] for offset in (0, hidden, 2 * hidden)]
            q, k, v = _bf16(head[0] * np.float32(1 / math.sqrt(head_size))), _bf16(head[1]), _bf16(head[2])
            scores = _kernel_exp(q @ k.T - (q @ k.T).max(1, keepdims=True))
            expected[rows, h * head_size:(h + 1) * head_size] = _bf16(scores) @ v / scores.sum(1, keepdims=True)
    got = run(library, *inputs)
    # a score 1 ulp off (summation order) can round its probability the other way: one bf16 step
    # (2^-8 of it) in that query's head row; rare, so a few rows may show it, no more
    differs = np.abs(got - expected) > 1e-5
    assert differs.mean() < 0.01
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.01)


def _kernel_exp(x: np.ndarray) -> np.ndarray:
    """attention_bf16's exp, step by step in float64, where each float32 product of its fused
    multiply-adds is exact, rounded to float32 where the kernel rounds."""
    f32 = np.float32
    x = np.maximum(np.asarray(x, f32), f32(attention_bf16.EXP_FLOOR)).astype(np.float64)
    n = np.round(x * np.float64(f32(attention_bf16.EXP_LOG2E)))
    r = (x - n * np.float64(f32(attention_bf16.EXP_LN2))).astype(f32)
    p = f32(attention_bf16.EXP_POLYNOMIAL[0])
    for c in attention_bf16.EXP_POLYNOMIAL[1:]:
        p = (np.float64(p) * r + np.float64(f32(c))).astype(f32)
    return (p * np.exp2(n)).astype(f32)


def test_kernel_exp_is_exp_within_its_stated_error():
    x = -np.linspace(0, 87, 100001, dtype=np.float32)
    assert np.abs(_kernel_exp(x) / np.exp(x.astype(np.float64)) - 1).max() < 7.6e-5


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_bf16_products_run_on_the_micro_kernels():
    """A bf16 kernel calls the micro-kernels for its head size (the softmax's exp included: none is
    left in TIR), its threads claiming the tasks; the fp32 kernel's threads claim the tasks too. A head
    size they are not compiled for has no bf16 products (`Capabilities.attention_products`), and the
    kernel refuses to be written with them rather than run fp32 under their name."""
    shape = AttentionShape(tirx.Var("b", "int64"), 24, tirx.Var("t", "int64"), HEADS, HEAD_SIZE, 24, 0.25, True,
                           (3 * HEADS * HEAD_SIZE,) * 3, (0, HEADS * HEAD_SIZE, 2 * HEADS * HEAD_SIZE))
    called = _extern_calls(attention.write_attention(shape, _products_on("bf16")))
    assert {attention_bf16.SCORES.format(head=HEAD_SIZE), attention_bf16.CONTEXT.format(head=HEAD_SIZE),
            attention_bf16.QUERY_PAIRS, attention_bf16.PAIR_ROWS, attention_bf16.ROUND,
            attention_bf16.SOFTMAX_PAIRS, CLAIM} == called
    assert "scores" not in _stored(attention.write_attention(shape, _products_on("bf16")))  # no softmax pass left
    assert "scores" in _stored(attention.write_attention(shape, KERNELS[16]))
    assert _extern_calls(attention.write_attention(shape, KERNELS[16])) == {CLAIM}
    wide = dataclasses.replace(shape, head_size=48, widths=(3 * HEADS * 48,) * 3)
    assert _products_on("bf16").capabilities.attention_products(48) == ()
    with pytest.raises(ValueError, match="no bf16 products for 48-wide heads at 16 lanes"):
        attention.write_attention(wide, _products_on("bf16"))


def test_amx_products_run_on_the_tiles():
    """An "amx" kernel calls the AMX products for head sizes of whole tile rows (32, 64, 128), with
    the values transposed and the bf16 softmax between them; at a head size of 16 an AMX CPU's
    products are the AVX-512 micro-kernels' (`Capabilities.attention_products`), and the kernel
    refuses "amx" there."""
    shape = AttentionShape(tirx.Var("b", "int64"), 24, tirx.Var("t", "int64"), HEADS, 32, 24, 0.25, True,
                           (3 * HEADS * 32,) * 3, (0, HEADS * 32, 2 * HEADS * 32))
    assert _extern_calls(attention.write_attention(shape, _products_on("amx"))) == {
        attention_amx.SCORES.format(head=32), attention_amx.CONTEXT.format(head=32), attention_amx.TRANSPOSE,
        attention_bf16.QUERY_PAIRS, attention_bf16.ROUND, attention_bf16.SOFTMAX_PAIRS, CLAIM}
    narrow = dataclasses.replace(shape, head_size=HEAD_SIZE, widths=(3 * HEADS * HEAD_SIZE,) * 3,
                                 offsets=(0, HEADS * HEAD_SIZE, 2 * HEADS * HEAD_SIZE))
    assert _products_on("amx").capabilities.attention_products(HEAD_SIZE) == ("bf16", "int8")
    with pytest.raises(ValueError, match=f"no amx products for {HEAD_SIZE}-wide heads"):
        attention.write_attention(narrow, _products_on("amx"))


def _nodes(stmt, node_type) -> list:
    """Every node of `node_type` in `stmt`."""
    found = []
    tvm_ffi.structural_walk(stmt, [(node_type, found.append)])
    return found


def _stored(func: tirx.PrimFunc) -> set[str]:
    return {str(store.buffer.name) for store in _nodes(func.body, tirx.BufferStore)}


def _extern_calls(func: tirx.PrimFunc) -> set[str]:
    extern = tvm.ir.Op.get("tirx.call_extern")
    return {str(call.args[0].value) for call in _nodes(func.body, tvm.ir.Call) if call.op.same_as(extern)}


def _run_masks(layout: str, seq: int) -> np.ndarray:
    """Sequences of 1 token to the full bound; padded also with holes in a mask and a row of padding
    only (a bucket's unused row)."""
    masks = _masks([seq, 1, seq // 2 + 1, 3], seq)
    if layout == "padded":
        masks[2, 1] = masks[2, 3] = 0  # holes before the last real token count like any masked key
        masks[3, :] = 0  # padding only
    return masks


def _read_rows(masks: np.ndarray, seq: int) -> np.ndarray:
    """The padded layout's rows any output reads: the kernel zeroes those past a sequence's last real token."""
    last = seq - np.argmax(masks[:, ::-1], axis=1)  # one past each row's last real token
    return (np.arange(seq)[None, :] < last[:, None]) & masks.any(1)[:, None]


def _run_unfused_and_fused(unfused_lib, fused_lib, layout: str, seq: int,
                           head_size: int = HEAD_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Both libraries' outputs on `_run_masks`' sequences, on the rows any output reads."""
    masks = _run_masks(layout, seq)
    inputs = _inputs(layout, seq, masks, seed=seq, head_size=head_size)
    unfused, fused = (run(lib, *inputs) for lib in (unfused_lib, fused_lib))
    if layout == "padded":
        real = _read_rows(masks, seq)
        unfused, fused = unfused[real], fused[real]
    return unfused, fused


def _float64_attention(layout: str, seq: int, window: int | None = None,
                       score_bias: np.ndarray | None = None) -> np.ndarray:
    """What `_run_unfused_and_fused` compares, computed in float64 by numpy: per sequence and head,
    softmax(q k^T / sqrt(d) (+ the sequence's score bias [heads, seq, seq]) + the mask's bias) v (with
    `window`, keys farther from the query masked too)."""
    masks = _run_masks(layout, seq)
    inputs = _inputs(layout, seq, masks, seed=seq)
    qkv, hidden = inputs[0].astype(np.float64), HEADS * HEAD_SIZE

    def attend(rows: np.ndarray, real_keys: np.ndarray, b: int) -> np.ndarray:
        q, k, v = (rows[:, part * hidden:(part + 1) * hidden].reshape(len(rows), HEADS, HEAD_SIZE).transpose(1, 0, 2)
                   for part in range(3))
        index = np.arange(len(rows))
        near = np.abs(index[:, None] - index[None, :]) <= (len(rows) if window is None else window)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(HEAD_SIZE) + np.where(real_keys & near, 0.0, MIN)
        if score_bias is not None:
            scores = scores + score_bias[b % len(score_bias), :, :len(rows), :len(rows)]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return (weights / weights.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(len(rows), hidden)

    if layout == "packed":
        out, gather = np.zeros((len(qkv), hidden)), inputs[2]
        for b, length in enumerate(masks.sum(1)):
            rows = gather[b, :length]
            out[rows] = attend(qkv[rows], np.ones(length, bool), b)
        return out
    out = np.stack([attend(qkv[b * seq:(b + 1) * seq], masks[b].astype(bool), b) for b in range(len(masks))])
    return out[_read_rows(masks, seq)]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_each_task_reads_its_keys_and_values_once_not_per_query_tile(layout):
    """K and V are staged per (sequence, head) into contiguous buffers, which the products of every
    query tile read at fixed strides: no load of the source tensors is left in the loop over tiles
    (there each key cost a clamped row gather per tile)."""
    packed, hidden, batch = layout == "packed", HEADS * HEAD_SIZE, tirx.Var("b", "int64")
    rows = tirx.Var("t", "int64") if packed else batch * 24
    shape = AttentionShape(batch, 24, rows, HEADS, HEAD_SIZE, 24, 0.25, packed, (3 * hidden,) * 3,
                           (0, hidden, 2 * hidden))
    func = attention.write_attention(shape, KERNELS[16])

    def loaded(stmt) -> set[str]:
        return {str(load.source.name) for load in _nodes(stmt, tvm.ir.expr.TensorLoad)}

    tiles = [loop for loop in _nodes(func.body, tirx.For) if loop.loop_var.name == "tile"]
    assert tiles and {"k_src", "v_src"} <= loaded(func.body)
    for tile in tiles:
        assert {"keys", "values"} <= loaded(tile) and not {"k_src", "v_src"} & loaded(tile)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@each_lane_count
def test_each_output_row_is_written_as_whole_vectors(layout, lanes):
    """softmax x V accumulates a few queries' rows with the head's dims in the lanes, so every
    output element is stored by a vectorised loop over consecutive columns (not one lane of a
    query vector at a time, a transposed scalar write of each row)."""
    packed, hidden, batch = layout == "packed", HEADS * HEAD_SIZE, tirx.Var("b", "int64")
    rows = tirx.Var("t", "int64") if packed else batch * 24
    shape = AttentionShape(batch, 24, rows, HEADS, HEAD_SIZE, 24, 0.25, packed, (3 * hidden,) * 3,
                           (0, hidden, 2 * hidden))
    func = attention.write_attention(shape, KERNELS[lanes])

    def output_stores(stmt) -> list:
        return [store for store in _nodes(stmt, tirx.BufferStore)
                if store.buffer.name == "out" and not isinstance(store.value, tirx.FloatImm)]

    vector_written = [store for loop in _nodes(func.body, tirx.For) if loop.kind == tirx.ForKind.VECTORIZED
                      for store in output_stores(loop.body)
                      if any(v.same_as(loop.loop_var) for v in tirx.analysis.undefined_vars(store.indices[-1]))]
    stores = output_stores(func.body)
    assert stores and all(any(store.same_as(v) for v in vector_written) for store in stores)


@pytest.mark.parametrize("lanes,head_size,passes", [
    (8, 32, [(6, 16), (5, 16), (5, 16)] * 2),  # 16 queries a tile, half a head a pass
    (8, 64, [(6, 16), (5, 16), (5, 16)] * 4),
    (16, 32, [(11, 32), (11, 32), (10, 32)]),  # 32 queries, the whole head
    (4, 32, [(4, 8)] * 4),  # 4 queries (the SSE and NEON tile), 2 of the head's 8 vectors a pass
])
def test_softmax_times_values_passes_fill_the_register_budget(lanes, head_size, passes):
    """Each pass of the softmax x V product accumulates a few queries x 2 vectors of dims: at most 12
    vectors with 16 registers, 24 with AVX-512's 32, the tile's queries shared out evenly (no pass is
    left with a few accumulators), and together the passes cover every query's head row once."""
    shape = AttentionShape(1, 40, 40, 2, head_size, 40, 0.25, False, (3 * 2 * head_size,) * 3,
                           (0, 2 * head_size, 4 * head_size))
    func = attention.write_attention(shape, KERNELS[lanes])
    parts = [loop for loop in _nodes(func.body, tirx.For) if loop.loop_var.name == "part"]
    assert len(parts) == 2  # the parallel loop over (sequence, head) tasks and its serial twin
    for part in parts:
        accumulated = []
        for group in (loop for loop in _nodes(part.body, tirx.For) if loop.loop_var.name == "group"):
            (accumulator,) = {tuple(int(x) for x in store.buffer.shape)
                              for store in _nodes(group.body, tirx.BufferStore) if store.buffer.name == "context"}
            accumulated += [accumulator] * (int(part.extent) * int(group.extent))
        assert sorted(accumulated) == sorted(passes)


def test_a_kernel_is_written_once_per_process_for_each_shape_and_products():
    """Parsing the kernel's script takes seconds and a compile asks for it per library: the same sizes
    (vars by name), lanes and products give the same PrimFunc, equal to a parse with the caller's own
    vars; other sizes or products another; sizes given as expressions of a var are written each time
    (a cached kernel's vars are its own, so an expression of the caller's would not refer to them)."""
    hidden = HEADS * HEAD_SIZE

    def shape(seq, packed=True):
        batch = tirx.Var("b", "int64")
        return AttentionShape(batch, seq, tirx.Var("t", "int64") if packed else batch * seq, HEADS, HEAD_SIZE, 40,
                              0.25, packed, (3 * hidden,) * 3, (0, hidden, 2 * hidden))

    kernel, again = attention.write_attention(shape(24), KERNELS[16]), shape(24)
    assert attention.write_attention(again, KERNELS[16]) is kernel
    tvm.ir.assert_structural_equal(kernel, attention._write_attention(again, 16, "fp32"), map_free_vars=True)
    assert attention.write_attention(again, _products_on("bf16")) is not kernel
    assert attention.write_attention(shape(32), KERNELS[16]) is not kernel
    padded = shape(24, packed=False)
    assert attention.write_attention(padded, KERNELS[16]) is not attention.write_attention(padded, KERNELS[16])


# ----------------------------------------------------------------------------- a score bias


def _relative_score_bias(seq: int, batch: int, seed: int) -> np.ndarray:
    """[batch, HEADS, seq, seq]: per head a table by the relative position j - i in MPNet's 32 buckets
    (max distance 128: positions further apart share the last bucket), a different table per sequence
    where `batch` > 1; large enough to move the softmax."""
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    relative = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    buckets = MPNetEncoder.relative_position_bucket(relative).numpy()
    tables = np.random.default_rng(seed).standard_normal((batch, HEADS, 32)).astype("float32") * 3
    return tables[:, :, buckets]


# (layout, bound, the score bias's kind), each arithmetic of the products (mcpu, products) in one of them
def _relative_table(seq: int, seed: int) -> np.ndarray:
    """[2 x seq, HEADS]: row r the score bias of relative position r (r < seq), r - 2 x seq (from seq on), by
    MPNet's buckets."""
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    rows = np.arange(2 * seq)
    buckets = MPNetEncoder.relative_position_bucket(torch.from_numpy(np.where(rows < seq, rows, rows - 2 * seq)))
    return (np.random.default_rng(seed).standard_normal((32, HEADS)).astype("float32") * 3)[buckets.numpy()]


SCORE_BIAS_CASES = {"fp32 x86-64-v4": ("packed", 150, "relative", "x86-64-v4", "fp32"),
                    "fp32 x86-64-v3": ("padded", 20, "batched", "x86-64-v3", "fp32"),
                    "bf16": ("padded", 20, "relative", "znver4", "bf16"),
                    "int8 x86-64-v3": ("packed", 150, "shared", "x86-64-v3", "int8"),
                    "int8 x86-64-v4": ("padded", 20, "relative", "x86-64-v4", "int8")}


@pytest.mark.parametrize("case", SCORE_BIAS_CASES)
def test_a_score_bias_is_read_per_sequence_head_query_and_key(case, tmp_path):
    """The fused kernel adds a score bias to each sequence's scores by its own query and key positions
    (packed: never another sequence's), in every arithmetic of the products, read from a table of relative
    positions through its proved views (which are dropped) or from [1 or batch, heads, seq, seq]; against
    numpy in float64. 150 positions reach relative distances past MPNet's 128 (its last bucket)."""
    layout, seq, kind, mcpu, arithmetic = SCORE_BIAS_CASES[case]
    bound = tirx.Var("s", "int64")
    module = _attention_module(layout, bound, upper_bound=160, score_bias=kind)
    target = make_target("cpu", mcpu=mcpu)
    kernels = KernelConfig.of(target, products=arithmetic)
    after, fused = fuse_attention_in(module, kernels)
    assert fused == 1 and not {"relax.nn.softmax", "relax.strided_slice", "relax.broadcast_to"} & set(_calls(after))
    [kernel] = [f for f in after.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert [str(p.name) for p in kernel.params][4] == "score_bias"
    assert len(kernel.params[4].shape) == (2 if kind == "relative" else 4)
    build_library(module, target, tmp_path / "fused.so", kernels=kernels)
    skip_unless_runs_here(target)
    masks = _run_masks(layout, seq)
    inputs = _inputs(layout, seq, masks, seed=seq)
    score_bias = _relative_score_bias(seq, len(masks) if kind == "batched" else 1, seed=seq)
    given = _relative_table(seq, seed=seq) if kind == "relative" else score_bias
    if kind == "relative":
        score_bias = given[(np.arange(seq)[None, :] - np.arange(seq)[:, None]) % (2 * seq)].transpose(2, 0, 1)[None]
    got = run(tvm.runtime.load_module(str(tmp_path / "fused.so")), *inputs[:2], given, *inputs[2:])
    expected = _float64_attention(layout, seq, score_bias=score_bias)
    if layout == "padded":
        got = got[_read_rows(masks, seq)]
    # fp32: summation order; bf16: as test_bf16_products_keep_the_unfused_graphs_answers; int8: these harsh
    # inputs' error without a score bias too (a mean of 0.019, the largest 0.24)
    atol, mean = {"fp32": (3e-5, 1e-6), "int8": (0.3, 0.02)}.get(arithmetic, (0.15, 0.01))
    np.testing.assert_allclose(got, expected, rtol=1e-5 if arithmetic == "fp32" else 0, atol=atol)
    assert np.abs(got - expected).mean() < mean
    unbiased = _float64_attention(layout, seq)
    assert np.abs(unbiased - expected).mean() > 0.1  # the bias matters
