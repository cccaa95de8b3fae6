"""compile/kernels/attention_int8.py: attention's two products in int8 at AVX2 (x86-64-v3 code, which
every machine of ours runs) and on zmm (`vpmaddubsw` at x86-64-v4, `vpdpbusd` at icelake-server:
skipped where the CPU lacks AVX512BW / VNNI), against the int8 plan's PyTorch simulation of them
(int8_simulation.fake_quantized_attention), against fp32 attention and each other; the plan simulating
them; a compile that times, builds, validates and records them."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm

from compile import attention_products, int8_simulation
from compile.phases import decisions
from compile.plan import Arithmetic
from compile.attention_products import Geometry
from compile.build import build_library, make_target
from compile.capabilities import KernelConfig
from compile.kernels import attention_int8, int8
from compile.workers import Workers
from tests.support.kernels import attention_heads, key_padding_bias
from tests.support.tvm_run import run, runs_here

V3 = make_target("cpu", mcpu="x86-64-v3")
ZMM = ("x86-64-v4", "icelake-server")  # the int8 products on zmm: vpmaddubsw, vpdpbusd
pytestmark = pytest.mark.requires("avx2")


def _attention_inputs(seq: int, length: int, heads: int, head_size: int, seed: int):
    """Q, K and V of one sequence side by side (values of order 1, a few of 4 as activations have),
    and the bias that marks keys from `length` on as padding."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((seq, 3 * heads * head_size), dtype=np.float32)
    qkv[rng.random(qkv.shape) < 0.02] *= 4
    return qkv, key_padding_bias(seq, length)


def _int8_attention(mcpu: str, head_size: int, heads: int, qkv: np.ndarray, bias: np.ndarray, directory: Path):
    """The fused kernel with int8 products built for `mcpu` (its vector width), run on qkv; None where
    this CPU cannot run that level's code."""
    target = make_target("cpu", mcpu=mcpu)
    if not runs_here(target):
        return None
    kernels = KernelConfig.of(target, products="int8")
    path = directory / f"{mcpu}-{head_size}.so"
    build_library(attention_products.kernel_module(Geometry(heads, head_size, 64), kernels), target, path,
                  kernels=kernels)
    return run(tvm.runtime.load_module(str(path)), qkv, bias)


@pytest.mark.parametrize("head_size,seq,length", [(16, 64, 37), (32, 9, 9), (32, 64, 37), (64, 64, 37),
                                                  (128, 64, 64)])
def test_int8_products_compute_what_the_plan_simulates(head_size, seq, length, tmp_path):
    """The AVX2 kernel against the simulation: the same codes, so the same answers up to the exp (a
    polynomial there, torch's here), which now and then moves a probability code by one; and
    against fp32 attention, the loss the int8 gate then weighs (least row cosine 0.995 on these).
    The zmm kernels, where this CPU runs them, give the AVX2 kernel's answers: the same codes and
    the same exp, summed exactly in int32 (to float rounding in the normalisation)."""
    heads = 2
    qkv, bias = _attention_inputs(seq, length, heads, head_size, seed=head_size + seq)
    out = _int8_attention("x86-64-v3", head_size, heads, qkv, bias, tmp_path)
    for mcpu in ZMM:
        on_zmm = _int8_attention(mcpu, head_size, heads, qkv, bias, tmp_path)
        if on_zmm is not None:
            np.testing.assert_allclose(on_zmm, out, rtol=1e-5, atol=1e-6)
    query, key, value = attention_heads(qkv, heads, head_size)
    mask = torch.from_numpy(bias)
    simulated, _ = int8_simulation.fake_quantized_attention(None, query, key, value, mask)
    simulated = simulated.reshape(seq, heads * head_size).numpy()
    difference = np.abs(out[:length] - simulated[:length])
    assert np.median(difference) < 1e-5 and difference.max() < 4e-3 * np.abs(simulated).max()
    assert not out[length:].any()  # padded layout: the padding rows are zeros
    exact = torch.softmax(query @ key.transpose(-1, -2) / math.sqrt(head_size) + mask, -1) @ value
    exact = exact.transpose(1, 2).reshape(seq, heads * head_size).numpy()[:length]
    cosines = (out[:length] * exact).sum(1) / np.linalg.norm(out[:length], axis=1) / np.linalg.norm(exact, axis=1)
    assert cosines.min() > 0.995


