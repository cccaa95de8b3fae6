"""The load test runs end to end in --quick mode against real servers on 127.0.0.1."""

import json
import subprocess
import sys

from loadtest.__main__ import main


def test_quick_loadtest_accounts_for_every_request(tiny_embed_artifact, tmp_path, capsys):
    out = tmp_path / "loadtest"
    assert main(["--artifacts", str(tiny_embed_artifact), "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    for name in ("results.csv", "latency_vs_throughput.png", "compute_path_mix.png", "report.md"):
        assert (out / name).stat().st_size > 0
    rows = report["rows"]
    assert {(r["backend"], r["endpoint"], r["mode"]) for r in rows} == {
        (b, e, m) for b in ("tvm", "torch") for e in ("/embed", "/classify") for m in ("closed", "open")}
    for row in rows:
        assert row["sent"] > 0
        assert row["sent"] == row["answered"] + sum(row["errors"].values())  # nothing silently lost
        assert row["answered"] > 0 and row["latency_ms"]["p50"] > 0 and row["peak_rss_mb"] > 0
    compiled = [r for r in rows if r["backend"] == "tvm"]
    assert all(sum(r["batches_by_path"].values()) > 0 for r in compiled)
    assert all(0.0 <= r["bucket_share"] <= 1.0 for r in compiled)
    assert all(0.0 < r["padding_share"] < 1.0 for r in compiled)  # buckets pad; read from /metrics
    assert all(set(r["batches_by_path"]) == {"torch"} for r in rows if r["backend"] == "torch")
    assert [v["endpoint"] for v in report["verdicts"]] == ["/embed", "/classify"]
    assert "| tvm | /embed | closed | 8 |" in capsys.readouterr().out


def test_quick_loadtest_without_an_artifact_says_how_to_make_one(tmp_path):
    """`python -m loadtest --quick` where artifacts/minilm-cpu (the default) was never compiled:
    one line naming the compile command, exit 2, and no server started."""
    result = subprocess.run([sys.executable, "-m", "loadtest", "--quick"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr == ("python -m loadtest: error: artifacts/minilm-cpu is not a compiled artifact (no "
                             "manifest.json); make it with: .venv/bin/bert-compile --config configs/default.yaml "
                             "--out artifacts/minilm-cpu\n")
    assert not (tmp_path / "docs").exists()  # no server log, no report


def test_client_resends_on_a_kept_alive_connection_the_server_closed_while_idle():
    """uvicorn closes a kept-alive connection idle past its keep-alive timeout; the load generator's
    next request on it must be answered, not counted as lost (an open loop's idle connections)."""
    import asyncio

    import psutil
    from fastapi import FastAPI

    from loadtest.http_client import Connection
    from loadtest.servers import running_app, wait_until

    app = FastAPI()
    opened = []

    @app.post("/echo")
    async def echo(body: dict):
        return body

    @app.middleware("http")
    async def count_connections(request, call_next):
        opened.append(request.scope["client"])
        return await call_next(request)

    async def two_requests_apart(url: str):
        connection = Connection(url)
        try:
            first = await connection.post("/echo", {"n": 1}, timeout=10)
            # Block this event loop until the server has closed the idle connection (its FIN leaves
            # our end in CLOSE_WAIT): the close is still unread when the next request goes out.
            port = opened[0][1]
            wait_until(lambda: any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_CLOSE_WAIT
                                   for c in psutil.Process().net_connections("tcp")),
                       what="the server closing the idle connection")
            second = await connection.post("/echo", {"n": 2}, timeout=10)
        finally:
            await connection.close()
        return first, second

    with running_app(app, timeout_keep_alive=0.1) as url:
        first, second = asyncio.run(two_requests_apart(url))
    assert (first.status, first.json(), second.status, second.json()) == (200, {"n": 1}, 200, {"n": 2})
    assert len({client[1] for client in opened}) == 2  # the second went out on a new connection


def test_peak_memory_is_the_high_water_mark_not_the_current_size():
    """A child that touched 200 MB and gave it back: its peak stays, though its RSS fell, and no
    thread had to be sampling at the right moment."""
    import psutil

    from loadtest.servers import PeakMemory

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nx = b'x' * (200 * 2**20)\ndel x\n"
                              "print('freed', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "freed"
        assert PeakMemory(child.pid).peak_bytes >= 200 * 2**20
        assert psutil.Process(child.pid).memory_info().rss < 100 * 2**20
    finally:
        child.kill()
        child.wait()


def test_free_port_never_hands_out_a_port_twice_nor_a_busy_one(monkeypatch):
    """The probe is closed before the server binds: two probes in a row must not give a server's HTTP
    and gRPC ports the same port, and a port some process holds is skipped."""
    from loadtest import servers

    candidates = iter([20001, 20001, 20002, 20003])  # the same port twice, a busy one, another
    monkeypatch.setattr(servers._PORTS, "randrange", lambda *_args: next(candidates))

    class Probe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            if address[1] == 20002:
                raise OSError(98, "Address already in use")

    monkeypatch.setattr(servers.socket, "socket", Probe)
    assert [servers.free_port(), servers.free_port()] == [20001, 20003]


def test_free_ports_lie_below_the_kernels_ephemeral_range():
    """No port-0 bind or outgoing connection of another process (Ray starts many) can take the port
    between the probe and the server's bind; and it is free: this test binds it."""
    import socket

    from loadtest import servers

    for _ in range(20):
        port = servers.free_port()
        assert port < servers.ephemeral_floor()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_cold_start_reads_the_compiles_time_per_phase_from_the_servers_log(tmp_path):
    """The benchmark's breakdown is the compile's own `[compile time]` line, as the server logs it."""
    import io

    from compile.progress import Progress
    from loadtest.cold_start import compile_phases

    stream = io.StringIO()
    progress = Progress(2, stream=stream)
    for description, phase in (("load acme/minilm", "load"), ("int8 plan", "int8-plan"), ("more load", "load")):
        with progress.step(description, phase):
            pass
    progress.summary()
    line = stream.getvalue().splitlines()[-1]
    log = tmp_path / "server.log"
    log.write_text(f"ts=0 level=INFO logger=service.compile msg={line}\nts=1 level=INFO logger=service msg=ready\n")
    phases = compile_phases(log)
    assert list(phases["phases_s"]) == ["load", "int8-plan"] and phases["total_s"] >= 0
    log.write_text("ts=1 level=INFO logger=service msg=ready\n")
    assert compile_phases(log) is None
