"""The int8 kernels (compile/kernels/int8.py) against numpy: the four matmul micro-kernels (AVX2 and
AVX-512BW vpmaddubsw + vpmaddwd, AVX-VNNI and AVX-512 VNNI vpdpbusd) with their epilogue, at static
and symbolic row counts (ragged ones included). Each kernel is compiled for a CPU that has it
(x86-64-v3; x86-64-v4, AVX-512 without VNNI; alderlake, AVX-VNNI without AVX-512; cascadelake, the
first with AVX-512 VNNI) on any machine, and run where this CPU has its features."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm_ffi
from tvm import relax, s_tir, te, tirx
from tvm.sym import Analyzer

from compile.build import make_target
from compile.capabilities import Capabilities
from compile.int8_simulation import weight_scales
from compile.kernels import int8, row_quantize
from compile.passes.quantize import weight_scales as weight_scales_pass
from tests.support.kernels import int8_linear_inputs, int8_weight_operands, prefetch_guards, prefetched_addresses
from tests.support.tvm_run import build_kernel, build_reference, call_kernel, run, skip_unless_runs_here

pytestmark = pytest.mark.slow  # collected first: see conftest.py

TARGET = make_target("cpu", "sm_90", None)
KERNEL_TARGETS = {int8.AVX2: make_target("cpu", mcpu="x86-64-v3"), int8.AVX_VNNI: make_target("cpu", mcpu="alderlake"),
                  int8.VNNI: make_target("cpu", mcpu="cascadelake"),
                  int8.AVX512BW: make_target("cpu", mcpu="x86-64-v4")}
each_kernel = pytest.mark.parametrize("kernel", list(KERNEL_TARGETS), ids=lambda kernel: kernel.name)
# every panel width each kernel reads: VNNI's wide one (48 columns) beside its 32
each_layout = pytest.mark.parametrize("kernel,panel", [
    (kernel, width) for kernel in KERNEL_TARGETS for width in (kernel.panel, kernel.wide_panel) if width],
    ids=lambda value: value.name if isinstance(value, int8.Int8Kernel) else str(value))


def _build(func, schedule, target):
    sch = schedule(func)
    assert sch is not None
    lib = build_kernel(sch.mod, target)
    skip_unless_runs_here(target)
    return lib


def _quantized_weight(n: int, k: int, seed: int, kernel: int8.Int8Kernel, panel: int | None = None):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) * 0.05).astype("float32")
    scale = weight_scales(torch.from_numpy(weight), kernel.int16_pairs).numpy()[:, 0]
    quantized = np.round(weight / scale[:, None]).astype(np.int8)
    return (weight, quantized, scale.astype("float32"), *int8_weight_operands(quantized, kernel, panel))


def _pass_weight_scales(weight: np.ndarray, kernel: int8.Int8Kernel) -> np.ndarray:
    """compile/passes/quantize.py's weight scales of `weight`, built and run."""
    n, k = weight.shape
    builder = relax.BlockBuilder()
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with builder.function("main", [w]):
        with builder.dataflow():
            scales = builder.emit_output(builder.normalize(weight_scales_pass(w, n, k, kernel)))
        builder.emit_func_output(scales)
    return run(build_reference(builder.get()), weight)


