"""bf16 linears (`--precision bf16`) and the compile stage's choice of precision (`--precision auto`).

bf16 keeps 8 significant bits of each operand and sums in fp32, so a product of K terms is off by
about 2^-9 relative per operand: the kernel tests compare with fp32 sums of the same bf16-rounded
operands (which the kernel must match to fp32 rounding, 1e-5 relative), and the model tests with
PyTorch fp32 by direction (cosine >= 0.999, the gate auto holds bf16 to). Execution needs a CPU
with AVX512_BF16 and skips elsewhere; code generation and the refusals are tested on every CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import te

from artifact import cpu_features
from artifact.cpu_features import FEATURES, linux_flag
from artifact.errors import ArtifactError
from artifact.loader import load_artifact
from compile.build import make_target
from compile.capabilities import Capabilities
from compile.kernels import amx, attention_bf16, bf16
from compile.kernels.linking import linked_objects
from compile.precision import GATES, Measured, choose
from tests.support.tvm_run import build_kernel, call_kernel

pytestmark = pytest.mark.slow  # collected first: see conftest.py

HOST = make_target("cpu")
BF16_CPU = "znver4"  # a CPU LLVM knows to have AVX512_BF16: code is generated for it on any host


def _i64(value: int) -> tvm.tirx.IntImm:
    return tvm.tirx.IntImm("int64", value)


def _schedule_linear(m: int | None, n: int, k: int, amx_tiles: bool = False):
    """bf16 activations x bf16 panels + bias, scheduled (on AMX tiles where `amx_tiles`)."""
    rows = _i64(m) if m is not None else tvm.tirx.Var("m", "int64")
    x = te.placeholder((rows, _i64(k)), bf16.STORAGE, name="x")
    panels = te.placeholder((n // bf16.PANEL, k // bf16.PAIR, bf16.PANEL, bf16.PAIR), bf16.STORAGE, name="p")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    product = bf16.bf16_matmul_te(x, panels)
    y = te.compute(product.shape, lambda i, j: product[i, j] + bias[j], name="T_add")
    sch = bf16.schedule_bf16_matmul(te.create_prim_func([x, panels, bias, y]), amx_tiles)
    assert sch is not None
    return sch


def _build_linear(m: int | None, n: int, k: int, target, path, amx_tiles: bool = False):
    """`_schedule_linear`'s function exported with the micro-kernels."""
    sch = _schedule_linear(m, n, k, amx_tiles)
    library = build_kernel(sch.mod, target)
    library.export_library(str(path), addons=linked_objects(sch.mod))
    return path


