"""compile/int8_simulation.py: the int8 plan's PyTorch simulation of the kernels: its rounding, its length
batches, the layers a pass takes from an earlier one, and integer products exact at the int8 bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.int8_plans import plan_inputs

pytestmark = pytest.mark.slow  # collected first: see conftest.py


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

    wrapper, rows, keys = plan_inputs(outlier_checkpoint)
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
    from compile.int8_simulation import (FORWARD_COST_TOKENS, Simulation, calibration_pass, length_batches,
                                         simulation_threads)

    wrapper, rows, keys = plan_inputs(outlier_checkpoint)
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

    # the smoothing is calibrated on the rows as given, bit for bit (on the passes' threads): the library is
    # built with it; that pass's outputs are every candidate library's reference (`reference_outputs`)
    mask, maxima = torch.from_numpy(rows[1]).bool(), {}

    def record(module, inputs, output):
        found = inputs[0][mask].abs().amax(0)
        maxima[module] = torch.maximum(maxima[module], found) if module in maxima else found

    handles = [module.register_forward_hook(record) for unit in simulation.units for module in unit.modules[:1]]
    with torch.no_grad(), simulation_threads():
        padded = wrapper(*(torch.from_numpy(x) for x in rows)).numpy()
    for handle in handles:
        handle.remove()
    for unit in simulation.units:
        np.testing.assert_array_equal(unit.activation_max, maxima[unit.modules[0]].numpy())
    np.testing.assert_array_equal(calibration_pass(wrapper, rows).outputs, padded)


def test_a_pass_starts_after_the_layers_it_shares_with_an_earlier_one_and_answers_the_same(outlier_checkpoint):
    """The plan's passes change one unit at a time: a pass whose layer-0 units are as in an earlier
    pass takes layer 0's outputs from it (its linears do not run) and answers exactly what a
    simulation with no earlier passes answers; a change in layer 0 runs every layer."""
    from compile.int8_simulation import Simulation

    def outputs(actual, reference):
        return {"actual": actual}

    wrapper, rows, keys = plan_inputs(outlier_checkpoint)
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


@pytest.mark.parametrize("int8_matmul", [True, False], ids=["int8-matmul", "float-spans"])
def test_integer_products_are_exact_at_the_int8_bound(int8_matmul, monkeypatch):
    """The simulation's integer products are the exact sums rounded once, where one fp32 product
    rounds as it sums: activation codes and weights near their largest over a 3072-long inner axis
    (a 12 x 768 BERT's FFN down: sums past 2^25), and a 384-long one, which fp32 sums exactly; by
    PyTorch's int8 matmul, and by the float spans where this CPU's int8 matmul is not exact."""
    from compile import int8_simulation
    from compile.kernels.int8 import WEIGHT_CODES as weight_max

    if int8_matmul and not int8_simulation.int8_matmul_is_exact():
        pytest.skip("PyTorch's int8 matmul is not exact on this CPU: the float spans run instead")
    monkeypatch.setattr(int8_simulation, "int8_matmul_is_exact", lambda: int8_matmul)
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(200, 256, (2, 3, 3072), generator=generator).float()
    zero = torch.randint(0, 40, (2, 3, 1), generator=generator).float()
    weights = torch.randint(weight_max - 30, weight_max + 1, (5, 3072), generator=generator)
    weights[::2] *= -1
    weights = weights.to(torch.int8)
    for k in (3072, 384):
        a, b = codes[..., :k] - zero, weights[:, :k].contiguous()
        exact = (a.double() @ b.double().T).float()
        weight = int8_simulation.WeightCodes(b, torch.ones(5, 1), b.sum(1, dtype=torch.int32))
        assert torch.equal(int8_simulation.integer_matmul(codes[..., :k], zero, weight), exact)
    assert not torch.equal((codes - zero) @ weights.float().T, (((codes - zero).double()) @ weights.double().T).float())


def test_the_simulation_runs_on_one_thread_and_gives_the_threads_back(outlier_checkpoint):
    """Its passes' operators are small and libraries build beside them: PyTorch runs them on
    SIMULATION_THREADS, and the compile's own thread count is back after each; so does the calibration,
    one batch of every row padded to the longest (the compile takes it in a child beside the export)."""
    from compile.int8_simulation import SIMULATION_THREADS, Simulation

    wrapper, rows, keys = plan_inputs(outlier_checkpoint)
    seen, before = [], torch.get_num_threads()
    handle = wrapper.register_forward_hook(lambda *_args: seen.append(torch.get_num_threads()))
    try:
        torch.set_num_threads(2)
        simulation = Simulation(wrapper, rows, keys, lambda actual, reference: {"actual": actual})
        assert seen and set(seen) == {SIMULATION_THREADS}  # its probe and fp32 reference
        seen.clear()
        simulation.calibrate()
        assert seen == [SIMULATION_THREADS] and torch.get_num_threads() == 2
        seen.clear()
        simulated = simulation.accuracy(0.5, set())["actual"]
        assert seen and set(seen) == {SIMULATION_THREADS} and torch.get_num_threads() == 2
    finally:
        handle.remove()
        torch.set_num_threads(before)
    assert not np.array_equal(simulated, simulation.reference)