@pytest.mark.parametrize("kernel", [int8.AVX2, int8.VNNI], ids=lambda kernel: kernel.name)
def test_weight_scales_bound_avx2_pairs_and_keep_eight_bits_elsewhere(kernel):
    """The compile scales each output channel (the pass's Relax, the same as the simulation's PyTorch).
    For AVX2, every pair of one channel's codes of one sign sums to at most `PAIR_CODES`, the bound its
    kernel is exact at (test_avx2_kernels.py); a channel whose largest weight stands alone in its pair
    keeps all 8 bits (127 codes, where 7-bit weights gave it 63), and one whose two largest weights of
    one sign are a pair gets half its range. Kernels that sum in int32 map the largest |w| onto 127."""
    rng = np.random.default_rng(3)
    n, k = 6, 64
    weight = (rng.standard_normal((n, k)) * 0.05).astype("float32")
    weight[0, 10], weight[0, 11] = 1.0, -0.01  # an outlier beside a small weight of the other sign
    weight[1, 20], weight[1, 21] = 1.0, 0.9  # two large weights of one sign in one pair
    weight[2, 30], weight[2, 31] = -1.0, -1.0
    scales = _pass_weight_scales(weight, kernel)
    np.testing.assert_allclose(scales, weight_scales(torch.from_numpy(weight), kernel.int16_pairs).numpy()[:, 0],
                               rtol=1e-6)
    codes = np.round(weight / scales[:, None])
    if not kernel.int16_pairs:
        assert (np.abs(codes).max(axis=1) == int8.WEIGHT_CODES).all()
        return
    pairs = codes.reshape(n, k // 2, 2)
    assert np.maximum(np.clip(pairs, 0, None).sum(-1), np.clip(-pairs, 0, None).sum(-1)).max() <= int8.PAIR_CODES
    assert codes[0, 10] == int8.WEIGHT_CODES  # 8 bits
    assert codes[1, 20] == round(127 / 1.9) and codes[2, 30] == -64  # the pair's sum onto 127


def test_the_best_kernel_the_cpu_runs_is_chosen():
    assert Capabilities.of(KERNEL_TARGETS[int8.VNNI]).int8_kernel is int8.VNNI
    assert Capabilities.of(KERNEL_TARGETS[int8.AVX2]).int8_kernel is int8.AVX2
    assert Capabilities.of(KERNEL_TARGETS[int8.AVX_VNNI]).int8_kernel is int8.AVX_VNNI  # AVX-VNNI without AVX-512
    assert Capabilities.of(KERNEL_TARGETS[int8.AVX512BW]).int8_kernel is int8.AVX512BW  # AVX-512 without VNNI
    assert Capabilities.of(make_target("cpu", mcpu="skylake-avx512")).int8_kernel is int8.AVX512BW
    assert Capabilities.of(make_target("cpu", mcpu="x86-64")).int8_kernel is None  # no AVX2


@each_layout
@pytest.mark.parametrize("rows", [8, 13, "symbolic"])
def test_matmul_with_bias_epilogue_matches_numpy(rows, kernel, panel):
    n, k = 2 * panel, 48
    m = tirx.Var("m", "int64") if rows == "symbolic" else rows
    inputs = int8_linear_inputs(m, n, k, kernel, panel)
    bias = te.placeholder((n,), "float32", name="bias")
    y = int8.int8_matmul_te(*inputs)
    out = te.compute(y.shape, lambda i, j: y[i, j] + bias[j], name="add_bias")
    lib = _build(te.create_prim_func([*inputs, bias, out]), lambda f: int8.schedule_int8_matmul(f, kernel),
                 KERNEL_TARGETS[kernel])

    _, quantized, w_scale, packed, column_sum = _quantized_weight(n, k, 1, kernel, panel)
    rng = np.random.default_rng(2)
    count = 21 if rows == "symbolic" else rows
    codes = rng.integers(0, 256, (count, k))
    zero = rng.integers(0, 256, count).astype(np.int32)  # each row its own zero point
    x_scale = rng.uniform(0.01, 0.1, count).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    given = [codes.astype(int8.ACTIVATION), x_scale, zero, packed, w_scale, column_sum, b]
    (result,) = call_kernel(lib, given, [((count, n), "float32")])
    exact = ((codes - zero[:, None]) @ quantized.T.astype(np.int64)).astype(np.float64)
    np.testing.assert_allclose(result, exact * x_scale[:, None] * w_scale[None, :] + b, rtol=1e-5, atol=1e-5)


def test_panels_are_vnni_wide_where_n_allows_and_no_amx_tile_reads_them():
    """VNNI's linears take 48-column panels (8 rows x 3 zmm: 24 accumulators) where N is a multiple of
    48, else 32; on a CPU with AMX its tiles read the panels, 32 columns. AVX2 reads 16 (the register
    file holds no more, `test_no_register_of_the_k_loop_is_spilled_to_the_stack`), AVX-VNNI 24."""
    assert int8.panel_width(int8.VNNI, 1152, amx_tiles=False) == 48
    assert int8.panel_width(int8.VNNI, 1024, amx_tiles=False) == 32  # bert-large's width: 48 does not divide it
    assert int8.panel_width(int8.VNNI, 1152, amx_tiles=True) == 32
    assert int8.panel_width(int8.AVX512BW, 1152, amx_tiles=False) == 48  # VNNI's panels, AVX2's arithmetic
    assert int8.panel_width(int8.AVX2, 1152, amx_tiles=False) == 16
    assert int8.panel_width(int8.AVX_VNNI, 1152, amx_tiles=False) == 24


@pytest.mark.parametrize("panel", [32, 48])
def test_vnni_tile_keeps_a_zmm_accumulator_per_rows_x_panel_vectors(panel):
    """The register tile is 8 rows x panel / 16 zmm: every vpdpbusd of the k loop accumulates into its
    own zmm (16 with 32-column panels, 24 with 48), none spilled to the stack."""
    kernel, target = int8.VNNI, KERNEL_TARGETS[int8.VNNI]
    inputs = int8_linear_inputs(tirx.Var("m", "int64"), 2 * panel, 64, kernel, panel)
    sch = int8.schedule_int8_matmul(te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)]), kernel)
    asm = build_kernel(sch.mod, target).mod.inspect_source("asm")
    products = re.findall(r"^\s+vpdpbusd\s+(.*)$", asm, re.MULTILINE)
    assert products and all(operands.split(",")[-1].strip().startswith("%zmm") for operands in products)
    assert len({operands.split(",")[-1].strip() for operands in products}) == kernel.rows * panel // kernel.lanes


