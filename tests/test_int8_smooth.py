"""Mixed int8: SmoothQuant scaling (compile/passes/smooth.py), the measured plan of which linears
int8 smooths and keeps out (compile/int8_plan.py) and its simulation (compile/int8_simulation.py),
and the int8 gate of the compile.

The plans are tested on tiny random BERTs with a planted defect: an outlier activation channel
(which smoothing removes) or two huge channels that cancel in the product (which no per-channel
scaling removes: the linear must stay out of int8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import relax as R

from compile import precision
from compile.build import make_target
from compile.int8_plan import kept_precision
from compile.opcount import count_ops
from compile.passes.lift import lift_and_transform
from compile.passes.quantize import embedding_agreement, sentence_rows
from compile.passes.smooth import linear_modules, module_key, smooth_linears, smoothing_scales
from compile.precision import Gate
from loadtest.int8_accuracy import artifact_outputs, cosines

pytestmark = pytest.mark.slow  # collected first: see conftest.py

TARGET = make_target("cpu", "sm_90", None)
SENSITIVE = "bert.encoder.layer.1.output.dense"
UNSEEN = ["maybe", "A sudden storm forced the sailors back to the harbour before dawn.",
          "Compilers translate source code into machine instructions."]
TINY = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6}  # both kernels' panels fit


@tvm.script.ir_module
class TwoLinears:
    """Layer norm -> linear -> GELU -> linear, weights named as torch.export names them."""

    @R.function
    def main(x: R.Tensor((6, 16), "float32"), p_ln_weight: R.Tensor((16,), "float32"),
             p_ln_bias: R.Tensor((16,), "float32"), p_up_weight: R.Tensor((32, 16), "float32"),
             p_up_bias: R.Tensor((32,), "float32"), p_down_weight: R.Tensor((16, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.nn.layer_norm(x, p_ln_weight, p_ln_bias, axes=[-1])
            up = R.add(R.matmul(h, R.permute_dims(p_up_weight)), p_up_bias)
            down = R.matmul(R.nn.gelu(up), R.permute_dims(p_down_weight))
            R.output(down)
        return down


def _run(mod: tvm.IRModule, args: list[np.ndarray]) -> np.ndarray:
    target = tvm.target.Target({"kind": "llvm"})
    built = tvm.compile(mod, target, relax_pipeline=relax.get_default_pipeline(target))
    out = relax.VirtualMachine(built, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


def test_smoothing_is_exact_in_fp32_and_its_weight_side_is_folded():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in TwoLinears["main"].params]
    args[0][:, 3] *= 40.0  # an outlier channel, as BERT's layer norms have
    scales = {"up": rng.uniform(0.1, 10.0, 16).astype("float32"), "down": rng.uniform(0.1, 10.0, 32).astype("float32")}
    smoothed, rewritten = smooth_linears(TwoLinears, scales)
    assert rewritten == 2
    assert count_ops(smoothed).get("relax.multiply", 0) == count_ops(TwoLinears).get("relax.multiply", 0) + 4
    np.testing.assert_allclose(_run(smoothed, args), _run(TwoLinears, args), rtol=2e-5, atol=2e-5)
    # W * s is weight-only: lifted out of main, only the two activation multiplies run per call
    lifted = lift_and_transform(smoothed, [tvm.runtime.tensor(a) for a in args[1:]])
    assert count_ops(lifted.mod)["relax.multiply"] == count_ops(TwoLinears).get("relax.multiply", 0) + 2


def test_smoothing_leaves_linears_without_a_scale_alone():
    smoothed, rewritten = smooth_linears(TwoLinears, {"up": np.ones(16, "float32")})
    assert rewritten == 1
    assert count_ops(smoothed)["relax.multiply"] == count_ops(TwoLinears).get("relax.multiply", 0) + 2


def test_smoothing_a_bert_is_exact_in_fp32_and_folds_the_output_projections_into_v(tiny_bert_dir):
    """Every linear smoothed with random scales (Q, K and V sharing theirs): the model's outputs
    stay fp32's; the attention output projection's 1 / s is folded into V's weights (attention is
    linear in V), so only the other three linears of a layer multiply their input per call."""
    from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.packing import linears_on_weights
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    imported = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, info.config["vocab_size"])
    mod = apply_strategy(imported.mod, "concat")
    rng = np.random.default_rng(1)
    scales = {}
    for keys in linear_modules(mod["main"], linears_on_weights(mod["main"])).values():
        width = int(next(p for p in mod["main"].params if p.name == f"p_{keys[0]}_weight").ty.shape[1])
        scales.update(dict.fromkeys(keys, rng.uniform(0.2, 5.0, width).astype("float32")))
    smoothed, rewritten = smooth_linears(mod, scales)
    assert rewritten == 2 * 4
    inputs = [x.numpy() for x in example_inputs(3, 9, info.config["vocab_size"])]
    outputs, multiplies = [], []
    for module in (mod, smoothed):
        lifted = lift_and_transform(module, imported.params)
        outputs.append(_run(lifted.mod, [*inputs, *lifted.weights]))
        multiplies.append(count_ops(lifted.mod).get("relax.multiply", 0))
    assert multiplies[1] == multiplies[0] + 2 * 3  # per layer: Q/K/V, FFN in, FFN out
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)


def test_smoothing_scales_follow_smoothquant():
    activation, weight = np.array([8.0, 1.0, 0.0]), np.array([2.0, 4.0, 1.0])
    np.testing.assert_allclose(smoothing_scales(activation, weight, 0.5), [2.0, 0.5, 1.0])  # dead channel: 1
    np.testing.assert_allclose(smoothing_scales(activation, weight, 0.0), [0.5, 0.25, 1.0])


def _planted(directory: Path, defect: str) -> Path:
    """A tiny sentence embedder whose layer-1 FFN output projection reads a planted defect:
    `outlier`: channels 0-7 a thousand times the rest (the product unchanged);
    `cancelling`: channels 0 and 1 equal and huge, their weight columns opposite, so that they
    cancel and the answer lies in the small channels that per-token int8 rounds away."""
    from conftest import save_tiny_sentence_transformer
    from transformers import BertModel

    save_tiny_sentence_transformer(directory, seed=7, config=TINY)
    model = BertModel.from_pretrained(directory)
    layer = model.encoder.layer[1]
    up, down = layer.intermediate.dense, layer.output.dense
    with torch.no_grad():
        if defect == "outlier":
            up.weight[:8] *= 1000.0
            up.bias[:8] = 1000.0
            down.weight[:, :8] /= 1000.0
        else:
            up.weight[1] = up.weight[0] = up.weight[0] * 1000.0
            up.bias[1] = up.bias[0] = 1000.0
            down.weight[:, 0] = down.weight[:, 0] * 1000.0
            down.weight[:, 1] = -down.weight[:, 0]
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def outlier_checkpoint(tmp_path_factory) -> Path:
    return _planted(tmp_path_factory.mktemp("outlier"), "outlier")


@pytest.fixture(scope="module")
def cancelling_checkpoint(tmp_path_factory) -> Path:
    return _planted(tmp_path_factory.mktemp("cancelling"), "cancelling")


def _plan_inputs(checkpoint: Path) -> tuple:
    """(the PyTorch embedder, the shipped sentences' rows, every linear's key) the int8 plan measures."""
    from compile.checkpoint import inspect_checkpoint, load_wrapper

    info = inspect_checkpoint(checkpoint, "embed")
    wrapper = load_wrapper(info, "embed")
    keys = {module_key(n) for n, m in wrapper.named_modules() if isinstance(m, torch.nn.Linear)}
    return wrapper, sentence_rows(checkpoint / "tokenizer.json", info.max_seq), keys


def _plan(checkpoint: Path, gate, report=lambda text: None, keep_out: bool = True):
    from compile.int8_plan import plan_int8

    wrapper, rows, keys = _plan_inputs(checkpoint)
    return plan_int8(wrapper, rows, keys, embedding_agreement, gate, report=report, keep_out=keep_out)


def test_plan_smooths_an_outlier_channel_away(outlier_checkpoint):
    from compile.int8_plan import ALPHAS

    reported = []
    plan = _plan(outlier_checkpoint, lambda accuracy: not precision.gate_failures("int8", accuracy), reported.append)
    assert plan.alphas[0.0]["cosine_min"] < 0.998  # unsmoothed, the outlier costs accuracy
    assert plan.alpha > 0 and plan.simulated["cosine_min"] > 0.9999 and plan.fallback == []
    assert module_key(SENSITIVE) in plan.scales
    # every linear in int8 keeps the gate: no fallback to choose, so no sensitivity pass is run
    assert plan.sensitivity == [] and plan.units == 8
    assert len(reported) == 1 and reported[0].startswith(f"smoothing: alpha {plan.alpha} of {len(ALPHAS)} tried")


def test_a_plan_with_no_linear_left_in_int8_has_nothing_to_offer():
    from compile.int8_plan import Int8Plan, Sensitivity

    units = [Sensitivity(name, {"cosine_min": 0.999, "cosine_mean": 0.9999}) for name in ("qkv", "out", "ffn")]
    plan = Int8Plan(alpha=0.5, scales={}, fallback=["ffn", "qkv"], fallback_keys=set(), simulated={},
                    sensitivity=units, units=len(units))
    assert plan.refusal(0.999) is None  # one group still in int8
    plan.fallback.append("out")
    assert plan.refusal(0.999) == ("int8 cannot keep --min-cosine 0.999 with any linear in int8 "
                                   "(simulated on the shipped sentences)")
    assert plan.refusal(None).startswith("int8 cannot keep its accuracy gate with any linear in int8")
    nothing_fits = Int8Plan(alpha=0.0, scales={}, fallback=[], fallback_keys=set(), simulated={})
    assert nothing_fits.refusal(None) == "no linear fits the int8 kernel's panels"


def test_int8_refuses_before_building_when_its_gate_needs_every_linear_out_of_int8(outlier_checkpoint, tmp_path,
                                                                                  monkeypatch):
    from conftest import compile_artifact

    from compile.errors import ValidationError

    monkeypatch.setitem(precision.GATES, "int8", Gate(1.01, 1.01, 1.0, 0.0))  # no arithmetic reaches it
    with pytest.raises(ValidationError, match=r"^--precision int8: int8 cannot keep its accuracy gate with any linear "
                                              r"in int8 \(simulated on the shipped sentences\); use --precision auto"):
        compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8", generic_shapes=["3x20"])
    assert not (tmp_path / "out").exists()


def test_plan_keeps_a_linear_no_scaling_rescues_out_of_int8(cancelling_checkpoint):
    strict = Gate(cosine_min=0.9999, cosine_mean=0.9999, top1_agreement=1.0, max_probability_diff=0.0)
    reported = []
    plan = _plan(cancelling_checkpoint, lambda accuracy: not strict.failures(accuracy), reported.append)
    assert all(accuracy["cosine_min"] < 0.9999 for accuracy in plan.alphas.values())
    assert plan.sensitivity[0].unit == SENSITIVE  # the most sensitive: keeping it alone out helps most
    # its progress: the alpha chosen, the sensitivity passes in quarters (the last one complete), the fallback
    units = len(plan.sensitivity)
    assert units == plan.units == 8
    assert reported[1:-1] == [f"sensitivity: {done}/{units} linear groups"
                              for done in sorted({units * q // 4 for q in (1, 2, 3, 4)})]
    assert reported[-1].startswith("fallback: 1/8 linear groups kept in")
    assert plan.fallback == [SENSITIVE] and plan.fallback_keys == {module_key(SENSITIVE)}
    assert plan.simulated["cosine_min"] >= 0.9999
    assert module_key(SENSITIVE) not in plan.scales  # a kept linear is not smoothed either
    # a plan that may keep nothing out has nothing to offer here, and runs no sensitivity pass for it
    reported.clear()
    assert _plan(cancelling_checkpoint, lambda accuracy: not strict.failures(accuracy), reported.append,
                 keep_out=False) is None
    assert len(reported) == 1 and reported[0].startswith("smoothing:")


class _AdditiveSimulation:
    """Injected accuracies: each unit in int8 takes its own loss off the least cosine of the units
    kept out (every unit kept: 1.0), as independent rounding errors do."""

    def __init__(self, units: dict[str, tuple[int, float]]):  # name -> (multiply-adds per token, loss)
        from types import SimpleNamespace

        self.units = [SimpleNamespace(name=name, keys={name}, multiply_adds=lambda m=m: m)
                      for name, (m, _) in units.items()]
        self.loss = {name: loss for name, (_, loss) in units.items()}
        self.fallback_precision = "fp32"
        self.runs = 0

    def release_layers(self) -> None:
        """Nothing is cached."""

    def accuracy(self, alpha: float, kept: set[str]) -> dict:
        self.runs += 1
        least = 1.0 - sum(loss for name, loss in self.loss.items() if name not in kept)
        return {"cosine_min": least, "cosine_mean": least}


def test_the_fallback_admits_the_least_loss_per_multiply_add_to_int8_while_the_gate_holds():
    """int8's error spread over every unit (as on MiniLM's shortest sentences): the units admitted
    are those that lose least per multiply-add saved, one that would break the gate is passed over
    for later, cheaper ones, and the record lists the costliest first."""
    from compile.int8_plan import admit, measure_sensitivity

    simulation = _AdditiveSimulation({"qkv": (3, 3e-4), "out": (1, 2e-4), "up": (4, 2e-4), "down": (4, 6e-4),
                                      "tiny": (1, 0.0)})
    reported = []
    sensitivity = measure_sensitivity(simulation, 0.5, reported.append)
    # losses per multiply-add: out 2e-4, down 1.5e-4, qkv 1e-4, up 0.5e-4, tiny 0
    assert [s.unit for s in sensitivity] == ["out", "down", "qkv", "up", "tiny"]
    assert reported[-1] == "sensitivity: 5/5 linear groups"
    accuracy, kept = admit(simulation, 0.5, sensitivity, lambda accuracy: accuracy["cosine_min"] >= 1 - 7e-4)
    # tiny, up (2e-4) and qkv (5e-4 in all) are admitted; down would lose 11e-4, out fits after it (7e-4)
    assert kept == ["down"] and accuracy["cosine_min"] == pytest.approx(1 - 7e-4)
    assert simulation.runs == 1 + 5 + 5  # every unit kept, each alone in int8, one trial per unit


def test_the_plan_keeps_the_simulations_tolerance_to_spare():
    """A plan stops at the floor, and a built library loses up to SIMULATION_TOLERANCE more than its
    simulation (its fp32 and bf16 round otherwise than PyTorch's, which moves activations across
    quantization steps), so the gate is asked with that much to spare: the unit that left exactly
    the floor is not admitted."""
    from compile.int8_plan import admit, measure_sensitivity, with_margin
    from compile.int8_simulation import SIMULATION_TOLERANCE

    simulation = _AdditiveSimulation({"qkv": (3, 3e-4), "out": (1, 2e-4), "up": (4, 2e-4), "down": (4, 6e-4),
                                      "tiny": (1, 0.0)})
    sensitivity = measure_sensitivity(simulation, 0.5, lambda line: None)
    floor = with_margin(lambda accuracy: accuracy["cosine_min"] >= 1 - 7e-4, SIMULATION_TOLERANCE)
    accuracy, kept = admit(simulation, 0.5, sensitivity, floor)
    assert kept == ["out", "down"] and accuracy["cosine_min"] == pytest.approx(1 - 5e-4)  # out: 1 - 7e-4, no spare


def test_a_plan_whose_library_lost_more_than_its_margin_is_admitted_again_with_what_that_library_lost():
    """The library of a plan that kept 10% to spare lost 1.5x its simulated loss, under the floor: the plan
    is admitted again from the same sensitivity with 50% + 10% to spare, and keeps out what that needs. A
    library that loses within the margin, or a classifier's (no cosine), leaves nothing to admit again."""
    from compile.int8_plan import Planner
    from compile.int8_simulation import SIMULATION_TOLERANCE

    simulation = _AdditiveSimulation({"qkv": (3, 3e-4), "out": (1, 2e-4), "up": (4, 2e-4), "down": (4, 6e-4),
                                      "tiny": (1, 0.0)})
    floor = 1 - 7e-4
    planner = Planner(simulation, {0.0: simulation.accuracy(0.0, set())}, 0.0,
                      lambda accuracy: accuracy["cosine_min"] >= floor, lambda line: None)
    plan = planner.plan(SIMULATION_TOLERANCE)
    assert plan.fallback == ["out", "down"] and plan.margin == SIMULATION_TOLERANCE
    runs = simulation.runs
    replanned = plan.replanned({"cosine_min": 1 - 1.5 * 5e-4, "cosine_mean": 0.9999})
    assert replanned.margin == pytest.approx(0.5 + SIMULATION_TOLERANCE)
    # spared 60%: up and tiny (2e-4), then out (4e-4, 6.4e-4 spared); qkv (5e-4 -> 8e-4) and down stay out
    assert replanned.fallback == ["down", "qkv"] and replanned.simulated["cosine_min"] == pytest.approx(1 - 4e-4)
    assert replanned.fallback_keys == {"down", "qkv"} and replanned.planner is planner
    assert simulation.runs == runs + 5  # the sensitivity is not measured again: one trial per unit
    assert 1 - (1 + 0.5) * (1 - replanned.simulated["cosine_min"]) >= floor  # a library off alike keeps it
    assert plan.replanned({"cosine_min": 1 - 5e-4, "cosine_mean": 0.9999}) is None  # as simulated: no change
    assert plan.replanned({"top1_agreement": 0.9, "max_probability_diff": 0.1}) is None


