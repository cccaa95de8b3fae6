"""The benchmark runs end to end and reports every backend per shape (structure, not speed)."""

import json

from loadtest.bench import bert_flops, main


def test_bench_reports_every_backend(tiny_embed_artifact, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["--artifacts", str(tiny_embed_artifact), "--shapes", "1x8,2x16", "--generic-shapes", "3x5",
                 "--repeats", "2", "--compare", str(tiny_embed_artifact), "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    assert (out / "bench.md").read_text().startswith("| shape | served by |")
    assert [r["shape"] for r in report["results"]] == ["1x8", "2x16", "3x5"]
    generic_row = report["results"][-1]
    assert generic_row["kind"] == "generic" and generic_row["served_by"] == "bucket-4x16"
    for row in report["results"]:
        assert set(row["stats"]) == {"tvm_bucket", "tvm_generic", "torch_eager", "onnxruntime",
                                     f"tvm_bucket[{tiny_embed_artifact.name}]"}
        assert all(s["runs"] == 2 and s["median_s"] > 0 for s in row["stats"].values())
        assert row["ratio_vs_torch"]["torch_eager"] == 1.0
    assert report["machine"]["peak_gemm_gflops"] > 0
    assert "| 2x16 (bucket) | bucket-2x16 |" in capsys.readouterr().out


def test_flops_of_minilm_at_8x128():
    config = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
    # 6 layers x (linear: 2*1024*(4*384^2 + 2*384*1536) + attention: 4*8*128^2*384) = 22.95 GFLOP
    assert abs(bert_flops(config, 8, 128) / 1e9 - 22.95) < 0.01
