"""The per-call benchmark: every candidate is checked against PyTorch eager before it is timed,
and artifact arguments that are not artifacts are refused in one line."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from artifact.cpu_features import host_flags
from artifact.hashing import file_sha256
from loadtest import int8_accuracy, kernel_profile, memory, strategy_table
from loadtest.bench import bert_flops, disagreements, main
from tests.support.artifacts import TINY_LATENCIES, compile_artifact, with_latencies

pytestmark = pytest.mark.slow  # collected first: see conftest.py


def test_bench_reports_every_backend_and_its_agreement(tiny_embed_artifact, tmp_path, capsys):
    out, artifact = tmp_path / "bench", with_latencies(tiny_embed_artifact, tmp_path / "timed", TINY_LATENCIES)
    assert main(["--artifacts", str(artifact), "--shapes", "1x8,2x16", "--generic-shapes", "3x5",
                 "--repeats", "2", "--compare", str(tiny_embed_artifact), "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("| shape | served by |") and re.search(r"\nCPU: .+ \(LLVM mcpu .+\)\n$", markdown)
    assert [r["shape"] for r in report["results"]] == ["1x8", "2x16", "3x5"]
    generic_row = report["results"][-1]
    assert generic_row["kind"] == "generic" and generic_row["served_by"] == "bucket-4x16"
    compared = f"tvm_bucket[{tiny_embed_artifact.name}]"
    assert report["dtype"] == "float32" and report["tolerance"] == 1e-3
    # OpenVINO runs at its default precision: bf16 where the CPU has AVX512_BF16 or AMX, else f32
    flags = host_flags() or set()
    assert report["precisions"]["openvino"] == ("bf16" if {"avx512_bf16", "amx_bf16"} & flags else "fp32")
    assert report["precisions"]["openvino_f32"] == "fp32" and report["precisions"][compared] == "fp32"
    fp32 = [label for label, precision in report["precisions"].items() if precision == "fp32"]
    for row in report["results"]:
        assert set(row["stats"]) == {"tvm_bucket", "tvm_generic", "torch_eager", "torch_sdpa", "onnxruntime",
                                     "onnxruntime_optimized", "openvino", "openvino_f32", compared}
        assert row["peers"]["torch"] in ("torch_eager", "torch_sdpa")  # ratios are taken against the faster
        assert row["peers"]["onnxruntime"] in ("onnxruntime", "onnxruntime_optimized")
        assert row["peers"]["openvino"] == "openvino" and row["peers"]["openvino_f32"] == "openvino_f32"
        assert all(s["runs"] == 2 and s["median_s"] > 0 for s in row["stats"].values())
        # Every candidate but the reference itself was compared with PyTorch eager: the fp32 ones
        # agree within the compile stage's own bound (the tiny model's outputs are of order 1),
        # OpenVINO's default in direction (its least cosine, reported beside its time).
        assert set(row["agreement"]) == set(row["least_cosine"]) == set(row["stats"]) - {"torch_eager"}
        assert all(0 <= row["agreement"][label] <= 1e-4 for label in fp32 if label != "torch_eager"), row
        assert row["least_cosine"]["openvino"] >= 0.99
    assert report["machine"]["peak_gemm_gflops"] > 0
    assert report["onnxruntime_attention_fused"] == {"onnxruntime_optimized": 2}  # ORT at its best: both layers
    assert "| 2x16 (bucket) | bucket-2x16 |" in capsys.readouterr().out


def _with_wrong_weights(artifact, destination):
    """A copy of `artifact` whose transformed weights are scaled by 1.5, manifest sha256 updated:
    it loads and runs, and computes the wrong numbers."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(artifact, destination)
    manifest = json.loads((destination / "manifest.json").read_text())
    for entry in manifest["weights"].values():
        path = destination / entry["file"]
        save_file({name: value * 1.5 if value.dtype.kind == "f" else value
                   for name, value in load_file(str(path)).items()}, str(path))
        entry["sha256"] = file_sha256(path)
    (destination / "manifest.json").write_text(json.dumps(manifest))
    return destination


