"""End-to-end compiles of tiny random-weight BERTs: manifest, numerics, loader, atomicity."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from artifact.bucketing import Bucket
from artifact.costs import CALL_TOKENS, measured_costs
from artifact.cpu_features import target_features
from artifact.errors import ArtifactError
from artifact.loader import load_artifact
from artifact.manifest import CostModel, Manifest
from compile.phases import libraries
from compile.build import make_target
from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper
from compile.errors import ValidationError
from compile.timing import OtherLoad, fit_cost_model
from service.backends import TvmBackend
from service.planning import BatchLimits, plan_batches
from tests.support.artifacts import TINY_LATENCIES, compile_artifact, with_latencies
from tests.support.checkpoints import TINY_LABELS


def test_manifest_describes_every_library(tiny_embed_artifact, tiny_bert_dir):
    manifest = json.loads((tiny_embed_artifact / "manifest.json").read_text())
    for key in ("schema_version", "task", "target", "model", "pooling", "labels", "tvm_version",
                "buckets", "generic", "passes"):
        assert key in manifest
    assert manifest["task"] == "embed" and manifest["pooling"] == "mean"
    assert manifest["model"]["path"] == str(tiny_bert_dir.resolve())
    assert [(b["batch"], b["seq"]) for b in manifest["buckets"]] == [(1, 8), (2, 16), (4, 16)]
    for entry in [*manifest["buckets"], manifest["generic"]]:
        assert (tiny_embed_artifact / entry["library"]).is_file()
        assert len(entry["sha256"]) == 64
    assert all(b["max_abs_diff"] <= 1e-4 for b in manifest["buckets"])
    assert len(manifest["generic"]["max_abs_diff"]) == 3
    assert all(d <= 1e-4 for d in manifest["generic"]["max_abs_diff"].values())
    assert manifest["passes"]["before"]["matmul"] == 2 * 8
    assert manifest["passes"]["strategies"]["concat"]["after"]["matmul"] == 2 * 6
    assert all(b["strategy"] == "concat" and b["strategy_ms"] is None for b in manifest["buckets"])
    assert (tiny_embed_artifact / "tokenizer" / "tokenizer.json").is_file()
    assert (tiny_embed_artifact / manifest["weights"]["concat"]["file"]).is_file()
    assert manifest["target"]["cpu_features"] == target_features(make_target("cpu"))


def test_manifest_has_measured_latencies(tiny_embed_artifact):
    manifest = Manifest.read(tiny_embed_artifact)
    assert all(b.latency_ms is not None and b.latency_ms > 0 for b in manifest.buckets)
    cost = manifest.generic.cost_model
    assert cost is not None
    grid = [[cost.predicted_ms(batch, seq) for seq in (1, 8, 16, 32, 64)] for batch in (1, 2, 4, 8, 16)]
    assert min(map(min, grid)) > 0
    assert all(row == sorted(row) for row in grid)  # grows with seq
    assert all(list(column) == sorted(column) for column in zip(*grid))  # grows with batch
    assert cost.predicted_ms(16, 64) > cost.predicted_ms(1, 1)
    # what the batch planner reads: the cheapest fitting bucket's latency, else the generic prediction
    costs = measured_costs(manifest, [entry.bucket for entry in manifest.buckets])
    assert costs.measured
    for size, seq in [(1, 5), (2, 12), (3, 12)]:
        fitting = [entry.latency_ms for entry in manifest.buckets if entry.bucket.fits(size, seq)]
        assert costs.choose(size, seq).cost == min(fitting)
    assert costs.choose(3, 30) is None and costs.generic(3, 30).cost == cost.predicted_ms(3, 30)
    assert measured_costs(manifest, []).generic(3, 12).cost == cost.predicted_ms(3, 12)  # every bucket refused


def test_the_loader_runs_a_batch_on_the_library_the_planner_chooses(tiny_embed_artifact, tmp_path):
    """Benchmarks call `run` without a bucket, so it must time the library the server runs: under
    latencies where the 4x16 bucket beats 2x16 (the smallest that holds two short inputs) and two
    1x8 calls, the planner and the loader both take 4x16."""
    model = load_artifact(with_latencies(tiny_embed_artifact, tmp_path / "copy", {(1, 8): 3.0, (2, 16): 9.0,
                                                                                  (4, 16): 4.0}))
    planned = plan_batches([5, 5], TvmBackend(model).costs(), BatchLimits(16384, None, 16))
    assert [(batch.indices, batch.bucket) for batch in planned] == [([0, 1], Bucket.of(4, 16))]
    ids = np.ones((2, 5), dtype=np.int64)
    assert model.run(ids, np.ones_like(ids)).bucket == Bucket.of(4, 16)
    assert model.run(ids[:1], np.ones_like(ids[:1])).bucket == Bucket.of(1, 8)  # 3 ms beats 4


def test_cost_model_fit_recovers_known_coefficients():
    shapes = [(1, 16), (1, 64), (1, 128), (4, 64), (8, 16), (8, 128)]
    truth = (1.5, 0.02, 3e-4)
    samples = {(b, s): truth[0] + truth[1] * b * s + truth[2] * b * s * s for b, s in shapes}
    np.testing.assert_allclose(fit_cost_model(samples), truth, rtol=1e-9)
    model = CostModel(fixed_ms=truth[0], per_token_ms=truth[1], per_attention_ms=truth[2])
    assert all(model.predicted_ms(b, s) == pytest.approx(ms) for (b, s), ms in samples.items())
    # a zero term is recovered as zero, not as a small negative number
    no_attention = {(b, s): 2.0 + 0.01 * b * s for b, s in shapes}
    np.testing.assert_allclose(fit_cost_model(no_attention), (2.0, 0.01, 0.0), atol=1e-12)


def test_a_long_context_generic_library_is_timed_on_long_sequences():
    """A model of 8,192 positions has its generic library timed on one sequence of 1,024 and of 4,096 tokens
    (the quadratic term measured, not extrapolated from 128 tokens); a 512-position one as before."""
    from compile.phases.libraries import cost_model_workloads

    def shapes(max_seq):
        return {(workload.batch, workload.seq) for workload in cost_model_workloads(64, max_seq)}

    assert max(seq for _, seq in shapes(512)) == 128
    assert shapes(8192) == shapes(512) | {(1, 1024), (1, 4096)}
    assert shapes(2048) == shapes(512) | {(1, 1024)}


def test_cost_model_fit_never_goes_negative():
    """Timings that fall with size (noise) fit non-negative terms, not a negative slope."""
    samples = {(1, 16): 5.0, (1, 64): 4.0, (4, 64): 3.0, (8, 128): 2.5}
    fixed, per_token, per_attention = fit_cost_model(samples)
    assert per_token == per_attention == 0.0  # no negative slope: the best fit is a constant,
    inverse = np.array([1 / ms for ms in samples.values()])
    assert fixed == pytest.approx(inverse.sum() / (inverse**2).sum())  # the one of least relative error
    with pytest.raises(ValueError):
        fit_cost_model({})


def test_interleaved_rounds_run_every_candidate_once_after_varying_others():
    """A runtime whose workers still spin after its call slows whichever candidate runs next: in a
    rotating order that is always the same one. Shuffled rounds give each several predecessors."""
    from compile.timing import interleaved_medians

    calls = []
    names = ["ours", "generic", "torch", "openvino"]
    stats = interleaved_medians({name: (lambda name=name: calls.append(name)) for name in names}, repeats=12,
                                warmup=0)
    assert all(stats[name]["runs"] == 12 for name in names)
    rounds = [calls[i:i + 4] for i in range(0, len(calls), 4)]
    assert all(sorted(order) == sorted(names) for order in rounds)  # each once per round
    before = {name: {order[order.index(name) - 1] for order in rounds if order.index(name) > 0} for name in names}
    assert all(len(others) >= 2 for others in before.values()), before


def test_other_load_counts_other_processes_and_not_this_one(monkeypatch):
    """What the compile stage's busy-machine warning measures: the machine's busy seconds less this
    process's own (its threads and waited-for children), per second of the block. The readings
    are injected, so the outcome does not depend on what else this machine runs."""
    from types import SimpleNamespace

    from compile import timing

    readings = {"machine": [100.0, 103.5], "own": [10.0, 11.5], "clock": [50.0, 52.0]}
    take = lambda name: lambda: readings[name].pop(0)  # noqa: E731
    monkeypatch.setattr(timing, "_machine_busy_s", take("machine"))
    monkeypatch.setattr(timing, "_own_busy_s", take("own"))
    monkeypatch.setattr(timing, "time", SimpleNamespace(monotonic=take("clock")))
    with OtherLoad() as load:
        pass
    assert load.cores == (3.5 - 1.5) / 2.0  # 2 s of others' work in 2 s: one core
    readings.update(machine=[100.0, 101.0], own=[10.0, 11.5], clock=[50.0, 52.0])
    with OtherLoad() as alone:
        pass
    assert alone.cores == 0.0  # this process's own threads and children are not "others"
    readings.update(machine=[None, None], own=[10.0, 11.0], clock=[50.0, 52.0])
    with OtherLoad() as unreadable:
        pass
    assert unreadable.cores == 0.0  # no /proc/stat: no warning either


def test_compiling_beside_a_busy_process_warns_that_the_latencies_are_off(tiny_bert_dir, tmp_path, caplog):
    """A process spinning while the libraries are timed: the manifest's latencies (what the server's
    planner costs batches with) are inflated, and the compile says so."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with caplog.at_level(logging.WARNING, logger="compile.phases.libraries"):
            compile_artifact(tiny_bert_dir, tmp_path / "out", ["1x8"])
    finally:
        spinner.kill()
        spinner.wait()
    assert any("cores busy while the libraries were timed" in record.message for record in caplog.records)