def _panels(weight: np.ndarray) -> np.ndarray:
    n, k = weight.shape
    bits = weight.astype(ml_dtypes.bfloat16).view(np.uint16)
    return bits.reshape(n // bf16.PANEL, bf16.PANEL, k // bf16.PAIR, bf16.PAIR).transpose(0, 2, 1, 3).copy()


def test_the_tile_is_vdpbf16ps_in_the_library(tmp_path):
    target = make_target("cpu", mcpu=BF16_CPU)
    library = _build_linear(16, 64, 48, target, tmp_path / "linear.so")
    assembly = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    tile = assembly[assembly.index(f"<{bf16.TILE_SYMBOL}>:"):]
    tile = tile[:tile.index("\n\n")]
    # per k pair: 8 rows x 2 panel halves, every accumulator a zmm register (no fp32 FMA fallback)
    assert tile.count("vdpbf16ps") == bf16.ROWS * 2 and "%zmm" in tile
    assert re.search(rf"call\s.*<{bf16.TILE_SYMBOL}", assembly)  # the matmul runs its tiles through it


@pytest.mark.parametrize("amx_tiles", [False, True])
def test_tile_calls_zero_nothing_first_and_the_threads_claim_their_panels(amx_tiles):
    """Each tile writes its whole output block (`c = a x b`): the matched reduction's init, which
    tensorize keeps and LLVM makes a memset before every call, is dropped. The threads take the
    panels as they come free (compile/kernels/launch.py's claims)."""
    from compile.kernels.launch import CLAIM

    script = _schedule_linear(None, 64, 64, amx_tiles).mod.script()
    assert (amx.BF16.symbol if amx_tiles else bf16.TILE_SYMBOL) in script
    assert "T.init()" not in script
    assert f'"{CLAIM}"' in script


@pytest.mark.requires("avx512_bf16")
@pytest.mark.parametrize("tile", ["avx512", pytest.param("amx", marks=pytest.mark.requires("amx"))])
@pytest.mark.parametrize("m", [32, 13, None])  # whole row tiles, a ragged tail, a symbolic row count
def test_bf16_linear_equals_fp32_sums_of_the_rounded_operands(tmp_path, m, tile):
    """On the AVX-512 tile and on AMX's (where this CPU has AMX): only the order of the fp32 sums differs."""
    n, k = 96, 192
    rng = np.random.default_rng(0)
    rows = m or 45
    x = rng.standard_normal((rows, k), dtype=np.float32)
    weight = rng.standard_normal((n, k), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    library = tvm.runtime.load_module(str(_build_linear(m, n, k, HOST, tmp_path / "linear.so", tile == "amx")))
    (out,) = call_kernel(library, [x.astype(ml_dtypes.bfloat16).view(np.uint16), _panels(weight), bias],
                         [((rows, n), "float32")])
    exact = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ weight.astype(ml_dtypes.bfloat16).astype(np.float64).T
    np.testing.assert_allclose(out, exact + bias, rtol=1e-5, atol=1e-4)


def test_rounding_to_bf16_is_to_nearest_even(tmp_path):
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5e-3, 3.14159265, 65504.0, 1e-30, -0.0, 1.0 + 2**-8,
                       1.0 + 3 * 2**-8], dtype=np.float32)  # the last two are ties: to even, down then up
    x = te.placeholder((_i64(len(values)),), "float32", name="x")
    func = te.create_prim_func([x, bf16.to_bf16_te(x)])
    (out,) = call_kernel(build_kernel(func, HOST), [values], [((len(values),), "uint16")])
    assert out.tolist() == values.astype(ml_dtypes.bfloat16).view(np.uint16).tolist()


@pytest.fixture(scope="module")
def bf16_artifacts(tiny_bert_dir, tmp_path_factory):
    """The tiny model in bf16, packed and padded (its tests require avx512_bf16)."""
    from tests.support.artifacts import compile_artifact

    root = tmp_path_factory.mktemp("bf16")
    for layout, buckets in (("packed", ["packed-16"]), ("padded", ["1x8", "4x16"])):
        compile_artifact(tiny_bert_dir, root / layout, buckets, layout=layout, precision="bf16",
                         generic_shapes=["3x20"])
    return root


@pytest.mark.requires("avx512_bf16")
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_bf16_artifact_matches_pytorch(bf16_artifacts, tiny_bert_dir, layout):
    from tests.support.artifacts import least_cosine_to_pytorch

    model = load_artifact(bf16_artifacts / layout)
    manifest = model.manifest
    assert manifest.linear_precision == "bf16" and manifest.precision.requested == "bf16"
    assert manifest.precision.kernel == Capabilities.of(HOST).linears_kernel("bf16")
    assert manifest.precision.linears == 2 * 4
    measured = manifest.precision.candidates[0]
    assert measured.precision == "bf16" and measured.cosine_min >= GATES["bf16"].cosine_min
    assert manifest.tolerance == 0.05  # checked per output row, relative to its norm
    # buckets, and the generic library
    assert least_cosine_to_pytorch(model, tiny_bert_dir, [(1, 8), (3, 16), (5, 20)]) >= 0.999


