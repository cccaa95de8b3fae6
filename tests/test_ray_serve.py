"""Ray Serve: two replicas of the service behind Serve's HTTP proxy, on a local Ray cluster on loopback.

The cluster is this test's own (2 CPUs, no dashboard, its own short temp dir), so it neither joins
nor disturbs anyone else's on the machine, and the test checks that none of its processes outlive it.
What is asserted: the deployment reports its two replicas running (before and after the burst),
every answer is right, and both replicas answered part of the burst. Serve's proxy sends each
request to the less loaded of two replicas drawn at random (ties at random), so a healthy pair
shares 40 requests; one replica answering all of them (odds 2**-39 if both serve) means the
other does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import ray
from ray import serve

from artifact.loader import load_artifact
from loadtest.servers import free_port
from service.inference import l2_normalize
from service.ray_serve import APP_NAME, DEFAULT_CONFIG, ConfigError, deploy, load_config
from service.settings import Settings
from service.tokenization import TextTokenizer

pytestmark = pytest.mark.slow  # collected first: see conftest.py

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
TEXTS = [" ".join(WORDS[offset:offset + length]) for offset, length in
         [(0, 3), (2, 9), (4, 5), (1, 12), (6, 2), (3, 7), (0, 14), (5, 4), (8, 6), (7, 1)]]
BURST, CONCURRENCY = 40, 8
DEPLOYMENT = "BertServer"  # service.ray_serve's @serve.deployment name


def _expected(artifact: Path) -> dict[str, np.ndarray]:
    """Each text run alone on the compiled model, mean-pooled and normalised as /embed returns it."""
    model = load_artifact(artifact)
    tokenizer = TextTokenizer(model.tokenizer_dir / "tokenizer.json", model.max_seq, model.manifest.model.vocab_size)
    expected = {}
    for text, encoded in zip(TEXTS, tokenizer.encode(TEXTS, truncation=None)):
        ids = encoded.ids[None, :]
        output = model.run(ids, np.ones_like(ids), encoded.type_ids[None, :]).output
        expected[text] = l2_normalize(output)[0]
    return expected


def _processes_under(directory: str) -> dict[int, str]:
    """Live processes whose command line mentions `directory` (Ray's session files live there)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if directory in cmdline:
            found[int(pid)] = cmdline[:200]
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}  # /proc/net hex


def _non_loopback_listeners(pids) -> list[str]:
    """TCP sockets in LISTEN state held by `pids` whose address is not 127.0.0.1 (or ::1)."""
    inodes = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    exposed = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes and address.split(":")[0] not in LOOPBACK:
                exposed.append(f"pid {inodes[inode]} listens on {address}")
    return exposed


def _replica_states() -> tuple[str, dict[str, int]]:
    """The application's status and its deployment's replica count per state, as serve.status() reports them."""
    application = serve.status().applications[APP_NAME]
    states = application.deployments[DEPLOYMENT].replica_states
    return str(getattr(application.status, "value", application.status)), {
        str(getattr(state, "value", state)): count for state, count in states.items()}


async def _burst(url: str) -> list[tuple[str, int, list, str]]:
    limit = asyncio.Semaphore(CONCURRENCY)
    # The timeout only keeps a hung replica from hanging the test; it asserts no speed.
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(i: int):
            text = TEXTS[i % len(TEXTS)]
            async with limit:
                response = await client.post("/embed", json={"inputs": text})
            body = response.json() if response.status_code == 200 else response.text
            return text, response.status_code, body, response.headers.get("x-replica", "")

        return await asyncio.gather(*(one(i) for i in range(BURST)))


def test_config_file_validates_and_flags_override(tmp_path):
    config = load_config(None, {})
    assert config.replicas is None and config.autoscaling.min_replicas <= config.autoscaling.max_replicas
    assert "autoscaling_config" in config.deployment_options()
    fixed = load_config(DEFAULT_CONFIG, {"replicas": 3, "ray_actor_options.num_cpus": 0.25, "http.port": 9001})
    options = fixed.deployment_options()
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 0.25} and fixed.http.port == 9001
    bad = tmp_path / "bad.yaml"
    bad.write_text("autoscaling: {min_replicas: 5, max_replicas: 2}\n")
    with pytest.raises(ConfigError, match="min_replicas 5 > max_replicas 2"):
        load_config(bad, {})
    bad.write_text("replica: 2\n")
    with pytest.raises(ConfigError, match="replica: Extra inputs"):
        load_config(bad, {})


def test_two_replicas_answer_a_burst_correctly(tiny_embed_artifact, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no reporting home from a test
    # On Linux, ray.init turns _node_ip_address 127.0.0.1 into the machine's address and Ray's
    # servers listen on it; with clusters "disabled" the node is loopback and every server binds
    # there. The variable reaches the processes Ray starts; the constant was read at `import ray`.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    expected = _expected(tiny_embed_artifact)
    port = free_port()
    config = load_config(DEFAULT_CONFIG, {"replicas": 2, "ray_actor_options.num_cpus": 0.5,
                                          "http.host": "127.0.0.1", "http.port": port})
    settings = Settings(artifacts=[tiny_embed_artifact], cores=1, max_wait_ms=5)  # one core per replica
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir=temp_dir, log_to_driver=False)
        url = deploy(settings, config)  # serve.run returns once the application is running
        deployed = _replica_states()
        results = asyncio.run(_burst(url))
        after_burst = _replica_states()
        exposed = _non_loopback_listeners([os.getpid(), *_processes_under(temp_dir)])
    finally:
        serve.shutdown()
        ray.shutdown()
    try:
        # Waits for each process's exit (the timeout only bounds a hang).
        processes = []
        for pid in _processes_under(temp_dir):
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(pid))
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not alive, f"Ray processes left behind: {_processes_under(temp_dir)}"
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)

    assert deployed == ("RUNNING", {"RUNNING": 2}), deployed
    assert after_burst == ("RUNNING", {"RUNNING": 2}), after_burst  # no replica died or restarted under load
    assert not exposed, exposed
    assert len(results) == BURST
    for text, status, body, _replica in results:
        assert status == 200, body
        np.testing.assert_allclose(np.asarray(body[0]), expected[text], atol=1e-4)
    replicas = {replica for *_, replica in results}
    assert "" not in replicas and len(replicas) == 2, replicas  # every answer names a replica; both answered