@pytest.mark.parametrize("kernel", [int8.AVX2, int8.AVX_VNNI, int8.AVX512BW, int8.VNNI])
def test_each_cpus_products_run_on_its_int8_instructions(kernel):
    """The object a library links for its int8 products (kernels_object): AVX2's `vpmaddubsw` on ymm
    (also at the AVX-VNNI level: `vpdpbusd` on ymm was no faster there), on zmm where the CPU has
    AVX512BW, and `vpdpbusd` on zmm where it has VNNI."""
    assembly = subprocess.run(["objdump", "-d", str(attention_int8.kernels_object(kernel))], capture_output=True,
                              text=True, check=True).stdout
    register = "%zmm" if kernel.lanes == 16 else "%ymm"
    instruction = "vpdpbusd" if kernel is int8.VNNI else "vpmaddubsw"
    used = [line for line in assembly.splitlines() if instruction in line]
    assert used and all(register in line for line in used)
    assert (kernel is int8.VNNI) == ("vpdpbusd" in assembly)


def test_values_are_scaled_by_their_pair_bound():
    """A value column whose two 1s sit in one key pair is quantized with twice the step of one whose
    1s sit in different pairs: the bound `vpmaddubsw` needs (kernels/int8.py), and no tighter. All
    the attention on key 0 reads its value back: 1 as code 64 of step 2/127, and exactly."""
    value = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]).reshape(1, 1, 4, 2)
    query = torch.ones(1, 1, 4, 2)
    key = torch.zeros(1, 1, 4, 2)
    key[0, 0, 0] = 100.0  # key 0's score 141, the others' 0: their probability codes round to 0
    context, _ = int8_simulation.fake_quantized_attention(None, query, key, value, None)
    torch.testing.assert_close(context[0, :, 0], torch.tensor([[64 * 2 / 127, 1.0]]).expand(4, 2))


@pytest.mark.parametrize("products,least", [("int8", 0.99), ("bf16", 0.999), ("amx", 0.999)])
def test_the_plan_simulates_reduced_products_where_the_library_runs_them(products, least):
    """With no linear in int8 the fp32 model's answers are kept exactly; with the products in int8, or
    in bf16 (AMX's tiles round as bf16's products do), they move, and the plan's accuracy says by how
    much (the bf16 arithmetic is tests/compile/test_attention_products.py's)."""
    import transformers

    from compile.passes.quantize import embedding_agreement
    from tests.support.checkpoints import TINY_SIZES

    config = transformers.BertConfig(**{**TINY_SIZES, "hidden_size": 64, "num_attention_heads": 2,
                                        "intermediate_size": 128, "initializer_range": 0.3})  # attention that weighs
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.config._attn_implementation = "eager"

    class Embedder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state.mean(1)

    ids = torch.randint(1000, 2000, (4, 12)).numpy()
    mask = (np.arange(12)[None] < np.array([[12], [7], [3], [1]])).astype(np.int64)
    rows = (ids, mask)
    fp32 = int8_simulation.Simulation(Embedder(), rows, set(), embedding_agreement).accuracy(0.0, set())
    reduced = int8_simulation.Simulation(Embedder(), rows, set(), embedding_agreement,
                                   attention_products=products).accuracy(0.0, set())
    assert fp32["cosine_min"] == pytest.approx(1.0, abs=1e-6)
    assert least < reduced["cosine_min"] < 1 - 1e-6
    assert model.config._attn_implementation == "eager"  # restored after each pass