@pytest.mark.requires("avx512_bf16")
def test_bf16_attention_of_a_model_matches_pytorch(tmp_path):
    """A model whose heads the bf16 attention products are compiled for (2 x 32 dims; the tiny
    model's 8-dim heads are not fused at all): every layer's attention on the bf16 kernel, and the
    packed and generic libraries within bf16's cosine gate of PyTorch fp32."""
    from loadtest.random_checkpoint import save_sentence_transformer
    from tests.support.artifacts import compile_artifact, least_cosine_to_pytorch
    from tests.support.checkpoints import TINY_SIZES

    checkpoint = save_sentence_transformer(tmp_path / "model", seed=3, config={
        **TINY_SIZES, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128})
    manifest, _ = compile_artifact(checkpoint, tmp_path / "bf16", ["packed-16"], layout="packed", precision="bf16",
                                   attention_products="bf16", generic_shapes=["3x20"])
    assert [passes.attention_fused for passes in manifest.passes.strategies.values()] == [2]
    symbols = subprocess.run(["nm", str(tmp_path / "bf16" / manifest.buckets[0].library)], capture_output=True,
                             text=True, check=True).stdout
    assert attention_bf16.SCORES.format(head=32) in symbols and attention_bf16.CONTEXT.format(head=32) in symbols
    model = load_artifact(tmp_path / "bf16")  # the bucket, the generic library
    assert least_cosine_to_pytorch(model, checkpoint, [(2, 16), (3, 20)]) >= GATES["bf16"].cosine_min


@pytest.mark.requires("avx512_bf16")
def test_bf16_weights_ship_at_half_the_bytes(bf16_artifacts, tiny_embed_artifact):
    from safetensors.numpy import load_file

    def linear_bytes(directory):
        manifest = json.loads((directory / "manifest.json").read_text())
        weights = load_file(str(directory / next(iter(manifest["weights"].values()))["file"]))
        return {w.dtype: w.nbytes for w in weights.values() if w.ndim >= 3}  # the packed linear panels

    bf16_panels, fp32_panels = linear_bytes(bf16_artifacts / "padded"), linear_bytes(tiny_embed_artifact)
    assert set(bf16_panels) == {np.dtype(np.uint16)} and set(fp32_panels) == {np.dtype(np.float32)}
    assert bf16_panels[np.dtype(np.uint16)] * 2 == fp32_panels[np.dtype(np.float32)]


@pytest.mark.requires("avx512_bf16")
def test_loader_refuses_a_bf16_artifact_on_a_cpu_without_avx512_bf16(bf16_artifacts, monkeypatch):
    flags = {linux_flag(feature) for feature in FEATURES} - {"avx512_bf16"}
    monkeypatch.setattr(cpu_features, "host_flags", lambda *args: flags)
    with pytest.raises(ArtifactError, match="needs CPU features avx512bf16 this CPU lacks"):
        load_artifact(bf16_artifacts / "packed")


def test_bf16_for_a_cpu_without_avx512_bf16_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "compile", "--precision", "bf16", "--mcpu", "x86-64-v3",
                             "--buckets", "1x8", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == ("bert-compile: error: --precision bf16 needs a CPU with AVX512_BF16; mcpu "
                                     "x86-64-v3 has none (use fp32, int8 or auto)")
    assert not (tmp_path / "out").exists()


def test_auto_considers_what_the_target_runs():
    assert Capabilities.of(make_target("cpu", mcpu="x86-64-v3")).precisions == ["fp32", "int8"]
    assert Capabilities.of(make_target("cpu", mcpu=BF16_CPU)).precisions == ["fp32", "bf16", "int8"]
    assert Capabilities.of(make_target("cpu", mcpu="x86-64")).precisions == ["fp32"]  # SSE2 only: no int8 kernel


def _candidate(name, ms, cosine_min, cosine_mean=None):
    return Measured(name, {"cosine_min": cosine_min, "cosine_mean": cosine_mean or cosine_min},
                    {"1x16": ms, "8x128": 10 * ms})


def test_auto_ships_the_fastest_candidate_that_keeps_its_gate():
    fp32, bf = _candidate("fp32", 2.0, 1.0), _candidate("bf16", 1.2, 0.99995)
    int8 = _candidate("int8", 0.8, 0.981, 0.996)  # fastest, but a one-word input drifts
    chosen, reason = choose([fp32, bf, int8])
    assert chosen is bf
    assert reason == ("bf16: the fastest that keeps its gate; slower: fp32 1.67x; failed the gate: int8 "
                      "(cosine_min 0.98100 < 0.99; cosine_mean 0.99600 < 0.997)")
    assert choose([fp32, bf, _candidate("int8", 0.8, 0.995, 0.998)])[0].precision == "int8"


