"""Which linears int8 quantizes, how each is smoothed, and which stay in a higher precision:
decided by measurement on the shipped sentences (and an embedder's random token rows:
passes/quantize.py's `accuracy_rows`), before anything is built.

Each measurement is a pass of the int8 simulation (int8_simulation.py: the PyTorch model with the
chosen linears computed as the int8 library computes them, ~0.2 s on MiniLM), so the plan can afford:

1. calibration: each linear's largest |activation| per input channel;
2. alpha: the SmoothQuant strength (compile/passes/smooth.py) with the best least cosine;
3. sensitivity, where every linear in int8 misses the int8 gate (compile/precision.py) or
   `--min-cosine`: for each linear group, the accuracy with it alone in int8 and the rest in the
   higher precision (one pass per group, every other one in a forked child on the core the plan's
   one PyTorch thread leaves idle; and one more per group in 4.; not spent where nothing is kept);
4. fallback: starting from every group in the higher precision (bf16 where the CPU has it, else
   fp32; simulated in it, bf16 rounds too), the groups are admitted to int8 one at a time, the
   least accuracy lost per multiply-add saved first, each only where the simulation still keeps
   the gate and `--min-cosine`; the rest stay out. int8's error on a short input is spread over
   every group (MiniLM's least cosine, on "thank you", gains at most 0.0016 from any one group
   kept out), so keeping out the most sensitive groups first would keep 22 of MiniLM's 24 out of
   int8 at least cosine 0.999, where admission puts 14 in int8 (49% of the multiply-adds).

Where attention's products run in int8 or bf16 (attention_products.py), every pass simulates them
as well, so that the plan, which admits groups down to the floor (less its tolerance), stops near
where the built library does.

The simulation is close, not exact (its margin, `SIMULATION_TOLERANCE`, covers what MiniLM's libraries
have shown), so the compile measures the plan's built library before it builds the rest
(compile/phases/decisions.py, `checked_int8_candidate`): where that misses what the plan kept, the plan is
admitted again from the same simulation and sensitivity with the margin that library showed it needs
(`Int8Plan.replanned`), and built again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import tvm

from . import precision
from .capabilities import Capabilities
from .int8_simulation import SIMULATION_TOLERANCE, CalibrationPass, Simulation, calibration_pass
from .kernels import int8
from .passes.packing import linears_on_weights
from .passes.smooth import linear_modules
from .workers import Computed, Workers

if TYPE_CHECKING:
    from .checkpoint import CheckpointInfo

ALPHAS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # 0: no smoothing
log = logging.getLogger(__name__)


@dataclass
class Sensitivity:
    """One unit's accuracy (`agreement`'s keys) when it alone is in int8, the rest in the higher precision."""

    unit: str
    accuracy: dict


@dataclass
class Int8Plan:
    """What the int8 passes apply: smoothing vectors per module key, the units kept out of int8."""

    alpha: float
    scales: dict[str, np.ndarray]
    fallback: list[str]  # unit names, the most accuracy lost per multiply-add first
    fallback_keys: set[str]
    simulated: dict  # cosine_min, cosine_mean of the plan, simulated
    alphas: dict[float, dict] = field(default_factory=dict)  # alpha -> simulated accuracy, nothing kept
    sensitivity: list[Sensitivity] = field(default_factory=list)  # measured where a fallback was needed
    fallback_precision: str = "fp32"  # what the kept units run in (`kept_precision`)
    units: int = 0  # linear groups the int8 kernel fits
    margin: float = SIMULATION_TOLERANCE  # the fraction of its simulated loss the plan kept to spare
    planner: "Planner | None" = field(default=None, repr=False, compare=False)

    def refusal(self, min_cosine: float | None) -> str | None:
        """Why this int8 has nothing to offer (one line): no linear fits the kernel, or keeping the
        gate, and `min_cosine` where given, took every linear out of int8."""
        if not self.units:
            return "no linear fits the int8 kernel's panels"
        if len(self.fallback) < self.units:
            return None
        wanted = "its accuracy gate" if min_cosine is None else precision.min_cosine_flag(min_cosine)
        return f"int8 cannot keep {wanted} with any linear in int8 (simulated on the shipped sentences)"

    def replanned(self, built: dict) -> "Int8Plan | None":
        """This plan admitted again after its built library (`built`: its accuracy) missed the gate:
        with the margin widened to what that library lost beyond the simulation, plus
        SIMULATION_TOLERANCE for the units whose precision changes. None where a margin cannot help
        (a classifier's gate is not a cosine) or changes nothing."""
        if self.planner is None or "cosine_min" not in built or self.simulated["cosine_min"] >= 1.0:
            return None
        deviation = (1.0 - built["cosine_min"]) / (1.0 - self.simulated["cosine_min"]) - 1.0
        replanned = self.planner.plan(max(self.margin, deviation) + SIMULATION_TOLERANCE)
        return None if replanned.fallback == self.fallback else replanned

    def manifest_fields(self, quantized: int) -> dict:
        """The manifest's QuantizationEntry fields of this plan, for `quantized` int8 linears."""
        from artifact.manifest import KeptLinear, LinearSensitivity

        numbers = ("cosine_min", "cosine_mean", "top1_agreement", "max_probability_diff")
        reason = "not admitted to int8: there it took the simulation under its gate or --min-cosine"
        return {"smoothing_alpha": self.alpha, "smoothed": quantized if self.alpha > 0 else 0,
                "plan_margin": self.margin,
                "kept": [KeptLinear(unit=unit, precision=self.fallback_precision, reason=reason)
                         for unit in self.fallback],
                "sensitivity": [LinearSensitivity(unit=s.unit, **{k: s.accuracy[k] for k in numbers if k in s.accuracy})
                                for s in self.sensitivity]}


def score(accuracy: dict) -> tuple[float, float]:
    """What the plan maximises: (least cosine, mean cosine), or a classifier's (top-1 agreement,
    minus the largest probability difference)."""
    if "cosine_min" in accuracy:
        return accuracy["cosine_min"], accuracy["cosine_mean"]
    return accuracy["top1_agreement"], -accuracy["max_probability_diff"]

def plan_int8(wrapper: torch.nn.Module, rows: tuple[np.ndarray, ...], quantized_keys: set[str],
              agreement: Callable[[np.ndarray, np.ndarray], dict], passes_gate: Callable[[dict], bool],
              int16_pairs: bool = False, report: Callable[[str], None] = lambda text: None,
              fallback_precision: str = "fp32", attention_products: str = "fp32",
              keep_out: bool = True) -> Int8Plan | None:
    """Smoothing and fallback for the linears `quantized_keys` (the ones the int8 pass can
    quantize), measured on `rows` by `agreement`; `passes_gate(accuracy)` is what the plan must
    keep (with the simulation's tolerance to spare: `with_margin`); `int16_pairs`, whether the int8
    kernel sums pairs of products in int16 (`weight_scales`);
    `report(line)` hears how far it is (a 12-layer BERT takes minutes); `fallback_precision`, what
    the linears kept out of int8 run in; `attention_products` and `keep_out`: `plan_simulated`."""
    simulation = Simulation(wrapper, rows, quantized_keys, agreement, int16_pairs, fallback_precision)
    simulation.calibrate()
    return plan_simulated(simulation, passes_gate, report, attention_products, keep_out)


def plan_simulated(simulation: Simulation, passes_gate: Callable[[dict], bool], report: Callable[[str], None],
                   attention_products: str = "fp32", keep_out: bool = True,
                   alphas: tuple[float, ...] = ALPHAS) -> Int8Plan | None:
    """The plan measured on `simulation` (calibrated), with attention's products in `attention_products`
    (attention_products.py), at the smoothing of `alphas` that keeps the most; `keep_out` False: no
    fallback, None where every linear in int8 misses the gate. A simulation serves plans of several
    products: its calibration and fp32 reference are theirs."""
    simulation.use_products(attention_products)
    tried = dict(zip(alphas, simulation.accuracies([(alpha, set()) for alpha in alphas])))
    alpha = max(tried, key=lambda a: score(tried[a]))
    log.info("int8 smoothing alpha %s; %s", alpha, ", ".join(f"{a}: {score(r)[0]:.4f}" for a, r in tried.items()))
    report(f"smoothing: alpha {alpha} of {len(tried)} tried (least cosine {score(tried[alpha])[0]:.4f})")
    if not keep_out and not with_margin(passes_gate, SIMULATION_TOLERANCE)(tried[alpha]):
        return None
    return Planner(simulation, attention_products, tried, alpha, passes_gate, report).plan(SIMULATION_TOLERANCE)


@dataclass
class Planner:
    """What a plan is measured on (the simulation, its smoothing, the units' sensitivity once needed),
    kept so that the plan can be admitted again under a wider margin (`Int8Plan.replanned`)."""

    simulation: Simulation
    attention_products: str  # what the simulation's passes run attention's products in (several plans share it)
    alphas: dict[float, dict]
    alpha: float
    passes_gate: Callable[[dict], bool]  # the gate and --min-cosine, with nothing to spare
    report: Callable[[str], None]
    sensitivity: list[Sensitivity] = field(default_factory=list)

    def plan(self, tolerance: float) -> Int8Plan:
        """The units admitted to int8 while the simulation keeps the gate with `tolerance` of its
        loss to spare; every unit in int8 where that needs no fallback."""
        simulation, alpha = self.simulation, self.alpha
        simulation.use_products(self.attention_products)
        passes_gate = with_margin(self.passes_gate, tolerance)
        accuracy, kept = self.alphas[alpha], []
        if not passes_gate(accuracy):
            if not self.sensitivity:
                self.sensitivity = measure_sensitivity(simulation, alpha, self.report)
            accuracy, kept = admit(simulation, alpha, self.sensitivity, passes_gate)
            self.report(f"fallback: {len(kept)}/{len(simulation.units)} linear groups kept in "
                        f"{simulation.fallback_precision} (simulated least {score(accuracy)[0]:.4f})")
        simulation.release_layers()
        units = {unit.name: unit for unit in simulation.units}
        scales = {}
        if alpha > 0:
            for unit in simulation.units:
                if unit.name not in kept:
                    scales.update({key: Simulation.scales(unit, alpha) for key in unit.keys})
        simulated = ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items() if isinstance(v, float))
        log.info("int8 plan: alpha %s, margin %.2f, kept out of int8: %s; simulated %s", alpha, tolerance,
                 ", ".join(kept) or "none", simulated)
        return Int8Plan(alpha=alpha, scales=scales, fallback=kept,
                        fallback_keys={key for name in kept for key in units[name].keys},
                        simulated=accuracy, alphas=self.alphas, sensitivity=self.sensitivity,
                        fallback_precision=simulation.fallback_precision, units=len(units), margin=tolerance,
                        planner=self)