def test_the_plan_runs_the_linears_it_keeps_in_their_own_precision(outlier_checkpoint):
    """Kept in fp32, the model is the reference itself; kept in bf16, the simulation rounds their
    operands as the bf16 kernels do, so the plan's numbers include bf16's error."""
    from compile.int8_simulation import Simulation

    def largest_difference(actual, reference):  # relative to the largest output
        return {"difference": float(np.abs(actual - reference).max() / np.abs(reference).max())}

    wrapper, rows, keys = _plan_inputs(outlier_checkpoint)
    difference = {}
    for fallback_precision in ("fp32", "bf16"):
        simulation = Simulation(wrapper, rows, keys, largest_difference, fallback_precision=fallback_precision)
        difference[fallback_precision] = simulation.accuracy(0.0, {u.name for u in simulation.units})["difference"]
    assert difference["fp32"] == 0.0
    assert 1e-5 < difference["bf16"] < 2**-6, difference  # bf16 keeps 8 significant bits: visible, small


def test_the_simulation_rounds_a_bf16_value_projection_with_the_smoothing_folded_into_it(outlier_checkpoint):
    """An attention output projection smoothed in int8 has its 1 / s folded into the V projection's
    weight rows and bias (passes/smooth.py), so a V kept in bf16 rounds W / s, not W, and the output
    projection reads the context already divided: the simulation computes what a model with the fold
    applied by hand computes (rounding W and dividing V's output after it is 1.5e-4 of the largest
    output away here)."""
    import copy

    from compile.int8_simulation import Simulation

    def outputs(actual, reference):
        return {"actual": actual}

    wrapper, rows, keys = _plan_inputs(outlier_checkpoint)
    simulation = Simulation(wrapper, rows, keys, outputs, fallback_precision="bf16")
    simulation.calibrate()
    output = next(u for u in simulation.units if u.name.endswith("layer.0.attention.output.dense"))
    others = {u.name for u in simulation.units} - {output.name}
    simulated = simulation.accuracy(0.5, others)["actual"]

    folded = copy.deepcopy(wrapper)  # the compile's rewrite, by hand: V's rows / s, the projection's columns * s
    modules = dict(folded.named_modules())
    scale = torch.from_numpy(simulation.scales(output, 0.5))
    value = modules[output.name.replace("attention.output.dense", "attention.self.value")]
    with torch.no_grad():
        value.weight.mul_((1.0 / scale)[:, None])
        value.bias.mul_(1.0 / scale)
        modules[output.name].weight.mul_(scale)
    by_hand = Simulation(folded, rows, keys, outputs, fallback_precision="bf16")
    expected = by_hand.accuracy(0.0, others)["actual"]
    assert np.abs(simulated - expected).max() < 1e-5 * np.abs(expected).max()  # 1.5e-4 with W rounded unscaled



