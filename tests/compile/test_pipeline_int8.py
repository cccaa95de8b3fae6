"""The compile's int8 gate (compile/pipeline.py with --precision int8 and auto): a smoothed artifact keeps
PyTorch's answers, a linear that loses stays out, a plan its library misses is planned again, and a
library under its gate fails the compile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compile import precision
from compile.build import make_target
from compile.int8_plan import kept_precision
from compile.precision import Gate
from loadtest.int8_accuracy import artifact_outputs, cosines
from tests.support.checkpoints import SENSITIVE_LINEAR

pytestmark = pytest.mark.slow  # collected first: see conftest.py

UNSEEN = ["maybe", "A sudden storm forced the sailors back to the harbour before dawn.",
          "Compilers translate source code into machine instructions."]


def _pytorch(checkpoint: Path, sentences: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint), device="cpu").encode(sentences, batch_size=1)


def _artifact(directory: Path, sentences: list[str]) -> np.ndarray:
    return artifact_outputs(directory, sentences)


def test_smoothed_int8_artifact_matches_pytorch(outlier_checkpoint, tmp_path):
    from tests.support.artifacts import compile_artifact

    manifest, _ = compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8",
                                   attention_products="fp32", generic_shapes=["3x20"])
    quantization = manifest.quantization
    assert quantization.linears == 8 and quantization.smoothed == 8 and quantization.smoothing_alpha > 0
    assert quantization.cosine_min > 0.9999 and quantization.worst_sentence is not None
    assert quantization.sensitivity == [] and quantization.kept == []  # measured only to choose a fallback
    assert "SmoothLinears" in manifest.passes.strategies["concat"].pipeline
    assert cosines(_artifact(tmp_path / "out", UNSEEN), _pytorch(outlier_checkpoint, UNSEEN)).min() > 0.9999


@pytest.mark.parametrize("mcpu", [
    pytest.param("x86-64-v3", marks=pytest.mark.requires("avx2"), id="avx2-fp32-fallback"),
    pytest.param(None, marks=pytest.mark.requires("avx512_bf16"), id="this-cpu")])
def test_a_linear_that_loses_stays_out_of_int8(cancelling_checkpoint, tmp_path, mcpu):
    """Under a cosine floor int8 alone cannot keep, the planted linear stays bf16 where the CPU has
    AVX512_BF16, else fp32 (x86-64-v3: AVX2, no bf16), recorded in the manifest; the answers stay
    PyTorch's. Attention's products are asked for (fp32), so that no timing of this tiny model's
    kernel (tens of microseconds, within noise) decides the kept unit's precision. Kept in fp32, the
    library loses what its plan's simulation said it would. This CPU's case requires AVX512_BF16: the
    x86-64-v3 case covers the fp32 fallback."""
    from safetensors.numpy import load_file

    from tests.support.artifacts import compile_artifact

    fallback_precision = kept_precision(make_target("cpu", mcpu=mcpu))  # untimed: attention's products are asked for
    out = tmp_path / "out"
    manifest, _ = compile_artifact(cancelling_checkpoint, out, ["1x5"], precision="int8", min_cosine=0.9999,
                                   attention_products="fp32", generic_shapes=["3x20"],
                                   **({"mcpu": mcpu} if mcpu else {}))
    quantization = manifest.quantization
    assert [(k.unit, k.precision) for k in quantization.kept] == [(SENSITIVE_LINEAR, fallback_precision)]
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
    from compile.workers import Workers

    simulate, submit = Simulation.accuracy, Workers.submit
    built = []

    def a_tenth_of_the_loss(self, alpha, kept):
        accuracy = simulate(self, alpha, kept)
        return {**accuracy, "cosine_min": 1 - (1 - accuracy["cosine_min"]) / 10}

    def counted(workers, name, build):
        parts = Path(name).parts
        built.append("/".join(parts[next(i for i, part in enumerate(parts) if ".staging" in part) + 1:]))
        return submit(workers, name, build)

    monkeypatch.setattr(Simulation, "accuracy", a_tenth_of_the_loss)
    monkeypatch.setattr(Workers, "submit", counted)
    return built


def test_a_plan_its_library_misses_is_admitted_again_before_the_buckets_are_built(cancelling_checkpoint, tmp_path,
                                                                                monkeypatch, caplog):
    """The plan's generic library, built and measured first, misses --min-cosine by ~10x the simulated
    loss: the plan is admitted again with that margin, keeps the planted linear out, and is built again;
    then the bucket is built once, and the checked library ships as the generic one. The artifact keeps the
    floor and records the margin its plan kept."""
    from tests.support.artifacts import compile_artifact

    built = _misplanned(monkeypatch)
    caplog.set_level("INFO", logger="compile.phases.decisions")
    manifest, _ = compile_artifact(cancelling_checkpoint, tmp_path / "out", ["1x5"], precision="int8",
                                   min_cosine=0.9999, mcpu="x86-64-v3", attention_products="fp32",
                                   generic_shapes=["3x20"])
    quantization = manifest.quantization
    assert [kept.unit for kept in quantization.kept] == [SENSITIVE_LINEAR] and quantization.cosine_min >= 0.9999
    assert 5 < quantization.plan_margin < 15  # the library lost ~10x the simulated loss
    assert built == ["int8-plan/plan-0/lib/generic.concat.so", "int8-plan/plan-1/lib/generic.concat.so",
                     "lib/bucket_1x5.concat.so"]  # plan-1's library is the shipped generic one
    assert any("planned again" in record.getMessage() for record in caplog.records)


def test_autos_int8_candidate_is_planned_again_where_its_library_misses(cancelling_checkpoint, tmp_path, monkeypatch):
    """`auto` measures its int8 candidate on the same check: planned again after its first library
    missed the floor, the candidate it measured and timed keeps it. The candidates' timing is injected
    (int8 at half fp32's time), so that which precision ships, and so which tolerance the shipped
    libraries are validated to, does not hang on this machine's speed."""
    from compile.phases import decisions
    from tests.support.artifacts import compile_artifact

    def int8_at_half_the_time(candidates, repeats, **_):
        return {name: 0.5 if name == "int8" else 1.0 for name in candidates}

    built = _misplanned(monkeypatch)
    monkeypatch.setattr(decisions, "budgeted_medians_ms", int8_at_half_the_time)
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
    from compile.errors import ValidationError
    from compile.phases import decisions
    from tests.support.artifacts import compile_artifact

    shipped_gate, plan_for = precision.GATES["int8"], decisions.plan_for

    def plan_under_the_shipped_gate(*args, **kwargs):
        with monkeypatch.context() as planning:
            planning.setitem(precision.GATES, "int8", shipped_gate)
            return plan_for(*args, **kwargs)

    monkeypatch.setattr(decisions, "plan_for", plan_under_the_shipped_gate)
    monkeypatch.setitem(precision.GATES, "int8", Gate(1.01, 1.01, 1.0, 0.0))
    # attention's products asked for (fp32): timing the kernels would not change the miss
    with pytest.raises(ValidationError, match=r"^--precision int8 misses its accuracy gate .*cosine_min [\d.]+ < 1\.01"
                                              r".* \(least on ['\"].+['\"]\); use"):
        compile_artifact(outlier_checkpoint, tmp_path / "out", ["1x5"], precision="int8", attention_products="fp32",
                         generic_shapes=["3x20"])
    assert not (tmp_path / "out").exists()


def test_int8_keeps_its_floor_on_random_token_rows(unseen_checkpoint, tmp_path):
    """Outlier channels that no shipped sentence fires, on every other token: the plan calibrates its
    smoothing and holds its gate on random token rows beside the sentences, so that the artifact keeps
    --min-cosine on such rows too (its libraries ask the same of the random rows the benchmarks send)."""
    from artifact.loader import load_artifact
    from tests.support.artifacts import compile_artifact, least_cosine_to_pytorch

    out = tmp_path / "out"
    manifest, _ = compile_artifact(unseen_checkpoint, out, ["1x5"], precision="int8", min_cosine=0.999,
                                   attention_products="fp32", generic_shapes=["3x20"])
    assert manifest.quantization.linears > 0 and manifest.quantization.cosine_min >= 0.999
    assert least_cosine_to_pytorch(load_artifact(out), unseen_checkpoint, [(4, 32), (2, 64)]) >= 0.999
    assert cosines(_artifact(out, UNSEEN), _pytorch(unseen_checkpoint, UNSEEN)).min() >= 0.999
