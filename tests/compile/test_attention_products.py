"""compile/attention_products.py: the arithmetic of attention's products beside bf16 and int8
linears, chosen by timing the fused kernel on the compiling CPU (injected times for the choice
itself), the timed kernel's answers against numpy, the compile recording and building what
was chosen, and the int8 plan's kept units following the same timing. bf16 execution needs a CPU
with AVX512_BF16 and skips elsewhere; the int8 products have tests/compile/kernels/test_attention_int8.py."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm

from compile import attention_products
from compile.phases import decisions
from compile.attention_products import Geometry
from compile.build import build_library, make_target
from compile.capabilities import Capabilities, KernelConfig
from compile.int8_plan import kept_precision
from compile.workers import Workers
from tests.support.kernels import attention_heads, key_padding_bias
from tests.support.tvm_run import run

pytestmark = pytest.mark.slow  # collected first: see conftest.py

HOST = make_target("cpu")
HOST_REDUCED = Capabilities.of(HOST).reduced_products  # ("int8",) where the CPU has AVX2 only
HOST_ROUNDED = next((products for products in HOST_REDUCED if products != "int8"), None)  # bf16 / amx
SMALL = Geometry(heads=2, head_size=32, max_seq=64)


def _times(fp32: float, rounded: float, name: str = "bf16") -> dict[str, dict[str, float]]:
    return {"fp32": {"1x128": fp32, "1x512": fp32 * 10}, name: {"1x128": rounded, "1x512": rounded * 10}}


@pytest.mark.parametrize("rounded", ["bf16", "amx", "int8"])
def test_reduced_products_are_kept_only_when_faster_by_the_margin(rounded):
    """bf16 or AMX products beside bf16 and int8 linears alike; int8 ones beside int8 linears only."""
    beside = ["bf16", "int8"] if rounded != "int8" else ["int8"]
    faster = attention_products.decide(_times(1.0, 0.5, rounded))
    assert [faster.for_precision(p) for p in ("fp32", "bf16", "int8")] == [
        "fp32", rounded if "bf16" in beside else "fp32", rounded]
    assert faster.requested == "auto" and faster.times_ms == _times(1.0, 0.5, rounded)
    assert all(faster.reasons[linears] == f"{rounded}: 0.50x the fp32 kernel's time" for linears in beside)
    within_noise = attention_products.decide(_times(1.0, 0.98, rounded))  # 2% < PRECISION_MARGIN
    assert within_noise.products == {"bf16": "fp32", "int8": "fp32"}
    slower = attention_products.decide(_times(1.0, 1.22, rounded))
    assert slower.products == {"bf16": "fp32", "int8": "fp32"}
    assert slower.reasons["int8"] == f"fp32: {rounded} takes 1.22x its time"


def test_int8_linears_take_the_fastest_products_and_bf16_ones_never_int8():
    slow_bf16 = attention_products.decide({"fp32": {"1x128": 1.0}, "bf16": {"1x128": 1.25}, "int8": {"1x128": 0.6}})
    assert slow_bf16.products == {"bf16": "fp32", "int8": "int8"}
    assert slow_bf16.reasons == {"bf16": "fp32: bf16 takes 1.25x its time",
                                 "int8": "int8: 0.60x the fp32 kernel's time"}
    tiles = attention_products.decide({"fp32": {"1x128": 1.0}, "amx": {"1x128": 0.4}, "int8": {"1x128": 0.6}})
    assert tiles.products == {"bf16": "amx", "int8": "amx"}


def test_the_choice_by_geometric_mean_weighs_every_length_alike():
    times = {"fp32": {"1x128": 1.0, "1x512": 4.0}, "bf16": {"1x128": 2.0, "1x512": 1.6}}  # 1.79 against 2.0
    assert attention_products.decide(times).products["bf16"] == "bf16"


@pytest.mark.parametrize("mcpu,expected", [("x86-64-v3", ("int8",)), ("alderlake", ("int8",)),
                                           ("x86-64-v4", ("int8",)), ("znver4", ("bf16", "int8")),
                                           ("sapphirerapids", ("amx", "int8")), ("x86-64-v2", ())])
def test_the_reduced_arithmetic_is_the_cpus(mcpu, expected):
    """bf16 where the CPU has it (on AMX tiles where it has them), and int8 wherever the int8 linears'
    kernel fills the target's vectors (AVX2's ymm, AVX512BW's zmm)."""
    assert Capabilities.of(make_target("cpu", mcpu=mcpu)).reduced_products == expected


