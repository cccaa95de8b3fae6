"""The serving benchmark and the soak run end to end on the tiny artifact against real servers on
127.0.0.1 (what they report, not how fast: speed is for the recorded runs in docs/)."""

from __future__ import annotations

import json

from loadtest import serving_bench, soak


def test_serving_bench_compares_topologies_and_backends(tiny_embed_artifact, tmp_path, capsys):
    out = tmp_path / "serving"
    only = "tvm default (narrow x1 thread + wide),torch default (1 worker x all cores)"
    assert serving_bench.main(["--artifacts", str(tiny_embed_artifact), "--only", only, "--short-requests", "5",
                               "--long-requests", "2", "--mixed-requests", "20", "--rounds", "1", "--gap-ms", "1",
                               "--concurrency", "4", "--out", str(out)]) == 0
    report = json.loads((out / "serving_bench.json").read_text())
    names = only.split(",")
    assert list(report["mixed"]) == names
    assert report["topology"][names[0]]["wide"] is True and report["topology"][names[1]]["workers"] == 1
    assert len(report["short"][names[0]]["paths"]) == 1 and report["short"][names[0]]["paths"][0].startswith("bucket-")
    assert report["short"][names[1]]["paths"] == ["torch"]
    assert report["library"]["served_by"].startswith("bucket-") and report["library"]["median_ms"] > 0
    assert all(run["throughput_rps"] > 0 and run["errors"] == [{}] for run in report["mixed"].values())
    assert report["machine"]["llvm_mcpu"] and report["machine"]["cores"] >= 1
    assert set(report["short_after_pause"]) == set(report["short"]) == set(names)  # both regimes, every server
    assert all(r["server_cpu_ms"] > 0 for r in report["short_after_pause"].values())
    breakdown = report["short"][names[0]]["server_p50_ms"]
    assert 0 < breakdown["inference"] <= breakdown["total"] <= report["short"][names[0]]["p50_ms"]
    assert all(0 <= run["padding_share"] < 1 for run in report["mixed"].values())
    for name, run in report["mixed"].items():  # batches run on the workers: never more at once than there are
        topology = report["topology"][name]
        assert run["server_cores"] > 0 and 0 < run["batch_cores"] <= topology["workers"] + topology["wide"]
    assert all(p["ready_s"] > 0 and p["rss_mb"] > p["weights_mb"] > 0 for p in report["process"].values())
    assert "| tvm default (narrow x1 thread + wide) |" in capsys.readouterr().out


def test_soak_answers_every_request_with_failures_injected(tiny_embed_artifact, tmp_path, capsys):
    out = tmp_path / "soak"
    assert soak.main(["--artifacts", str(tiny_embed_artifact), "--duration", "4", "--concurrency", "4",
                      "--fail-rate", "0.2", "--sample-every", "0.5", "--max-growth", "0.5", "--out", str(out)]) == 0
    report = json.loads((out / "soak.json").read_text())
    assert all(report["checks"].values()) and report["admitted_after"] == 0
    assert set(report["statuses"]) == {"200", "500"}  # 20% of the batches raised, every request was answered
    assert 0 < report["failed_batches"] < report["batches"]
    assert "PASS every request answered" in capsys.readouterr().out


def test_benchmarks_refuse_a_missing_artifact_with_one_line(tmp_path, capsys):
    for module in (serving_bench, soak):
        assert module.main(["--artifacts", str(tmp_path / "missing")]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_benchmark_stopped_by_sigterm_stops_its_servers(tiny_embed_artifact, tmp_path):
    """SIGTERM to a process inside `running_server` ends it through `finally`: no server is left."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys, time\nfrom pathlib import Path\nfrom loadtest.servers import running_server\n"
              f"with running_server([Path({str(tiny_embed_artifact)!r})], '--workers', '1', "
              f"log_path=Path({str(tmp_path / 'server.log')!r})) as server:\n"
              "    print(server.process.pid, flush=True)\n    time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    server_pid = int(bench.stdout.readline())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    assert not Path(f"/proc/{server_pid}").exists(), "the server outlived the benchmark"  # reaped in `finally`