def test_the_simulation_runs_the_sentences_in_length_batches_and_answers_in_their_order(outlier_checkpoint):
    """The plan's passes skip the padding: the sentences sorted by length, in batches each cut to its
    longest, as few tokens computed as a forward pass's fixed cost allows; the outputs come back in
    the sentences' order and equal the padded batch's. The linears it replaces get their forward
    back after each pass."""
    from compile.int8_simulation import FORWARD_COST_TOKENS, Simulation, length_batches

    wrapper, rows, keys = _plan_inputs(outlier_checkpoint)
    batches, restore = length_batches(rows)
    lengths = [batch[1].sum(1) for batch in batches]
    assert all(int(length.max()) == batch[1].shape[1] for length, batch in zip(lengths, batches))  # cut to the longest
    assert sorted(np.concatenate(lengths).tolist()) == sorted(rows[1].sum(1).tolist())
    computed = sum(batch[1].numel() for batch in batches)
    assert len(batches) > 1 and computed + FORWARD_COST_TOKENS * len(batches) < rows[1].size + FORWARD_COST_TOKENS
    ids = torch.cat([torch.nn.functional.pad(batch[0], (0, rows[0].shape[1] - batch[0].shape[1])) for batch in batches])
    np.testing.assert_array_equal(ids.numpy()[restore], rows[0])

    simulation = Simulation(wrapper, rows, keys, lambda actual, reference: {"actual": actual})
    with torch.no_grad():
        padded = wrapper(*(torch.from_numpy(x) for x in rows)).numpy()
    np.testing.assert_allclose(simulation.reference, padded, rtol=0, atol=1e-5 * np.abs(padded).max())
    simulation.calibrate()
    assert not np.array_equal(simulation.accuracy(0.5, set())["actual"], simulation.reference)
    assert not any("forward" in vars(module) for module in wrapper.modules())

    # the smoothing is calibrated on the rows as given, bit for bit: the library is built with it
    mask, maxima = torch.from_numpy(rows[1]).bool(), {}

    def record(module, inputs, output):
        found = inputs[0][mask].abs().amax(0)
        maxima[module] = torch.maximum(maxima[module], found) if module in maxima else found

    handles = [module.register_forward_hook(record) for unit in simulation.units for module in unit.modules[:1]]
    with torch.no_grad():
        wrapper(*(torch.from_numpy(x) for x in rows))
    for handle in handles:
        handle.remove()
    for unit in simulation.units:
        np.testing.assert_array_equal(unit.activation_max, maxima[unit.modules[0]].numpy())