def with_margin(passes_gate: Callable[[dict], bool], tolerance: float) -> Callable[[dict], bool]:
    """`passes_gate` asked of a simulated accuracy whose least cosine lost `tolerance` more (a fraction
    of its loss): what the built library may lose beyond its simulation, so that a plan that stops at
    a floor builds above it."""
    def spared(accuracy: dict) -> dict:
        least = accuracy["cosine_min"]
        return {**accuracy, "cosine_min": least - tolerance * (1.0 - least)}

    if not tolerance:
        return passes_gate
    return lambda accuracy: passes_gate(spared(accuracy) if "cosine_min" in accuracy else accuracy)


def measure_sensitivity(simulation: Simulation, alpha: float, report: Callable[[str], None]) -> list[Sensitivity]:
    """Each unit's accuracy with it alone in int8, the most accuracy lost per multiply-add first."""
    everyone = {unit.name for unit in simulation.units}
    sensitivity, loss = [], {}
    quarters = sorted({len(simulation.units) * q // 4 for q in (1, 2, 3, 4)})

    def progress(done: int) -> None:  # of the passes after the first, every unit kept
        while quarters and quarters[0] <= done - 1:
            report(f"sensitivity: {quarters.pop(0)}/{len(simulation.units)} linear groups")

    kept, *alone = simulation.accuracies([(alpha, everyone)] + [(alpha, everyone - {unit.name})
                                                                for unit in simulation.units], progress)
    baseline = score(kept)
    for unit, accuracy in zip(simulation.units, alone):
        sensitivity.append(Sensitivity(unit.name, accuracy))
        lost = (max(0.0, b - a) / unit.multiply_adds() for b, a in zip(baseline, score(accuracy)))
        loss[unit.name] = (*lost, -unit.multiply_adds())  # of equal losses, the larger unit is admitted first
    sensitivity.sort(key=lambda s: loss[s.unit], reverse=True)
    log.info("int8 sensitivity (alone in int8): %s", ", ".join(f"{s.unit} {score(s.accuracy)[0]:.4f}"
                                                            for s in sensitivity[:4]))
    return sensitivity


def admit(simulation: Simulation, alpha: float, sensitivity: list[Sensitivity],
          passes_gate: Callable[[dict], bool]) -> tuple[dict, list[str]]:
    """(the simulated accuracy, the units kept out of int8): the units of `sensitivity` admitted to
    int8 from its end (the least accuracy lost per multiply-add) while the gate holds."""
    kept, accuracy = [s.unit for s in sensitivity], None
    for candidate in reversed(sensitivity):
        trial = simulation.accuracy(alpha, set(kept) - {candidate.unit})
        if passes_gate(trial):
            kept.remove(candidate.unit)
            accuracy = trial
            log.info("int8: %s admitted; simulated least %.5f", candidate.unit, score(trial)[0])
    return accuracy or simulation.accuracy(alpha, set(kept)), kept


def quantizable_modules(mod: tvm.IRModule, kernel: int8.Int8Kernel) -> set[str]:
    """The `module_key`s of the torch Linears whose Relax linear (in the imported, uncombined
    `main`) the int8 kernel's panels fit."""
    main = mod["main"]
    linears = linears_on_weights(main)
    return {key for var, keys in linear_modules(main, linears).items()
            if int8.quantizable(*(int(d) for d in linears[var].ty.shape), kernel) for key in keys}


def kept_precision(target: tvm.target.Target, bf16_pays: bool | None = None) -> str:
    """What units kept out of int8 run in: bf16 where the target's CPU has it, unless this CPU timed
    bf16 arithmetic slower than fp32 (`bf16_pays` False: attention_products.py's timing, as on Intel
    CPUs with AVX512_BF16 and no AMX, where `vdpbf16ps` issues at the FMA's rate); else fp32."""
    return "bf16" if Capabilities.of(target).bf16 and bf16_pays is not False else "fp32"


def start_calibration(workers: Workers, reference: torch.nn.Module, info: CheckpointInfo,
                      task: str) -> Computed[CalibrationPass]:
    """`simulation_for`'s calibration (`calibration_pass` on `accuracy_rows`), started in a child now: it
    needs the PyTorch model only, and the export that comes next runs on one core."""
    from .passes.quantize import accuracy_rows

    rows = accuracy_rows(info, task)
    return workers.compute("the int8 plan's calibration", lambda: calibration_pass(reference, rows))


def simulation_for(mod: tvm.IRModule, target: tvm.target.Target, reference: torch.nn.Module, info: CheckpointInfo,
                   task: str, bf16_pays: bool | None = None, taken: CalibrationPass | None = None) -> Simulation:
    """The int8 simulation of an imported model for `target`'s int8 kernel over the rows a precision is
    measured on (`accuracy_rows`: the shipped sentences, and an embedder's random token rows), against
    the fp32 `reference`, calibrated on them (`taken`: the calibration pass over them, where taken
    already, `start_calibration`); units left out of int8 run in `kept_precision`. Every plan of the
    model measures with it (`plan_for`), whatever attention's products."""
    from .passes.quantize import accuracy_rows, classifier_agreement, embedding_agreement

    kernel = Capabilities.of(target).int8_kernel
    agreement = classifier_agreement if task == "classify" else embedding_agreement
    rows = taken.rows if taken is not None else accuracy_rows(info, task)
    simulation = Simulation(reference, rows, quantizable_modules(mod, kernel), agreement, kernel.int16_pairs,
                            kept_precision(target, bf16_pays))
    simulation.calibrate(taken)
    return simulation


def plan_for(simulation: Simulation, min_cosine: float | None = None,
             report: Callable[[str], None] = lambda text: None, attention_products: str = "fp32",
             keep_out: bool = True, alphas: tuple[float, ...] = ALPHAS) -> Int8Plan | None:
    """The int8 plan measured on `simulation` (`simulation_for`) with the int8 gate
    (compile/precision.py) and `min_cosine`; `report` hears its progress."""
    return plan_simulated(simulation, lambda accuracy: not precision.accuracy_failures("int8", accuracy, min_cosine),
                          report, attention_products, keep_out, alphas)