def test_bench_refuses_a_candidate_that_disagrees_with_pytorch(tiny_embed_artifact, tmp_path, capsys):
    wrong = _with_wrong_weights(tiny_embed_artifact, tmp_path / "wrong-weights")
    out = tmp_path / "bench"
    assert main(["--artifacts", str(tiny_embed_artifact), "--shapes", "1x8", "--generic-shapes", "3x5",
                 "--repeats", "1", "--no-onnx", "--no-openvino", "--compare", str(wrong), "--out", str(out)]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m loadtest.bench: error: at 1x8, tvm_bucket[wrong-weights] (max abs diff ")
    assert "disagree with PyTorch eager beyond 0.001" in error
    assert "tvm_bucket (" not in error and "tvm_generic (" not in error  # the right artifact agrees
    assert not out.exists()  # nothing timed, nothing written


@pytest.mark.parametrize("shape,generic,library", [("1x8", False, "bucket-1x8"), ("1x8", True, "generic"),
                                                    ("5x20", False, "generic")])  # no bucket holds 5x20
def test_kernel_profile_times_the_kernels_of_the_library_that_serves_the_shape(tiny_embed_artifact, shape, generic,
                                                                               library, tmp_path, capsys):
    artifact = with_latencies(tiny_embed_artifact, tmp_path / "tiny-embed", TINY_LATENCIES)
    argv = ["--artifacts", str(artifact), "--shape", shape, "--calls", "2"] + (["--generic"] if generic else [])
    assert kernel_profile.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tiny-embed, {shape} on {library}, ")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    matmuls = [row for row in rows if "matmul" in row[0]]
    assert matmuls and all(int(row[1]) >= 1 and float(row[2]) > 0 for row in matmuls), out
    calls = re.search(r"instrumented, (\d+\.\d+) ms without, of which (-?\d+\.\d{3}) ms outside the library's "
                      r"call", out)
    assert calls and float(calls[2]) < float(calls[1]), out  # the host's part of a plain call, apart


def test_kernel_profile_compares_two_artifacts_kernel_by_kernel(tiny_embed_artifact, tiny_classify_artifact, tmp_path,
                                                                capsys):
    """Each kernel the two share gets both times and their paired ratio; one only the classifier runs
    (its head) gets its time there and a dash for the other."""
    embed, classify = (with_latencies(artifact, tmp_path / artifact.name, TINY_LATENCIES)
                       for artifact in (tiny_embed_artifact, tiny_classify_artifact))
    argv = ["--artifacts", str(embed), "--compare", str(classify), "--shape", "1x8", "--calls", "3"]
    assert kernel_profile.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny-embed against tiny-classify, 1x8 on bucket-1x8 and bucket-1x8, ")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    shared = [row for row in rows if "-" not in row[2:]]
    assert any("matmul" in row[0] for row in shared), out
    assert all(float(row[2]) > 0 and float(row[3]) > 0 and float(row[4].rstrip(" |")) > 0 for row in shared), out
    assert any(row[2] == "-" and float(row[3]) > 0 for row in rows), out
    assert re.search(r"tiny-classify / tiny-embed \d+\.\d{3} \(median of turns\); outside the library's call "
                     r"-?\d+\.\d{3} ms and -?\d+\.\d{3} ms\nCPU: .+ \(LLVM mcpu ", out), out


@pytest.mark.parametrize("precision", ["default", "f32"])
def test_kernel_profile_splits_ours_and_openvinos_time_by_part_of_the_layer(whole_panels_bert_dir, precision,
                                                                           tmp_path, capsys):
    """OpenVINO joins the turns on the checkpoint's ONNX export: its linears are one FullyConnected for
    each of the checkpoint's six a layer (ours four: Q, K and V combined), each one's attention one
    kernel a layer (32-wide heads: ours fused on any CPU), and its counters name the kernels it ran."""
    compile_artifact(whole_panels_bert_dir, tmp_path / "whole-panels", ["1x8"], generic_shapes=["2x5"])
    argv = ["--artifacts", str(tmp_path / "whole-panels"), "--shape", "1x8", "--calls", "2", "--openvino", precision]
    assert kernel_profile.main(argv) == 0
    out = capsys.readouterr().out
    flags = host_flags() or set()
    label = "OpenVINO " + ("bf16" if precision == "default" and {"avx512_bf16", "amx_bf16"} & flags else "fp32")
    table = out[out.index("by part of the layer"):]
    assert f"| part | whole-panels | {label} | {label}'s kernels |" in table, out
    cells = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table.splitlines() if line.startswith("| ")}
    layers = json.loads((whole_panels_bert_dir / "config.json").read_text())["num_hidden_layers"]
    counts = {part: [int(re.search(r"\((\d+)\)$", cell).group(1)) for cell in cells[part][:2]]
              for part in ("linears", "attention", "the rest")}
    assert counts["linears"] == [4 * layers, 6 * layers] and counts["attention"] == [layers, layers], out
    kernels = re.findall(r"(\w+) \d+\.\d{3} \((\d+)\)", cells["linears"][2])
    assert kernels and sum(int(count) for _, count in kernels) == 6 * layers, out
    assert re.search(rf"whole-panels / {label} \d+\.\d{{3}} \(median of turns\)\nCPU: ", out), out


def test_kernel_profile_refuses_a_packed_bound_for_a_shape(tiny_embed_artifact, capsys):
    assert kernel_profile.main(["--artifacts", str(tiny_embed_artifact), "--shape", "packed-8"]) == 2
    assert capsys.readouterr().err == "python -m loadtest.kernel_profile: error: --shape packed-8: expected BATCHxSEQ (e.g. 1x128)\n"


TOOLS = {"bench": main, "strategy_table": strategy_table.main, "kernel_profile": kernel_profile.main,
         "int8_accuracy": int8_accuracy.main, "memory": memory.main}


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("kind", ["missing", "not an artifact"])
def test_a_directory_that_is_not_an_artifact_is_one_line_and_exit_2(tool, kind, tmp_path, capsys):
    """Before any server starts or reference is encoded."""
    directory = tmp_path / "minilm-cpu"
    if kind == "not an artifact":
        directory.mkdir()
        (directory / "notes.txt").write_text("not a manifest")
    run = TOOLS[tool]
    assert run(["--artifacts", str(directory)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"python -m loadtest.{tool}: error: {directory} is not a compiled artifact (no "
                            f"manifest.json); make it with: .venv/bin/bert-compile --config configs/default.yaml "
                            f"--out {directory}\n")


@pytest.mark.parametrize("tool, flag", [("bench", "--repeats"), ("bench", "--threads"), ("kernel_profile", "--calls")])
def test_a_count_of_zero_is_one_line_and_exit_2(tool, flag, tiny_embed_artifact, capsys):
    with pytest.raises(SystemExit) as refused:
        TOOLS[tool](["--artifacts", str(tiny_embed_artifact), flag, "0"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"python -m loadtest.{tool}: error: argument {flag}: "
                                                        "must be at least 1, not 0")


def test_flops_of_minilm_count_real_tokens():
    config = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
    # 6 layers x (linear: 2*1024*(4*384^2 + 2*384*1536) + attention: 4*8*128^2*384) = 22.95 GFLOP
    assert abs(bert_flops(config, [128] * 8) / 1e9 - 22.95) < 0.01
    # a batch of lengths 128 and 32 is the work of its two sequences, not of 2 x 128
    assert bert_flops(config, [128, 32]) == bert_flops(config, [128]) + bert_flops(config, [32])
    assert bert_flops(config, [128, 32]) < bert_flops(config, [128, 128])


def test_flops_of_modernbert_count_geglu_and_windows():
    """ModernBERT: three projections of the feed-forward width (GeGLU), and on its sliding-window layers each
    query's window of keys (local_attention + 1 of them), not the whole sequence."""
    config = {"model_type": "modernbert", "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 3,
              "layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "local_attention": 128}
    linear = 2 * 8192 * (4 * 768 ** 2 + 3 * 768 * 1152)
    assert bert_flops(config, [8192]) == 3 * linear + 4 * 8192 * 768 * (8192 + 2 * 129)
    assert bert_flops(config, [100]) == 3 * (2 * 100 * (4 * 768 ** 2 + 3 * 768 * 1152)) + 3 * 4 * 100 * 100 * 768


def test_fp32_candidates_are_held_to_the_tolerance_and_reduced_precisions_to_their_least_cosine():
    precisions = {"tvm_bucket": "fp32", "tvm_bucket[bf16]": "bf16", "openvino_int8": "int8"}
    # a bf16 or int8 candidate may differ by far more than fp32's 1e-3, as long as it points the same way
    diffs = {"tvm_bucket": 2e-4, "tvm_bucket[bf16]": 0.02, "openvino_int8": 0.1}
    assert disagreements(precisions, diffs, {"tvm_bucket": 1.0, "tvm_bucket[bf16]": 0.9995,
                                             "openvino_int8": 0.97}, 1e-3) == []
    wrong = disagreements(precisions, {**diffs, "tvm_bucket": 2e-3},
                          {"tvm_bucket": 1.0, "tvm_bucket[bf16]": 0.98, "openvino_int8": 0.85}, 1e-3)
    assert wrong == ["tvm_bucket (max abs diff 0.002)", "tvm_bucket[bf16] (bf16 cosine 0.9800 < 0.99)",
                     "openvino_int8 (int8 cosine 0.8500 < 0.9)"]


def test_openvino_held_to_avx2_by_onednn_runs_at_f32(tiny_embed_artifact, tmp_path):
    """Peers of an AVX2 build where `cpuid` cannot be held: with `ONEDNN_MAX_CPU_ISA=AVX2` (read once per
    process, hence a child process) OpenVINO's default and NNCF int8 compile and run at f32, as on an
    AVX2 CPU, where its bf16 default would not compile on a CPU that has bf16."""
    out, artifact = tmp_path / "bench", with_latencies(tiny_embed_artifact, tmp_path / "timed", TINY_LATENCIES)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-m", "loadtest.bench", "--artifacts", str(artifact), "--shapes", "1x8",
                           "--generic-shapes", "3x5", "--repeats", "1", "--no-onnx", "--int8", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["precisions"]["openvino"] == report["precisions"]["openvino_f32"] == "fp32"
    assert report["precisions"]["openvino_int8"] == "int8"
    assert report["results"][0]["least_cosine"]["openvino"] >= 0.9999


def test_openvinos_default_at_f32_is_timed_once_under_both_names(tiny_embed_artifact, tmp_path, monkeypatch):
    """Where OpenVINO's default precision is f32 (CPUs without AVX512_BF16 or AMX; injected here),
    `openvino` and `openvino_f32` are one compiled model, timed once: the two share every statistic."""
    from loadtest import openvino_peer

    monkeypatch.setattr(openvino_peer.OpenVinoModel, "precision", lambda self: "fp32")
    out, artifact = tmp_path / "bench", with_latencies(tiny_embed_artifact, tmp_path / "timed", TINY_LATENCIES)
    assert main(["--artifacts", str(artifact), "--shapes", "1x8", "--generic-shapes", "3x5", "--repeats", "3",
                 "--no-onnx", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["precisions"]["openvino"] == report["precisions"]["openvino_f32"] == "fp32"
    for row in report["results"]:
        assert row["stats"]["openvino"] == row["stats"]["openvino_f32"]
        assert row["stats"]["openvino"]["runs"] == 3
        assert row["least_cosine"]["openvino"] == row["least_cosine"]["openvino_f32"]


def test_time_names_the_candidates_timed_and_every_one_is_still_checked(tiny_embed_artifact, tmp_path, capsys):
    """`--time tvm_bucket,openvino` (a shape where PyTorch takes minutes): only those two are timed, and
    every other candidate still ran once against PyTorch eager; ratios to what was not timed are n/a."""
    out, artifact = tmp_path / "bench", with_latencies(tiny_embed_artifact, tmp_path / "timed", TINY_LATENCIES)
    assert main(["--artifacts", str(artifact), "--shapes", "1x8", "--generic-shapes", "", "--repeats", "2",
                 "--no-onnx", "--time", "tvm_bucket,openvino", "--out", str(out)]) == 0
    (row,) = json.loads((out / "bench.json").read_text())["results"]
    assert set(row["stats"]) == {"tvm_bucket", "openvino"}
    assert set(row["least_cosine"]) == {"tvm_bucket", "tvm_generic", "torch_sdpa", "openvino", "openvino_f32"}
    assert row["agreement"]["tvm_generic"] <= 1e-4 and "ratio_vs_torch" not in row
    markdown = (out / "bench.md").read_text()
    assert "| 1x8 (bucket) | bucket-1x8 |" in markdown and "torch_sdpa (fp32) 1.00000" in markdown  # untimed, checked
    assert "| n/a | n/a | n/a |" in capsys.readouterr().out
    assert main(["--artifacts", str(artifact), "--shapes", "1x8", "--generic-shapes", "", "--no-onnx",
                 "--time", "tvm_bucket,openvno", "--out", str(out)]) == 1
    assert "--time names openvno, which this run has not (it has tvm_bucket" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--artifacts", str(artifact), "--time", "openvino"])
    assert "must include tvm_bucket" in capsys.readouterr().err


def test_weight_pages_times_the_loaded_weights_against_a_copy_on_ordinary_pages(tiny_embed_artifact, capsys):
    from loadtest import weight_pages

    assert weight_pages.main(["--artifacts", str(tiny_embed_artifact), "--shapes", "1x8,5x20", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert re.match(r"tiny-embed: \d+ MB of this process on huge pages\n", out), out
    rows = re.findall(r"^\| (\d+x\d+) \| (\d+\.\d{3}) \| (\d+\.\d{3}) \| (\d+\.\d{3}) \|$", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["1x8", "5x20"] and all(float(row[1]) > 0 for row in rows), out
    assert weight_pages.main(["--artifacts", str(tiny_embed_artifact), "--shapes", "packed-16"]) == 2
    assert "expected BATCHxSEQ" in capsys.readouterr().err


def test_plan_fidelity_refuses_an_artifact_without_an_int8_plan(tiny_embed_artifact, capsys):
    from loadtest import plan_fidelity

    assert plan_fidelity.main(["--artifacts", str(tiny_embed_artifact)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m loadtest.plan_fidelity: error: ") and "no int8 plan" in error
    assert len(error.strip().splitlines()) == 1