def test_a_pass_starts_after_the_layers_it_shares_with_an_earlier_one_and_answers_the_same(outlier_checkpoint):
    """The plan's passes change one unit at a time: a pass whose layer-0 units are as in an earlier
    pass takes layer 0's outputs from it (its linears do not run) and answers exactly what a
    simulation with no earlier passes answers; a change in layer 0 runs every layer."""
    from compile.int8_simulation import Simulation

    def outputs(actual, reference):
        return {"actual": actual}

    wrapper, rows, keys = _plan_inputs(outlier_checkpoint)
    simulation = Simulation(wrapper, rows, keys, outputs)
    simulation.calibrate()
    everyone = {unit.name for unit in simulation.units}
    in_layer = {index: next(u for u in simulation.units if f"layer.{index}.output.dense" in u.name) for index in (0, 1)}
    runs = dict.fromkeys(in_layer, 0)
    for index, unit in in_layer.items():
        unit.modules[0].register_forward_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    batches = len(simulation.batches)
    configurations = [everyone, everyone - {in_layer[1].name}, everyone - {in_layer[0].name}]
    answers, counted = [], []
    for kept in configurations:
        before = dict(runs)
        answers.append(simulation.accuracy(0.5, kept)["actual"])
        counted.append({index: runs[index] - before[index] for index in runs})
    assert counted == [{0: batches, 1: batches}, {0: 0, 1: batches}, {0: batches, 1: batches}]
    for kept, answer in zip(configurations, answers):
        fresh = Simulation(wrapper, rows, keys, outputs)
        fresh.calibrate()
        np.testing.assert_array_equal(answer, fresh.accuracy(0.5, kept)["actual"])
    assert not np.array_equal(answers[0], answers[1])
    assert not any("forward" in vars(module) for module in wrapper.modules())