def test_a_compile_at_avx2_ships_int8_products_where_they_are_faster(tmp_path, monkeypatch):
    """x86-64-v3 int8 with auto's timing injected so that int8 products win: every library is built
    with them, the plan simulated them, the validation kept the gate, and the manifest says why."""
    from loadtest.random_checkpoint import save_sentence_transformer
    from tests.support.artifacts import compile_artifact
    from tests.support.checkpoints import TINY_SIZES, WHOLE_PANELS

    injected = {"fp32": {"1x64": 1.0}, "int8": {"1x64": 0.6}}
    monkeypatch.setattr(attention_products, "_time_kernels", lambda *_args: injected)
    monkeypatch.setattr(attention_products, "start_kernels", lambda *_args: None)  # nothing to time
    built_with, planned_with = [], []
    real_submit, real_plan = Workers.submit, decisions.plan_for

    def build_spy(workers, name, build):
        built_with.append(build.keywords["kernels"].products)
        return real_submit(workers, name, build)

    def plan_spy(*args, **kwargs):
        planned_with.append(kwargs["attention_products"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(Workers, "submit", build_spy)
    monkeypatch.setattr(decisions, "plan_for", plan_spy)
    checkpoint = save_sentence_transformer(tmp_path / "model", seed=6, config={**TINY_SIZES, **WHOLE_PANELS})
    manifest, _ = compile_artifact(checkpoint, tmp_path / "int8", ["packed-16"], layout="packed", precision="int8",
                                   mcpu="x86-64-v3", generic_shapes=["3x20"])
    assert built_with == ["int8"] * 2  # the plan's library (shipped as generic), the bucket
    assert planned_with == ["fp32", "int8"]  # beside fp32 products every linear stays in int8: int8 products tried
    recorded = manifest.precision.attention
    assert (recorded.products, recorded.reason, recorded.times_ms) == ("int8", "int8: 0.60x the fp32 kernel's time",
                                                                      injected)
    measured = manifest.precision.candidates[0]
    assert measured.cosine_min >= 0.99 and not measured.gate_failures


def test_int8_products_beside_which_int8_linears_miss_the_gate_give_way(monkeypatch):
    """Where int8 products were timed faster, the plan beside the products bf16 linears have (fp32, or
    bf16 where those were timed faster than fp32) comes first. Where it keeps a linear out, int8 products,
    which round more, are not simulated: that plan ships beside those products, and the manifest says why.
    Where it keeps every linear in int8, the plan with int8 products (no linear kept out: None where every
    linear in int8 misses the gate), simulated at the first plan's smoothing only, decides: int8 products
    stay where it holds. Every plan measures with one simulation (its calibration and fp32 reference are
    theirs)."""
    from types import SimpleNamespace

    from compile.int8_plan import Int8Plan

    def fake_plan(simulation, *_args, attention_products, keep_out=True, alphas=None):
        planned.append((attention_products, keep_out))
        smoothings.append(alphas)
        simulated_with.append(simulation)
        if attention_products == "int8":
            return None if int8_misses else Int8Plan(alpha=0.5, scales={}, fallback=[], fallback_keys=set(),
                                                     simulated={}, units=4)
        return Int8Plan(alpha=0.5, scales={}, fallback=["encoder.layer.0.output.dense"] if others_keep_out else [],
                        fallback_keys=set(), simulated={}, units=4)

    simulations = []
    monkeypatch.setattr(decisions, "simulation_for", lambda *_args, **_kwargs: simulations.append(object()) or
                        simulations[-1])
    monkeypatch.setattr(decisions, "plan_for", fake_plan)
    info = SimpleNamespace(path=Path("model"), max_seq=128, tokenizer_file=Path("model") / "tokenizer.json")
    config = SimpleNamespace(model_task="embed", min_cosine=0.999)
    progress = SimpleNamespace(note=lambda text: None)
    without_bf16 = {"fp32": {"1x128": 1.0}, "int8": {"1x128": 0.7}}
    slower_bf16 = {**without_bf16, "bf16": {"1x128": 1.2}}
    faster_bf16 = {**without_bf16, "bf16": {"1x128": 0.8}}
    measured = "with int8 products, int8 linears miss the gate"
    for timed, others_keep_out, int8_misses, products, plans, why in (
            (without_bf16, False, False, "int8", [("fp32", True), ("int8", False)], "0.70x the fp32 kernel's time"),
            (without_bf16, False, True, "fp32", [("fp32", True), ("int8", False)], measured),
            (without_bf16, True, False, "fp32", [("fp32", True)], "int8 linears miss the gate beside fp32 products "
                                                                  "already, and int8 ones round more"),
            (slower_bf16, True, False, "fp32", [("fp32", True)], "int8 linears miss the gate beside fp32 products "
                                                                 "already, and int8 ones round more"),
            (faster_bf16, True, False, "bf16", [("bf16", True)], "int8 linears miss the gate beside bf16 products "
                                                                 "already, and int8 ones round more")):
        planned, smoothings, simulated_with, simulations = [], [], [], []
        plan = SimpleNamespace(info=info, target=V3)
        asked = Arithmetic("int8", attention=attention_products.decide(timed))
        chosen = decisions.plan_int8_linears(config, plan, asked, SimpleNamespace(mod=None), None, progress)
        assert (chosen.attention.products["int8"], planned, len(chosen.int8.fallback)) == (products, plans,
                                                                                            int(others_keep_out))
        assert len(simulations) == 1 and simulated_with == simulations * len(plans)
        assert smoothings == [None, (0.5,)][:len(plans)]  # every alpha, then the first plan's
        assert chosen.attention.reasons["int8"] == f"{products}: {why}"
        assert chosen.attention.times_ms == timed and asked.int8 is None  # a new value; the asked one stays