def test_what_is_asked_or_cannot_be_timed_is_not_timed(monkeypatch):
    def no_timing(*_args):
        raise AssertionError("timed")

    monkeypatch.setattr(attention_products, "_time_kernels", no_timing)
    znver4, v3 = make_target("cpu", mcpu="znver4"), make_target("cpu", mcpu="x86-64-v3")
    choose = attention_products.choose
    assert choose(znver4, SMALL, "fp32", timed=True).reasons == {"bf16": "fp32: asked for", "int8": "fp32: asked for"}
    assert choose(znver4, SMALL, "bf16", timed=True).products == {"bf16": "bf16", "int8": "bf16"}
    assert choose(make_target("cpu", mcpu="sapphirerapids"), SMALL, "bf16", timed=True).products["int8"] == "amx"
    untimed = choose(znver4, SMALL, "auto", timed=False)
    assert (untimed.products, untimed.times_ms) == ({"bf16": "bf16", "int8": "bf16"}, {})
    assert choose(make_target("cpu", mcpu="x86-64-v2"), SMALL, "auto", timed=True).reasons["int8"] == (
        "fp32: no bf16 or int8 products here (AVX512_BF16, AVX2 or AVX512BW)")
    narrow = choose(znver4, Geometry(heads=4, head_size=24, max_seq=64), "auto", timed=True)
    assert narrow.reasons["int8"] == "fp32: the fused kernel's bf16 and int8 products do not take 24-wide heads " \
        "at 16 lanes"
    narrow = choose(v3, Geometry(heads=4, head_size=24, max_seq=64), "auto", timed=True)
    assert narrow.reasons["int8"] == "fp32: the fused kernel's int8 products do not take 24-wide heads at 8 lanes"
    assert choose(v3, SMALL, "auto", timed=False).products == {"bf16": "fp32", "int8": "int8"}


def test_only_bf16_and_int8_libraries_take_the_choice():
    choice = attention_products.AttentionChoice.alike("amx", "auto", "amx: 0.40x the fp32 kernel's time")
    assert [choice.for_precision(p) for p in ("fp32", "bf16", "int8")] == ["fp32", "amx", "amx"]
    choice = attention_products.decide({"fp32": {"1x128": 1.0}, "int8": {"1x128": 0.7}})
    assert [choice.for_precision(p) for p in ("fp32", "bf16", "int8")] == ["fp32", "fp32", "int8"]
    assert choice.entry("int8").reason == "int8: 0.70x the fp32 kernel's time"


def test_units_kept_out_of_int8_follow_the_timing_of_bf16():
    """The int8 plan's kept units run bf16 where the CPU has it, unless this CPU timed bf16 slower."""
    znver4, v3 = make_target("cpu", mcpu="znver4"), make_target("cpu", mcpu="x86-64-v3")
    assert [kept_precision(znver4, pays) for pays in (None, True, False)] == ["bf16", "bf16", "fp32"]
    assert [kept_precision(v3, pays) for pays in (None, True)] == ["fp32", "fp32"]
    assert attention_products.decide(_times(1.0, 0.5)).bf16_pays is True
    assert attention_products.decide(_times(1.0, 1.2)).bf16_pays is False
    assert attention_products.decide(_times(1.0, 0.5, "int8")).bf16_pays is False
    assert attention_products.choose(znver4, SMALL, "auto", timed=False).bf16_pays is None


def test_asking_bf16_products_of_a_cpu_without_avx512_bf16_is_refused():
    v3, znver4 = (Capabilities.of(make_target("cpu", mcpu=mcpu)) for mcpu in ("x86-64-v3", "znver4"))
    assert attention_products.refusal("bf16", v3) == (
        "--attention-products bf16 needs a CPU with AVX512_BF16; mcpu x86-64-v3 has none (use fp32 or auto)")
    assert attention_products.refusal("auto", v3) is None
    assert attention_products.refusal("bf16", znver4) is None