@pytest.mark.parametrize("chained", [True, False])
def test_only_layers_that_run_as_a_chain_are_taken_from_earlier_passes(chained):
    """A pass may start from a layer's stored output only where the layers run once each, in order,
    each on the output of the one before: a ModuleList of branches that all read one input gives the
    cache no layers."""
    from compile.int8_simulation import Simulation

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, ids, mask):
            x = torch.nn.functional.one_hot(ids % 8, 8).float()
            if chained:
                for layer in self.layers:
                    x = layer(x)
                return x.mean(1)
            return sum(layer(x) for layer in self.layers).mean(1)

    model = Stack()
    rows = (np.arange(24).reshape(3, 8), np.ones((3, 8), dtype=np.int64))
    keys = {f"layers_{index}" for index in range(3)}
    simulation = Simulation(model, rows, keys, lambda actual, reference: {"actual": actual})
    assert simulation.layer_cache.layers == (list(model.layers) if chained else [])
    assert len(simulation.units) == (3 if chained else 1)  # branches read one input: one unit


def test_length_batches_split_where_the_padding_saved_outweighs_a_pass():
    """A long row beside short ones gets its own batch; rows a few tokens apart share one."""
    from compile.int8_simulation import FORWARD_COST_TOKENS, length_batches

    def split(lengths):
        mask = (np.arange(max(lengths))[None] < np.array(lengths)[:, None]).astype(np.int64)
        batches, restore = length_batches((mask * 7, mask))
        return [sorted(batch[1].sum(1).tolist()) for batch in batches], restore

    batches, restore = split([60, 1, 1, 1])
    assert batches == [[1, 1, 1], [60]] and restore.tolist() == [3, 0, 1, 2]
    near = FORWARD_COST_TOKENS // 4  # padding 3 rows by less than a pass costs: one batch
    assert split([near, 1, 1, 1])[0] == [[1, 1, 1, near]]