def test_a_less_accurate_candidate_ships_only_when_faster_by_the_margin():
    fp32, int8 = _candidate("fp32", 2.0, 1.0), _candidate("int8", 1.97, 0.9995)  # 1.5% faster: timing noise
    chosen, reason = choose([int8, fp32])
    assert chosen is fp32
    assert reason == "fp32: the fastest that keeps its gate; less accurate and within 3% of its time: int8 0.98x"
    assert choose([fp32, _candidate("int8", 1.9, 0.9995)])[0].precision == "int8"  # 5% faster


def test_auto_never_ships_a_candidate_under_its_gate_whatever_its_speed():
    fp32 = _candidate("fp32", 50.0, 1.0)
    chosen, _ = choose([fp32, _candidate("bf16", 0.001, 0.998), _candidate("int8", 0.001, 0.5)])
    assert chosen is fp32
    classifier = Measured("bf16", {"top1_agreement": 0.9, "max_probability_diff": 0.002}, {"1x16": 0.1})
    assert choose([fp32, classifier])[0] is fp32  # a label changed on 1 in 10 sentences


def test_a_cosine_floor_rejects_every_candidate_under_it_beside_its_gate():
    fp32, bf = _candidate("fp32", 2.0, 1.0), _candidate("bf16", 1.2, 0.99995)
    int8 = _candidate("int8", 0.8, 0.995, 0.999)  # keeps the int8 gate, not a floor of 0.999
    for candidate in (fp32, bf, int8):
        candidate.min_cosine = 0.999
    chosen, reason = choose([fp32, bf, int8])
    assert chosen is bf
    assert reason == ("bf16: the fastest that keeps its gate; slower: fp32 1.67x; failed the gate: int8 "
                      "(cosine_min 0.99500 < --min-cosine 0.999)")
    bf.min_cosine = fp32.min_cosine = 0.99999
    assert choose([fp32, bf, int8])[0] is fp32


def test_a_candidate_refused_before_it_was_built_is_never_shipped():
    fp32 = _candidate("fp32", 2.0, 1.0)
    why = "int8 cannot keep --min-cosine 0.999 with any linear in int8 (simulated on the shipped sentences)"
    int8 = Measured("int8", {"cosine_min": 1.0, "cosine_mean": 1.0}, {}, 0.999, refused=why)
    chosen, reason = choose([fp32, int8])
    assert chosen is fp32 and int8.failures == [why]
    assert reason == f"fp32: the fastest that keeps its gate; failed the gate: int8 ({why})"