def test_manifest_without_latencies_still_reads(tiny_embed_artifact, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, copy)
    data = json.loads((copy / "manifest.json").read_text())
    del data["generic"]["cost_model"]
    for bucket in data["buckets"]:
        del bucket["latency_ms"]
    (copy / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.read(copy)
    assert manifest.generic.cost_model is None and all(b.latency_ms is None for b in manifest.buckets)
    costs = measured_costs(manifest, [entry.bucket for entry in manifest.buckets])
    assert not costs.measured  # the planner falls back to padded tokens
    assert costs.choose(1, 5).cost == CALL_TOKENS + 8 and costs.generic(6, 30).cost == CALL_TOKENS + 6 * 30


def _torch_reference(model_dir, task, input_ids, attention_mask):
    info = inspect_checkpoint(model_dir, task)
    wrapper = load_wrapper(info, task)
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).expand(batch, seq)
    with torch.no_grad():
        return wrapper(torch.from_numpy(input_ids), torch.from_numpy(attention_mask),
                       torch.zeros_like(torch.from_numpy(input_ids)), position_ids).numpy()


@pytest.mark.parametrize("shape,path", [((1, 5), "bucket-1x8"), ((3, 12), "bucket-4x16"),
                                        ((2, 16), "bucket-2x16"), ((6, 30), "generic"), ((1, 17), "generic")])