def test_concatenated_qkv_is_one_linear_of_three_modules(tiny_bert_dir):
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.packing import linears_on_weights
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    imported = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, info.config["vocab_size"])
    mod = apply_strategy(imported.mod, "concat")
    modules = sorted(linear_modules(mod["main"], linears_on_weights(mod["main"])).values())
    assert len(modules) == 2 * 4
    assert ["bert_encoder_layer_0_attention_self_key", "bert_encoder_layer_0_attention_self_query",
            "bert_encoder_layer_0_attention_self_value"] in modules


def _pytorch(checkpoint: Path, sentences: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint), device="cpu").encode(sentences, batch_size=1)


def _artifact(directory: Path, sentences: list[str]) -> np.ndarray:
    return artifact_outputs(directory, sentences)


def test_smoothed_int8_artifact_matches_pytorch(outlier_checkpoint, tmp_path):
    from conftest import compile_artifact

    manifest, _ = compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8",
                                   generic_shapes=["3x20"])
    quantization = manifest.quantization
    assert quantization.linears == 8 and quantization.smoothed == 8 and quantization.smoothing_alpha > 0
    assert quantization.cosine_min > 0.9999 and quantization.worst_sentence is not None
    assert quantization.sensitivity == [] and quantization.kept == []  # measured only to choose a fallback
    assert "SmoothLinears" in manifest.passes.strategies["concat"].pipeline
    assert cosines(_artifact(tmp_path / "out", UNSEEN), _pytorch(outlier_checkpoint, UNSEEN)).min() > 0.9999