def test_auto_records_every_candidate_and_ships_the_one_it_chose(whole_panels_bert_dir, tmp_path, monkeypatch):
    """Attention's products are asked for (fp32) here and below: auto's choice of precision is tested, not
    which attention kernel timed fastest (tests/compile/test_attention_products.py). The shipped generic
    library is the chosen candidate's, and its times at auto's shapes are not taken again; the fp32
    reference every candidate is measured against is the int8 calibration's pass, not run again."""
    from compile.phases import decisions, libraries
    from tests.support.artifacts import compile_artifact

    timed, latencies, references = {}, libraries.LibraryBuilder._latencies, []

    def recorded(builder, record, workloads, timed_before):
        timed[record.name] = (dict(timed_before), latencies(builder, record, workloads, timed_before))
        return timed[record.name][1]

    def remembered(by: str, remember):
        return lambda *args: references.append(by) or remember(*args)

    monkeypatch.setattr(libraries.LibraryBuilder, "_latencies", recorded)
    monkeypatch.setattr(decisions, "remember_reference_outputs",
                        remembered("calibration", decisions.remember_reference_outputs))
    monkeypatch.setattr(libraries, "remember_reference_outputs",
                        remembered("computed", libraries.remember_reference_outputs))
    manifest, _ = compile_artifact(whole_panels_bert_dir, tmp_path / "auto", ["packed-16"], layout="packed",
                                   precision="auto", attention_products="fp32", generic_shapes=["3x20"])
    entry = manifest.precision
    assert entry.requested == "auto"
    assert [c.precision for c in entry.candidates] == Capabilities.of(HOST).precisions
    measured = [Measured(c.precision, {k: v for k, v in c.model_dump().items() if k in
                                       ("cosine_min", "cosine_mean", "top1_agreement", "max_probability_diff")},
                         c.times_ms) for c in entry.candidates]
    assert all(set(c.times_ms) == {"1x16", "1x64", "8x64"} for c in entry.candidates)  # clipped to max_seq 64
    chosen, reason = choose(measured)
    assert entry.precision == manifest.linear_precision == chosen.precision and entry.reason == reason
    assert load_artifact(tmp_path / "auto").manifest.precision == entry
    before, shipped = timed["generic"]
    assert {f"{w.batch}x{w.seq}" for w in before} == set(chosen.times_ms) and timed["bucket_packed-16"][0] == {}
    assert all(abs(ms - chosen.times_ms[f"{w.batch}x{w.seq}"]) <= 1e-3 and shipped[w] == round(ms, 4)
               for w, ms in before.items())
    assert len(shipped) > len(before)  # the cost model's other workloads are timed
    assert references == (["calibration"] if "int8" in Capabilities.of(HOST).precisions else ["computed"])


def test_auto_under_a_cosine_floor_ships_the_fp32_reference_where_nothing_else_keeps_it(whole_panels_bert_dir,
                                                                                         tmp_path):
    from tests.support.artifacts import compile_artifact

    floor = 0.9999999  # above what bf16 or int8 rounding keeps; fp32, the reference's arithmetic, is exempt
    manifest, _ = compile_artifact(whole_panels_bert_dir, tmp_path / "floor", ["packed-16"], layout="packed",
                                   precision="auto", min_cosine=floor, attention_products="fp32",
                                   generic_shapes=["3x20"])
    entry = manifest.precision
    assert entry.precision == manifest.linear_precision == "fp32"
    rounded = [c for c in entry.candidates if c.precision != "fp32"]
    # bf16 is built and measured under the floor; int8 is not built: its plan left no linear in int8
    assert rounded and all(any(f"--min-cosine {floor:.10g}" in f for f in c.gate_failures) for c in rounded)
    int8 = [c for c in rounded if c.precision == "int8"]
    assert all(c.times_ms == {} and c.gate_failures == [f"int8 cannot keep --min-cosine {floor:.10g} with any linear "
                                                        "in int8 (simulated on the shipped sentences)"]
               for c in int8)


def test_a_cross_encoders_one_logit_is_compared_by_its_sigmoid():
    from compile.passes.quantize import classifier_agreement

    reference = np.array([[2.0], [-1.0], [0.3]])
    # a softmax over one label is always 1: without the sigmoid any drift would look exact
    drifted = classifier_agreement(np.array([[2.0], [-1.0], [-0.3]]), reference)
    assert drifted["top1_agreement"] == pytest.approx(2 / 3)
    assert drifted["max_probability_diff"] == pytest.approx(1 / (1 + np.exp(-0.3)) - 1 / (1 + np.exp(0.3)))
    assert classifier_agreement(reference, reference) == {"top1_agreement": 1.0, "max_probability_diff": 0.0}


def test_a_c_compiler_without_avx512_bf16_refuses_bf16_and_auto_does_without_it(monkeypatch):
    def cannot_build():
        raise RuntimeError("the C compiler (cc) cannot build the bf16 micro-kernel: unknown option -mavx512bf16")

    monkeypatch.setattr(bf16, "kernels_object", cannot_build)
    capabilities = Capabilities.asked_of(make_target("cpu", mcpu=BF16_CPU))  # not the answers kept from before
    assert capabilities.refusal("bf16") == ("--precision bf16: the C compiler (cc) cannot build the bf16 "
                                            "micro-kernel: unknown option -mavx512bf16")
    assert capabilities.precisions == ["fp32", "int8"]