def _reference(qkv: np.ndarray, heads: int, head_size: int) -> np.ndarray:
    hidden = heads * head_size
    q, k, v = (qkv[:, i * hidden:(i + 1) * hidden].reshape(-1, heads, head_size).transpose(1, 0, 2) for i in range(3))
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(head_size)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(-1, hidden)


@pytest.mark.parametrize("products", ["fp32", pytest.param("rounded", marks=pytest.mark.requires("avx512_bf16"))])
@pytest.mark.parametrize("seq", [9, 64])
def test_the_timed_kernel_computes_attention(products, seq, tmp_path):
    """What is timed is attention: the kernel module's answers against numpy (bf16 rounds each
    product's operands to 8 significant bits: 2e-2 of values of order 1). int8 products:
    tests/compile/kernels/test_attention_int8.py."""
    products = HOST_ROUNDED if products == "rounded" else products
    kernels = KernelConfig.of(HOST, products=products)
    build_library(attention_products.kernel_module(SMALL, kernels), HOST, tmp_path / "k.so", kernels=kernels)
    qkv = np.random.default_rng(seq).standard_normal((seq, 3 * 64), dtype=np.float32)
    out = run(tvm.runtime.load_module(str(tmp_path / "k.so")), qkv, np.zeros((1, 1, 1, seq), np.float32))
    if products == "fp32":
        np.testing.assert_allclose(out, _reference(qkv, 2, 32), rtol=1e-4, atol=1e-5)
    else:
        rounded = qkv.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(out, _reference(rounded, 2, 32), rtol=2e-2, atol=2e-2)


@pytest.mark.requires("avx512_bf16")
def test_the_rounded_kernel_computes_what_the_int8_plan_simulates(tmp_path):
    """bf16 (or AMX) products against the int8 plan's simulation of them (int8_simulation.fake_bf16_attention):
    the same operands rounded the same way and the same exp, so the same answers up to the order of
    fp32 sums (where fp32 attention differs by the rounding itself), the padding keys left out."""
    import torch

    from compile.int8_simulation import fake_bf16_attention

    seq, length, heads, head_size = 64, 37, SMALL.heads, SMALL.head_size
    kernels = KernelConfig.of(HOST, products=HOST_ROUNDED)
    build_library(attention_products.kernel_module(SMALL, kernels), HOST, tmp_path / "k.so", kernels=kernels)
    qkv = np.random.default_rng(5).standard_normal((seq, 3 * heads * head_size), dtype=np.float32) * 2
    bias = key_padding_bias(seq, length)
    out = run(tvm.runtime.load_module(str(tmp_path / "k.so")), qkv, bias)[:length]
    query, key, value = attention_heads(qkv, heads, head_size)
    simulated, _ = fake_bf16_attention(None, query, key, value, torch.from_numpy(bias))
    simulated = simulated.reshape(seq, heads * head_size).numpy()[:length]
    exact = _reference(qkv[:length], heads, head_size)  # the real tokens alone
    from_simulation, from_fp32 = np.abs(out - simulated), np.abs(out - exact)
    assert np.median(from_simulation) < 1e-6 and from_simulation.max() < 2e-3
    assert np.median(from_fp32) > 100 * np.median(from_simulation)


@pytest.mark.requires("avx2")
def test_a_timed_choice_is_the_fastest_kernel_on_this_cpu():
    """Real timing of both kernels (not of which wins: that is this CPU's), and the choice is
    what `decide` makes of the times it recorded."""
    choice = attention_products.choose(HOST, SMALL, "auto", timed=True)
    assert set(choice.times_ms) == {"fp32", *HOST_REDUCED}
    assert all(set(times) == {"1x64"} and min(times.values()) > 0 for times in choice.times_ms.values())
    assert choice.products == attention_products.decide(choice.times_ms).products