@pytest.mark.parametrize("mcpu", ["x86-64-v3", None], ids=["avx2-fp32-fallback", "this-cpu"])
def test_a_linear_that_loses_stays_out_of_int8(cancelling_checkpoint, tmp_path, mcpu):
    """Under a cosine floor int8 alone cannot keep, the planted linear stays bf16 where the CPU has
    AVX512_BF16, else fp32 (x86-64-v3: AVX2, no bf16), recorded in the manifest; the answers stay
    PyTorch's. Attention's products are asked for (fp32), so that no timing of this tiny model's
    kernel (tens of microseconds, within noise) decides the kept unit's precision. Kept in fp32, the
    library loses what its plan's simulation said it would."""
    from conftest import compile_artifact
    from safetensors.numpy import load_file

    from artifact.cpu_features import missing_on_host, target_features

    target = make_target("cpu", mcpu=mcpu)
    if missing_on_host(target_features(target)):
        pytest.skip(f"this CPU cannot run code for {mcpu}")
    fallback_precision = kept_precision(target)  # untimed: attention's products are asked for below
    if mcpu is None and fallback_precision == "fp32":
        pytest.skip("this CPU has no AVX512_BF16: the x86-64-v3 case covers the fp32 fallback")
    out = tmp_path / "out"
    manifest, _ = compile_artifact(cancelling_checkpoint, out, ["1x5"], precision="int8", min_cosine=0.9999,
                                   attention_products="fp32", generic_shapes=["3x20"],
                                   **({"mcpu": mcpu} if mcpu else {}))
    quantization = manifest.quantization
    assert [(k.unit, k.precision) for k in quantization.kept] == [(SENSITIVE, fallback_precision)]
    assert quantization.linears == 7 and quantization.cosine_min >= 0.9999
    weights = load_file(str(out / manifest.weights["concat"].file))
    assert sum(1 for w in weights.values() if w.dtype == np.int8) == 7
    assert cosines(_artifact(out, UNSEEN), _pytorch(cancelling_checkpoint, UNSEEN)).min() > 0.9999
    if fallback_precision == "fp32":
        _assert_the_library_loses_what_its_simulation_said(out)


def _misplanned(monkeypatch) -> list[str]:
    """A simulation that claims a tenth of what int8 loses, so that the plan puts every linear of the
    cancelling checkpoint in int8 past --min-cosine 0.9999 (its planted linear alone loses ~4e-4); and
    the list of the libraries the compile then builds, by their path in the staging directory."""
    from compile.int8_simulation import Simulation
    from compile.phases import libraries

    simulate, build = Simulation.accuracy, libraries.build_library
    built = []

    def a_tenth_of_the_loss(self, alpha, kept):
        accuracy = simulate(self, alpha, kept)
        return {**accuracy, "cosine_min": 1 - (1 - accuracy["cosine_min"]) / 10}

    def counted(mod, target, path, **kwargs):
        built.append("/".join(path.parts[next(i for i, part in enumerate(path.parts) if ".staging" in part) + 1:]))
        return build(mod, target, path, **kwargs)

    monkeypatch.setattr(Simulation, "accuracy", a_tenth_of_the_loss)
    monkeypatch.setattr(libraries, "build_library", counted)
    return built


def test_a_plan_its_library_misses_is_admitted_again_before_the_buckets_are_built(cancelling_checkpoint, tmp_path,
                                                                                monkeypatch, caplog):
    """The plan's generic library, built and measured first, misses --min-cosine by ~10x the simulated
    loss: the plan is admitted again with that margin, keeps the planted linear out, and is built again;
    then the bucket and the generic library are built once. The artifact keeps the floor and records
    the margin its plan kept."""
    from conftest import compile_artifact

    built = _misplanned(monkeypatch)
    caplog.set_level("INFO", logger="compile.phases.decisions")
    manifest, _ = compile_artifact(cancelling_checkpoint, tmp_path / "out", ["1x5"], precision="int8",
                                   min_cosine=0.9999, mcpu="x86-64-v3", attention_products="fp32",
                                   generic_shapes=["3x20"])
    quantization = manifest.quantization
    assert [kept.unit for kept in quantization.kept] == [SENSITIVE] and quantization.cosine_min >= 0.9999
    assert 5 < quantization.plan_margin < 15  # the library lost ~10x the simulated loss
    assert built == ["int8-plan/plan-0/lib/generic.concat.so", "int8-plan/plan-1/lib/generic.concat.so",
                     "lib/bucket_1x5.concat.so", "lib/generic.concat.so"]
    assert any("planned again" in record.getMessage() for record in caplog.records)