@each_layout
def test_no_register_of_the_k_loop_is_spilled_to_the_stack(kernel, panel):
    """Every tile's accumulators, weight vectors, broadcast and product fit the register file: nothing is
    reloaded from the stack. AVX2's `vpmaddubsw` + `vpmaddwd` needs a product and the ones vector beside
    them, so 16 ymm hold 4 x 16 (8 accumulators, 2 weight vectors), not the fp32 kernel's 4 x 24, whose 12
    accumulators and 3 weight vectors spilled two accumulators at every k step."""
    inputs = int8_linear_inputs(tirx.Var("m", "int64"), 2 * panel, 64, kernel, panel)
    sch = int8.schedule_int8_matmul(te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)]), kernel)
    asm = build_kernel(sch.mod, KERNEL_TARGETS[kernel]).mod.inspect_source("asm")
    assert re.findall(r"^\s+(?:\{vex\}\s+)?vp(?:dpbusd|maddubsw)\s", asm, re.MULTILINE)
    assert re.findall(r"^\s+v\w+\s+-?\d*\(%rsp\), %[yz]mm\d+", asm, re.MULTILINE) == []


@each_kernel
def test_each_k_step_prefetches_the_same_step_of_the_next_weight_panel(kernel):
    """Every 64-byte line of step k of panel `tile + 1` (`panel` x `group` bytes), the panel index
    wrapping at the last: the hardware prefetcher cannot know which panel a thread reads next. Only
    the panel's first tile of rows issues them: the later ones find the panel in L2."""
    n, k = 3 * kernel.panel, 64
    inputs = int8_linear_inputs(tirx.Var("m", "int64"), n, k, kernel)
    func = int8.schedule_int8_matmul(te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)]), kernel).mod["main"]
    addresses = prefetched_addresses(func)
    lines = kernel.panel * kernel.group // 64 + (kernel.panel * kernel.group % 64 > 0)
    assert len(addresses) == lines
    assert [column * kernel.group + byte for _, _, column, byte in addresses] == list(range(0, 64 * lines, 64))
    for panel, step, _, _ in addresses:
        assert isinstance(panel, tirx.FloorMod) and int(panel.b) == n // kernel.panel and int(panel.a.b) == 1
        assert isinstance(step, tirx.Var)
    rows = func.params[0].shape[0]
    for loop in prefetch_guards(func):  # the loop over tiles of `kernel.rows` rows
        assert loop is not None and loop.kind == tirx.ForKind.SERIAL
        assert Analyzer().can_prove_equal(loop.extent, (rows + kernel.rows - 1) // kernel.rows)


@each_kernel
def test_rows_past_the_tile_are_read_clamped_not_copied(kernel):
    """A symbolic row count is padded to whole tiles without a padded copy of the activations (a pass
    and a thread-pool launch per call): each micro-kernel call reads row min(i, M - 1) itself. The
    numbers at ragged and symbolic rows are `test_matmul_with_bias_epilogue_matches_numpy`'s."""
    inputs = int8_linear_inputs(tirx.Var("m", "int64"), 2 * kernel.panel, 64, kernel)
    func = int8.schedule_int8_matmul(te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)]), kernel).mod["main"]
    xq = func.params[0]
    blocks = []
    tvm_ffi.structural_walk(func, [(s_tir.SBlock, blocks.append)])
    assert not [block.name_hint for block in blocks if any(w.source.same_as(xq) for w in block.reads)
                and not block.match_buffers]  # nothing but the micro-kernel calls reads the activations
    rows = [match.source.region[0].min for block in blocks for match in block.match_buffers
            if match.source.source.same_as(xq)]
    assert rows and all(isinstance(row, tirx.Min) and tvm_ffi.structural_equal(row.b, xq.shape[0] - 1) for row in rows)