def test_the_compile_builds_every_library_with_the_chosen_products_and_records_why(tmp_path, monkeypatch):
    """int8 (any AVX2 CPU) with 32-wide heads, auto's timing injected so that fp32 wins: every
    library is built with fp32 products, and the manifest says what was timed and why."""
    from loadtest.random_checkpoint import save_sentence_transformer
    from tests.support.artifacts import compile_artifact
    from tests.support.checkpoints import TINY_SIZES, WHOLE_PANELS

    injected = _times(1.0, 1.3, "int8")
    monkeypatch.setattr(attention_products, "_time_kernels", lambda *_args: injected)
    monkeypatch.setattr(attention_products, "start_kernels", lambda *_args: None)  # nothing to time
    built_with = []
    real_submit = Workers.submit

    def spy(workers, name, build):
        built_with.append(build.keywords["kernels"].products)
        return real_submit(workers, name, build)

    monkeypatch.setattr(Workers, "submit", spy)
    planned_with, real_simulation = [], decisions.simulation_for

    def simulation_spy(*args, **kwargs):
        planned_with.append(kwargs["bf16_pays"])
        return real_simulation(*args, **kwargs)

    monkeypatch.setattr(decisions, "simulation_for", simulation_spy)
    checkpoint = save_sentence_transformer(tmp_path / "model", seed=5, config={**TINY_SIZES, **WHOLE_PANELS})
    manifest, _ = compile_artifact(checkpoint, tmp_path / "int8", ["packed-16"], layout="packed", precision="int8",
                                   generic_shapes=["3x20"])
    assert built_with == ["fp32"] * 2  # the plan's library checked (shipped as the generic one), the bucket
    assert planned_with == [False]  # kept units: fp32 where bf16 was slower (or int8 products timed instead)
    recorded = manifest.precision.attention
    assert (recorded.products, recorded.requested) == ("fp32", "auto")
    assert recorded.times_ms == injected and recorded.reason == "fp32: int8 takes 1.30x its time"


def _called_products(library: Path) -> str:
    """The arithmetic of attention's products that `library`'s code calls: the products' symbols in its
    disassembled calls (a linked object defines them all, called or not)."""
    from compile.kernels import attention_amx, attention_bf16, attention_int8

    disassembly = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    called = set(re.findall(r"call\s.*<(\w+?)(?:@plt)?>", disassembly))
    symbols = {"amx": attention_amx.SCORES, "bf16": attention_bf16.SCORES, "int8": attention_int8.TILE}
    return next((products for products, symbol in symbols.items()
                 if any(symbol.format(head=head) in called for head in (16, 32, 48, 64, 96, 128))), "fp32")


@pytest.mark.requires("avx512_bf16")
@pytest.mark.parametrize("head_size", [32, 48])
def test_the_manifest_records_the_products_the_libraries_call(head_size, tmp_path):
    """bf16 products asked for beside bf16 linears: 32-wide heads run them (AMX's where the CPU has
    them), 48-wide ones, which neither the bf16 nor the AMX products are compiled for, fp32. What the
    manifest records is what every library calls."""
    from loadtest.random_checkpoint import save_sentence_transformer
    from tests.support.artifacts import compile_artifact
    from tests.support.checkpoints import TINY_SIZES

    checkpoint = save_sentence_transformer(tmp_path / "model", seed=4, config={
        **TINY_SIZES, "hidden_size": 2 * head_size, "num_attention_heads": 2, "intermediate_size": 4 * head_size})
    manifest, _ = compile_artifact(checkpoint, tmp_path / "bf16", ["packed-16"], layout="packed", precision="bf16",
                                   attention_products="bf16", generic_shapes=["3x20"])
    assert [passes.attention_fused for passes in manifest.passes.strategies.values()] == [2]
    recorded = manifest.precision.attention
    expected = HOST_ROUNDED if head_size == 32 else "fp32"
    assert recorded.products == expected
    if expected == "fp32":
        assert recorded.reason == (f"fp32: the fused kernel's {HOST_ROUNDED} products do not take 48-wide heads "
                                   "at 16 lanes")
    assert [_called_products(tmp_path / "bf16" / library)
            for library in (manifest.buckets[0].library, manifest.generic.library)] == [expected] * 2