def test_autos_int8_candidate_is_planned_again_where_its_library_misses(cancelling_checkpoint, tmp_path, monkeypatch):
    """`auto` measures its int8 candidate on the same check: planned again after its first library
    missed the floor, the candidate it measured and timed keeps it. The candidates' timing is injected
    (int8 at half fp32's time), so that which precision ships, and so which tolerance the shipped
    libraries are validated to, does not hang on this machine's speed."""
    from conftest import compile_artifact

    from compile.phases import decisions

    def int8_at_half_the_time(candidates, repeats, **_):
        return {name: {"median_s": 0.5 if name == "int8" else 1.0} for name in candidates}

    built = _misplanned(monkeypatch)
    monkeypatch.setattr(decisions, "interleaved_medians", int8_at_half_the_time)
    manifest, _ = compile_artifact(cancelling_checkpoint, tmp_path / "out", ["1x5"], precision="auto",
                                   min_cosine=0.9999, mcpu="x86-64-v3", attention_products="fp32",
                                   generic_shapes=["3x20"])
    (int8,) = [candidate for candidate in manifest.precision.candidates if candidate.precision == "int8"]
    assert int8.cosine_min >= 0.9999 and not int8.gate_failures
    assert [path for path in built if path.startswith("precision/int8/")] == [
        "precision/int8/plan-0/lib/generic.concat.so", "precision/int8/plan-1/lib/generic.concat.so"]


def _assert_the_library_loses_what_its_simulation_said(out: Path) -> None:
    """On the shipped sentences, the library's least cosine loses its plan's simulated loss, to within
    the tolerance the plan keeps to spare (and each sentence nearly so); computed in float64, where the
    manifest's float32 cosines hold a few steps of these losses (`loadtest.plan_fidelity`)."""
    from compile.int8_simulation import SIMULATION_TOLERANCE
    from loadtest.plan_fidelity import library_and_simulated_losses

    built_loss, simulated_loss = library_and_simulated_losses(out)
    assert simulated_loss.max() > 0
    assert abs(built_loss.max() / simulated_loss.max() - 1) < SIMULATION_TOLERANCE
    assert np.all(np.abs(built_loss / simulated_loss - 1) < 2 * SIMULATION_TOLERANCE)


def test_int8_under_its_gate_fails_the_compile_naming_the_worst_sentence(outlier_checkpoint, tmp_path, monkeypatch):
    """The built library is measured again: where it misses the gate that its plan kept in
    simulation, the compile fails (the plan here ran under the shipped gate, the build under one
    no arithmetic reaches)."""
    from conftest import compile_artifact

    from compile.errors import ValidationError
    from compile.phases import decisions

    shipped_gate, plan_for = precision.GATES["int8"], decisions.plan_for

    def plan_under_the_shipped_gate(*args, **kwargs):
        with monkeypatch.context() as planning:
            planning.setitem(precision.GATES, "int8", shipped_gate)
            return plan_for(*args, **kwargs)

    monkeypatch.setattr(decisions, "plan_for", plan_under_the_shipped_gate)
    monkeypatch.setitem(precision.GATES, "int8", Gate(1.01, 1.01, 1.0, 0.0))
    with pytest.raises(ValidationError, match=r"^--precision int8 misses its accuracy gate .*cosine_min [\d.]+ < 1\.01"
                                              r".* \(least on ['\"].+['\"]\); use"):
        compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8", generic_shapes=["3x20"])
    assert not (tmp_path / "out").exists()


def test_integer_products_are_exact_at_the_int8_bound():
    """The simulation's integer products are the exact sums rounded once, where one fp32 product
    rounds as it sums: activations and weights near their largest over a 3072-long inner axis
    (a 12 x 768 BERT's FFN down: sums past 2^25), and a 384-long one, which fp32 sums exactly."""
    from compile.int8_simulation import integer_matmul
    from compile.kernels.int8 import WEIGHT_CODES as weight_max

    generator = torch.Generator().manual_seed(0)
    a = torch.randint(200, 256, (6, 3072), generator=generator).float()
    b = torch.randint(weight_max - 30, weight_max + 1, (5, 3072), generator=generator).float()
    exact = (a.double() @ b.double().T).float()
    assert torch.equal(integer_matmul(a, b, 255 * weight_max), exact)
    assert not torch.equal(a @ b.T, exact)  # one fp32 product
    short = (a[:, :384], b[:, :384])
    assert torch.equal(integer_matmul(*short, 255 * weight_max), (short[0].double() @ short[1].double().T).float())