def test_loader_routes_and_matches_pytorch(tiny_embed_artifact, tiny_bert_dir, shape, path, tmp_path):
    model = load_artifact(with_latencies(tiny_embed_artifact, tmp_path / "timed", TINY_LATENCIES))
    input_ids, attention_mask, _, _ = (x.numpy() for x in example_inputs(*shape, 30522, seed=7))
    result = model.run(input_ids, attention_mask)
    assert result.path == path
    assert result.output.shape == (shape[0], 32)
    assert result.real_tokens == attention_mask.sum()
    expected = _torch_reference(tiny_bert_dir, "embed", input_ids, attention_mask)
    np.testing.assert_allclose(result.output, expected, atol=1e-4, rtol=0)


def test_loader_refuses_out_of_bounds_batch(tiny_embed_artifact):
    model = load_artifact(tiny_embed_artifact)
    ones = np.ones((17, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="exceeds"):
        model.run(ones, ones)


def test_classify_artifact_keeps_labels_and_matches_pytorch(tiny_classify_artifact, tiny_classifier_dir):
    model = load_artifact(tiny_classify_artifact)
    assert model.manifest.labels == [TINY_LABELS[i] for i in range(3)]
    assert model.manifest.passes.before.matmul == 2 * 8 + 2  # + pooler and classifier
    input_ids, attention_mask, _, _ = (x.numpy() for x in example_inputs(3, 10, 30522, seed=3))
    result = model.run(input_ids, attention_mask)
    assert result.output.shape == (3, 3)
    expected = _torch_reference(tiny_classifier_dir, "classify", input_ids, attention_mask)
    np.testing.assert_allclose(result.output, expected, atol=1e-4, rtol=0)


def test_tampered_library_refuses_only_that_bucket(tiny_embed_artifact, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, copy)
    with open(copy / "lib" / "bucket_2x16.so", "ab") as handle:
        handle.write(b"tampered")
    model = load_artifact(copy)
    assert [b.name for b in model.buckets] == ["1x8", "4x16"]
    assert "sha256" in model.refused["2x16"]
    ids = np.ones((2, 16), dtype=np.int64)
    assert model.run(ids, ids).path == "bucket-4x16"


def test_tampered_generic_library_refuses_the_artifact(tiny_embed_artifact, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, copy)
    (copy / "lib" / "generic.so").write_bytes(b"not a library")
    with pytest.raises(ArtifactError, match="generic.so"):
        load_artifact(copy)


def test_manifest_round_trips(tiny_embed_artifact):
    manifest = Manifest.read(tiny_embed_artifact)
    assert Manifest.model_validate_json(manifest.model_dump_json()) == manifest


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_failed_validation_leaves_nothing_behind(tiny_bert_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValidationError, match=r"exceeds tolerance 1e-12 \(the compile config's `tolerance`\)$"):
        compile_artifact(tiny_bert_dir, out, ["1x8"], tolerance=1e-12)
    assert _leftovers(tmp_path) == []


def test_interrupted_compile_keeps_previous_artifact(tiny_bert_dir, tiny_embed_artifact, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(tiny_embed_artifact, out)
    before = (out / "manifest.json").read_text()
    calls = []

    def interrupted_build(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_build(*args, **kwargs)

    real_build = libraries.build_library
    monkeypatch.setattr(libraries, "build_library", interrupted_build)
    with pytest.raises(KeyboardInterrupt):
        compile_artifact(tiny_bert_dir, out, ["1x8", "2x16"])
    assert _leftovers(tmp_path) == ["out"]
    assert (out / "manifest.json").read_text() == before


def test_loader_refuses_out_of_vocabulary_ids(tiny_embed_artifact):
    model = load_artifact(tiny_embed_artifact)
    ids = np.full((1, 4), 30522, dtype=np.int64)
    with pytest.raises(ValueError, match="token ids"):
        model.run(ids, np.ones_like(ids))


def test_compiled_library_survives_out_of_vocabulary_ids(tiny_embed_artifact):
    """Behind the loader's check, the gathers clip: a bad id cannot read out of bounds."""
    model = load_artifact(tiny_embed_artifact)
    ids = np.array([[0, 30521, 30522, 10**9]], dtype=np.int64)
    ones = np.ones_like(ids)
    output = model.generic(ids, ones, np.zeros_like(ids), np.arange(4)[None, :])
    assert np.isfinite(output).all()


def test_an_export_is_reused_only_for_the_same_weights_and_bounds(tiny_bert_dir):
    """A second export of the same wrapper and bounds is the first one's module; new weights (a
    pruned layer), other bounds or another layout export anew, and the graph's weights follow."""
    from compile.importer import export_and_import

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    wrapper = load_wrapper(info, "embed")
    first = export_and_import(wrapper, 4, info.max_seq, 30522)
    again = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, 30522)
    assert again.mod.same_as(first.mod) and again.params is not first.params
    assert not export_and_import(wrapper, 5, info.max_seq, 30522).mod.same_as(first.mod)
    assert not export_and_import(wrapper, 4, info.max_seq, 30522, "packed").mod.same_as(first.mod)
    with torch.no_grad():
        wrapper.bert.encoder.layer[0].output.dense.weight.zero_()
    changed = export_and_import(wrapper, 4, info.max_seq, 30522)
    assert not changed.mod.same_as(first.mod)
    assert sum(not np.array_equal(a.numpy(), b.numpy()) for a, b in zip(changed.params, first.params)) == 1


def test_progress_counts_the_phases_a_compile_runs(tiny_bert_dir, tmp_path):
    """The total the progress lines count to is the declared phases' steps, and the compile reports each."""
    import io

    from compile.config import CompileConfig
    from compile.pipeline import compile_model, progress_steps
    from compile.plan import plan_compile
    from compile.progress import Progress

    config = CompileConfig(model=tiny_bert_dir, out=tmp_path / "out", buckets=["1x8", "2x16"], max_batch=16,
                           generic_shapes=["3x5"])
    stream = io.StringIO()
    compile_model(config, Progress(0, stream=stream))
    steps = progress_steps(plan_compile(config))
    assert steps == 2 + 1 + 1 + 2 * 3 + 1  # load + import, passes, tokenizer, 3 libraries built and checked, accuracy
    finished = [line for line in stream.getvalue().splitlines() if line.startswith("[compile") and " done in " in line]
    assert [line.split("]")[0] for line in finished] == [f"[compile {i}/{steps}" for i in range(1, steps + 1)]


def test_the_phases_and_each_strategys_passes_are_listed_from_the_pipeline(capsys):
    from compile.pipeline import PHASES, main
    from compile.plan import Arithmetic
    from compile.phases.transform import compile_sequence

    main(["--list"])
    listed = capsys.readouterr().out
    assert all(f"  {phase.name} " in listed for phase in PHASES)
    passes, _ = compile_sequence("batched", make_target("cpu"), "float32", Arithmetic("bf16"))
    assert " -> ".join(p.info.name for p in passes) in listed
    assert "CanonicalizeForCombine -> BatchParallelLinears -> ReorderPermuteDimsAfterConcat -> LinearsToBF16" in listed
