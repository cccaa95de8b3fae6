"""The arithmetic of the linear layers (fp32, bf16 or int8): the accuracy each must keep, and `auto`'s
choice among measured candidates (what a target runs: capabilities.py).

`--precision auto` builds every precision the target's CPU runs, measures each one's answers
against the PyTorch fp32 model on the shipped sentences (compile/sentences.py, one-word queries to
long passages; an embedder's also on random token rows: passes/quantize.py's `accuracy_rows`) and
its time per call, and ships the fastest one that keeps its gate, and `--min-cosine` where given (a
less accurate one only when faster by `PRECISION_MARGIN`). fp32 is the reference's own arithmetic
and always qualifies, so auto never ships less accuracy than a gate allows, whatever a candidate's
speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ValidationError

PRECISIONS = ("fp32", "bf16", "int8")  # most accurate first
PRECISION_MARGIN = 0.03  # how much faster a less accurate candidate must be to ship


@dataclass(frozen=True)
class Gate:
    """The least agreement with the fp32 model a precision must keep: embeddings by cosine
    similarity (least and mean over the sentences), classifiers by top-1 agreement and the
    largest difference of any label's probability."""

    cosine_min: float
    cosine_mean: float
    top1_agreement: float
    max_probability_diff: float

    def failures(self, accuracy: dict) -> list[str]:
        """What `accuracy` (the keys of `embedding_agreement` or `classifier_agreement`) misses."""
        checks = (("cosine_min", self.cosine_min, min), ("cosine_mean", self.cosine_mean, min),
                  ("top1_agreement", self.top1_agreement, min),
                  ("max_probability_diff", self.max_probability_diff, max))
        missed = []
        for key, bound, kind in checks:
            value = accuracy.get(key)
            if value is not None and (value < bound if kind is min else value > bound):
                missed.append(f"{key} {value:.5f} {'<' if kind is min else '>'} {bound:g}")
        return missed


# bf16 rounds each operand to 8 significant bits, with fp32 sums: embeddings keep cosine > 0.9999
# to fp32 on MiniLM (docs/PERFORMANCE.md), so 0.999 leaves room for deeper models, none for a bug.
GATES = {
    "bf16": Gate(cosine_min=0.999, cosine_mean=0.9995, top1_agreement=0.995, max_probability_diff=0.01),
    "int8": Gate(cosine_min=0.99, cosine_mean=0.997, top1_agreement=0.995, max_probability_diff=0.05),
}
ROUNDED = tuple(GATES)  # the precisions that round the linears' operands, each held to its gate


def gate_failures(precision: str, accuracy: dict) -> list[str]:
    """What `accuracy` misses of `precision`'s gate (fp32, the reference's own arithmetic, has none)."""
    gate = GATES.get(precision)
    return gate.failures(accuracy) if gate is not None else []


def min_cosine_flag(min_cosine: float) -> str:
    """`--min-cosine` as the user gave it, for messages (`:g` would print 0.9999999 as 1)."""
    return f"--min-cosine {min_cosine:.10g}"


def under_cosine_floor(precision: str, accuracy: dict, min_cosine: float | None) -> bool:
    """Whether a rounded precision's least cosine to the fp32 model is under `--min-cosine`."""
    cosine = accuracy.get("cosine_min")
    return precision in ROUNDED and None not in (min_cosine, cosine) and cosine < min_cosine


def accuracy_failures(precision: str, accuracy: dict, min_cosine: float | None) -> list[str]:
    """What `accuracy` misses of `precision`'s gate and of `--min-cosine` (one entry each)."""
    failures = gate_failures(precision, accuracy)
    if under_cosine_floor(precision, accuracy, min_cosine):
        failures.append(f"cosine_min {accuracy['cosine_min']:.5f} < {min_cosine_flag(min_cosine)}")
    return failures


def gate_refusal(precision: str, accuracy: dict, failures: list[str]) -> str:
    """One line: why `precision` fails its gate, naming the sentence that drifts most."""
    worst = f" (least on {accuracy['worst_sentence']!r})" if accuracy.get("worst_sentence") else ""
    return (f"--precision {precision} misses its accuracy gate to the fp32 model on the shipped sentences: "
            f"{'; '.join(failures)}{worst}; use --precision auto, bf16 or fp32")


def refuse_missed_gate(name: str, accuracy: dict, min_cosine: float | None) -> None:
    """Fail the compile (one line) where int8's measured `accuracy` misses its gate, or a rounded
    precision's misses `min_cosine`; an unmeasured precision (`accuracy` empty) passes."""
    failures = gate_failures(name, accuracy) if accuracy else []
    if failures and name == "int8":
        raise ValidationError(gate_refusal(name, accuracy, failures))
    if under_cosine_floor(name, accuracy, min_cosine):
        raise ValidationError(f"{name} embeddings reach cosine {accuracy['cosine_min']:.6f} to the fp32 model's "
                              f"on the shipped sentences, under {min_cosine_flag(min_cosine)}")


@dataclass
class Measured:
    """One candidate precision: its agreement with fp32 and its time per call at each timed shape."""

    precision: str
    accuracy: dict
    times_ms: dict[str, float]
    min_cosine: float | None = None  # `--min-cosine`: a floor beside the gate of every rounded precision
    refused: str | None = None  # why it was not built (its accuracy then is the plan's simulation)

    @property
    def failures(self) -> list[str]:
        return [self.refused] if self.refused else accuracy_failures(self.precision, self.accuracy, self.min_cosine)

    @property
    def score_ms(self) -> float:
        """The geometric mean of its times: every timed shape weighs the same, short or long."""
        return math.exp(sum(math.log(ms) for ms in self.times_ms.values()) / len(self.times_ms))


def choose(candidates: list[Measured]) -> tuple[Measured, str]:
    """The fastest candidate that keeps its gate, and why it was chosen (one line). A less accurate
    one (PRECISIONS' order) must be faster by `PRECISION_MARGIN`: a difference within timing noise
    is no reason to round more."""
    passing = sorted((c for c in candidates if not c.failures), key=lambda c: PRECISIONS.index(c.precision))
    chosen = passing[0]
    for candidate in passing[1:]:
        if candidate.score_ms < chosen.score_ms * (1 - PRECISION_MARGIN):
            chosen = candidate
    ratios = {c.precision: c.score_ms / chosen.score_ms for c in passing if c is not chosen}
    rejected = [f"{c.precision} ({'; '.join(c.failures)})" for c in candidates if c.failures]
    reason = f"{chosen.precision}: the fastest that keeps its gate"
    if slower := [f"{name} {ratio:.2f}x" for name, ratio in ratios.items() if ratio >= 1]:
        reason += f"; slower: {', '.join(slower)}"
    if level := [f"{name} {ratio:.2f}x" for name, ratio in ratios.items() if ratio < 1]:
        reason += f"; less accurate and within {PRECISION_MARGIN:.0%} of its time: {', '.join(level)}"
    if rejected:
        reason += f"; failed the gate: {', '.join(rejected)}"
    return chosen, reason