@each_kernel
def test_quantized_linear_is_close_to_fp32(kernel):
    """End to end on random data: per-row x per-channel int8 keeps the product within ~1% of fp32."""
    n, k, count = 3 * kernel.panel, 64, 7
    weight, _, w_scale, packed, column_sum = _quantized_weight(n, k, 4, kernel)
    x = np.random.default_rng(5).standard_normal((count, k)).astype("float32")
    target = KERNEL_TARGETS[kernel]
    m = tirx.Var("m", "int64")
    xt = te.placeholder((m, k), "float32", name="x")
    outputs = row_quantize.quantize_rows_te(xt)
    quant = _build(te.create_prim_func([xt, *outputs]), lambda f: row_quantize.schedule_row_quantize(
        f, Capabilities.of(target).lanes), target)
    rows = call_kernel(quant, [x], [((count, k), "uint8"), ((count,), "float32"), ((count,), "int32")])

    inputs = int8_linear_inputs(m, n, k, kernel)
    matmul = _build(te.create_prim_func([*inputs, int8.int8_matmul_te(*inputs)]),
                    lambda f: int8.schedule_int8_matmul(f, kernel), target)
    (y,) = call_kernel(matmul, [*rows, packed, w_scale, column_sum], [((count, n), "float32")])
    reference = x @ weight.T
    assert np.abs(y - reference).max() < 0.02 * np.abs(reference).max()


# ----------------------------------------------------------------------------- compile and serve

UNSEEN = ["Where can I buy fresh bread on Sunday morning?", "The orchestra rehearsed the symphony twice.",
          "A sudden storm forced the sailors back to the harbour before dawn.",
          "Quantum computers may one day break today's public-key cryptography, so standards bodies are "
          "already choosing algorithms that resist them.", "tiny input"]


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    """A tiny sentence embedder whose every linear fits both kernels' panels (widths multiples of 24
    and 32), with heads of 16 (attention fused for either lane count)."""
    from tests.support.checkpoints import save_tiny_sentence_transformer

    return save_tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-int8"), seed=7, config={
        "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6})


@pytest.fixture(scope="module", params=["packed", "padded"])
def int8_artifact(request, int8_checkpoint, tmp_path_factory):
    """Both layouts: packed libraries quantize a symbolic token count, padded buckets static rows
    (1 x 5 = 5 rows: not a multiple of the kernel's 4, so padded inside the kernel). Attention's
    products are asked for (fp32): what is tested is the int8 linears, not which kernel timed fastest."""
    from tests.support.artifacts import compile_artifact

    out = tmp_path_factory.mktemp("artifacts") / f"tiny-int8-{request.param}"
    buckets = ["packed-16"] if request.param == "packed" else ["1x5", "4x16"]
    compile_artifact(int8_checkpoint, out, buckets, layout=request.param, precision="int8", attention_products="fp32",
                     generic_shapes=["3x20"])
    return out


