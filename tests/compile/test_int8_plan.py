"""compile/int8_plan.py: the measured plan of which linears int8 smooths and keeps out, its progress, its
refusals and the margin it keeps to spare.

The plans are tested on tiny random BERTs with a planted defect (tests/support/checkpoints.py): an
outlier activation channel (which smoothing removes) or two huge channels that cancel in the product
(which no per-channel scaling removes: the linear must stay out of int8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compile import precision
from compile.passes.quantize import embedding_agreement
from compile.passes.smooth import module_key
from compile.precision import Gate
from tests.support.checkpoints import SENSITIVE_LINEAR
from tests.support.int8_plans import plan_inputs

pytestmark = pytest.mark.slow  # collected first: see conftest.py


def _plan(checkpoint: Path, gate, report=lambda text: None, keep_out: bool = True):
    from compile.int8_plan import plan_int8

    wrapper, rows, keys = plan_inputs(checkpoint)
    return plan_int8(wrapper, rows, keys, embedding_agreement, gate, report=report, keep_out=keep_out)


def test_plan_smooths_an_outlier_channel_away(outlier_checkpoint):
    from compile.int8_plan import ALPHAS

    reported = []
    plan = _plan(outlier_checkpoint, lambda accuracy: not precision.gate_failures("int8", accuracy), reported.append)
    assert plan.alphas[0.0]["cosine_min"] < 0.998  # unsmoothed, the outlier costs accuracy
    assert plan.alpha > 0 and plan.simulated["cosine_min"] > 0.9999 and plan.fallback == []
    assert module_key(SENSITIVE_LINEAR) in plan.scales
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
    from compile.errors import ValidationError
    from tests.support.artifacts import compile_artifact

    monkeypatch.setitem(precision.GATES, "int8", Gate(1.01, 1.01, 1.0, 0.0))  # no arithmetic reaches it
    # attention's products asked for (fp32): timing the kernels would not change the refusal
    with pytest.raises(ValidationError, match=r"^--precision int8: int8 cannot keep its accuracy gate with any linear "
                                              r"in int8 \(simulated on the shipped sentences\); use --precision auto"):
        compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8", attention_products="fp32",
                         generic_shapes=["3x20"])
    assert not (tmp_path / "out").exists()


def test_plan_keeps_a_linear_no_scaling_rescues_out_of_int8(cancelling_checkpoint):
    strict = Gate(cosine_min=0.9999, cosine_mean=0.9999, top1_agreement=1.0, max_probability_diff=0.0)
    reported = []
    plan = _plan(cancelling_checkpoint, lambda accuracy: not strict.failures(accuracy), reported.append)
    assert all(accuracy["cosine_min"] < 0.9999 for accuracy in plan.alphas.values())
    assert plan.sensitivity[0].unit == SENSITIVE_LINEAR  # the most sensitive: keeping it alone out helps most
    # its progress: the alpha chosen, the sensitivity passes in quarters (the last one complete), the fallback
    units = len(plan.sensitivity)
    assert units == plan.units == 8
    assert reported[1:-1] == [f"sensitivity: {done}/{units} linear groups"
                              for done in sorted({units * q // 4 for q in (1, 2, 3, 4)})]
    assert reported[-1].startswith("fallback: 1/8 linear groups kept in")
    assert plan.fallback == [SENSITIVE_LINEAR] and plan.fallback_keys == {module_key(SENSITIVE_LINEAR)}
    assert plan.simulated["cosine_min"] >= 0.9999
    assert module_key(SENSITIVE_LINEAR) not in plan.scales  # a kept linear is not smoothed either
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

    def use_products(self, products: str) -> None:
        self.products = products

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
    planner = Planner(simulation, "fp32", {0.0: simulation.accuracy(0.0, set())}, 0.0,
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

    wrapper, rows, keys = plan_inputs(outlier_checkpoint)
    difference = {}
    for fallback_precision in ("fp32", "bf16"):
        simulation = Simulation(wrapper, rows, keys, largest_difference, fallback_precision=fallback_precision)
        difference[fallback_precision] = simulation.accuracy(0.0, {u.name for u in simulation.units})["difference"]
    assert difference["fp32"] == 0.0
    assert 1e-5 < difference["bf16"] < 2**-6, difference  # bf16 keeps 8 significant bits: visible, small