def test_int8_artifact_ships_int8_weights_and_its_accuracy(int8_artifact):
    from safetensors.numpy import load_file

    from artifact.manifest import Manifest

    manifest = Manifest.read(int8_artifact)
    assert manifest.quantization.linears == 2 * 4  # per layer: Q/K/V (concatenated), output, two FFN
    assert manifest.quantization.kernel == Capabilities.of(TARGET).linears_kernel("int8")  # the best this CPU runs
    assert manifest.quantization.sentences > 20 and manifest.quantization.cosine_min >= 0.99
    assert "QuantizeLinearsInt8" in manifest.passes.strategies["concat"].pipeline
    weights = load_file(str(int8_artifact / manifest.weights["concat"].file))
    assert sum(1 for w in weights.values() if w.dtype == np.int8) == 8


def test_served_int8_embeddings_match_fp32_sentence_transformers(serve, int8_artifact, int8_checkpoint):
    import httpx
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(int8_checkpoint), device="cpu").encode(UNSEEN, normalize_embeddings=True)
    with serve([int8_artifact]) as server:
        served = np.asarray(httpx.post(f"{server.url}/embed", json={"inputs": UNSEEN}, timeout=60).json())
        info = httpx.get(f"{server.url}/info").json()
    assert info["model_dtype"] == "int8" and info["models"][0]["quantization"]["linears"] == 8
    cosine = np.sum(served * expected, axis=1)
    assert cosine.min() >= 0.99, cosine


def test_int8_compile_fails_under_min_cosine_and_leaves_nothing(int8_checkpoint, tmp_path):
    from compile.errors import ValidationError
    from tests.support.artifacts import compile_artifact

    # the plan keeps linears out of int8 until the simulation keeps the floor: here that is every one.
    # Attention's products are asked for (fp32): timing the kernels would not change the refusal.
    with pytest.raises(ValidationError, match=r"^--precision int8: int8 cannot keep --min-cosine 1 with any linear "
                                              r"in int8 \(simulated on the shipped sentences\); use"):
        compile_artifact(int8_checkpoint, tmp_path / "out", ["packed-16"], layout="packed", precision="int8",
                         min_cosine=1.0, attention_products="fp32", generic_shapes=["3x20"])
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def int8_classifier(tmp_path_factory):
    """A tiny 3-label BertForSequenceClassification whose linears fit both kernels' panels."""
    import torch
    from transformers import BertForSequenceClassification

    from loadtest.random_checkpoint import copy_tokenizer
    from tests.support.checkpoints import TINY_LABELS, tiny_config

    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("tiny-int8-classifier")
    config = tiny_config(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_labels=3,
                          id2label=TINY_LABELS, label2id={v: k for k, v in TINY_LABELS.items()},
                          architectures=["BertForSequenceClassification"])
    BertForSequenceClassification(config).save_pretrained(directory)
    copy_tokenizer(directory)
    return directory


def test_int8_classifier_keeps_fp32_top1_labels(serve, int8_classifier, tmp_path):
    """The compile stage records top-1 agreement on the shipped sentences; served labels on sentences
    it has not seen are PyTorch fp32's (attention's products asked for in fp32: the linears are tested)."""
    import httpx
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from tests.support.artifacts import compile_artifact

    manifest, _ = compile_artifact(int8_classifier, tmp_path / "int8-classifier", ["packed-16"],
                                   task="classify", layout="packed", precision="int8", attention_products="fp32",
                                   generic_shapes=["3x20"])
    assert manifest.quantization.top1_agreement == 1.0 and manifest.quantization.max_probability_diff < 0.05
    model = BertForSequenceClassification.from_pretrained(int8_classifier).eval()
    batch = AutoTokenizer.from_pretrained(int8_classifier)(UNSEEN, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = [model.config.id2label[int(i)] for i in model(**batch).logits.argmax(dim=1)]
    with serve([tmp_path / "int8-classifier"]) as server:
        answers = httpx.post(f"{server.url}/predict", json={"inputs": [[text] for text in UNSEEN]}, timeout=60).json()
    assert [max(ranks, key=lambda r: r["score"])["label"] for ranks in answers] == expected
