"""Cores, workers and the lanes that run batches (pure: fake cgroup trees, the event loop only)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from artifact.cores import cgroup_cpu_limit, usable_cores
from service.admission import ARRIVAL_SMOOTHING, InputQueue
from service.lanes import Lanes
from service.tokenization import Encoded
from service.topology import Topology, TopologyError, cores_to_use, plan_topology


def cgroup(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no quota
    ({"cpu.max": "150000 100000\n"}, 1.5),  # v2: 1.5 CPUs
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
    ({}, None),  # no cgroup files at all
])
def test_cgroup_quota_is_read_from_v1_or_v2(tmp_path, files, limit):
    assert cgroup_cpu_limit(cgroup(tmp_path, files)) == limit


def test_usable_cores_is_the_affinity_capped_by_the_quota_floored(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(cgroup(tmp_path / "none", {})) == affinity
    assert usable_cores(cgroup(tmp_path / "half", {"cpu.max": "50000 100000"})) == 1  # 0.5 CPU: still one
    assert usable_cores(cgroup(tmp_path / "big", {"cpu.max": f"{100000 * (affinity + 8)} 100000"})) == affinity


@pytest.mark.parametrize("cores, backend, flags, expected", [
    (2, "tvm", {}, Topology(2, 2, 1, True)),
    (4, "tvm", {}, Topology(4, 4, 1, True)),
    (1, "tvm", {}, Topology(1, 1, 1, False)),  # one core: nothing to widen to
    (4, "tvm", {"threads_per_worker": 2}, Topology(4, 2, 2, True)),
    (4, "tvm", {"workers": 1}, Topology(4, 1, 4, False)),
    (4, "tvm", {"wide": False}, Topology(4, 4, 1, False)),
    (2, "torch", {}, Topology(2, 1, 2, False)),
    (4, "torch", {"threads_per_worker": 1}, Topology(4, 4, 1, False)),
    (16, "tvm", {"gpu": True}, Topology(16, 1, 16, False)),  # a CUDA artifact: its calls run one at a time
    (4, "tvm", {"gpu": True, "workers": 2}, Topology(4, 2, 2, False)),  # flags still choose
])
def test_topology_defaults_and_flags(cores, backend, flags, expected):
    assert plan_topology(cores, backend, **flags) == expected


def test_oversubscribing_flags_are_refused():
    with pytest.raises(TopologyError, match="oversubscribe the 2 cores"):
        plan_topology(2, "tvm", workers=2, threads_per_worker=2)
    with pytest.raises(TopologyError, match="needs --backend tvm"):
        plan_topology(2, "torch", wide=True)


def test_cores_beyond_what_the_process_may_use_are_refused():
    assert cores_to_use(None, 4) == 4 and cores_to_use(2, 4) == 2 and cores_to_use(4, 4) == 4
    with pytest.raises(TopologyError, match="--cores 5 is more than the 4 cores this process may use"):
        cores_to_use(5, 4)


def test_the_cli_refuses_more_cores_than_it_may_use_with_one_line(tiny_embed_artifact):
    asked = usable_cores() + 1
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(tiny_embed_artifact), "--cores",
                             str(asked)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"bert-serve: error: --cores {asked} is more than the {usable_cores()} cores this process may use "
        "(affinity and cgroup quota)"]


def test_the_cli_refuses_an_oversubscribing_topology_with_one_line(tiny_embed_artifact):
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(tiny_embed_artifact), "--cores", "2",
                             "--workers", "2", "--threads-per-worker", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bert-serve: error: 2 workers x 2 threads would oversubscribe the 2 cores this process may use "
        "(affinity and cgroup quota); lower --workers or --threads-per-worker"]


def test_a_lone_batch_takes_the_wide_lane_and_shuts_out_the_narrow_ones():
    async def scenario():
        lanes = Lanes(Topology(2, 2, 1, True, queue_ahead=False), configure_thread=lambda threads: None)
        try:
            wide = lanes.take(alone=True)
            assert wide is lanes.wide and not lanes.has_free()  # every core is taken
            waiting = asyncio.ensure_future(lanes.wait_free())
            await asyncio.sleep(0)
            assert not waiting.done()
            lanes.release(wide)
            await asyncio.wait_for(waiting, 5)
            first = lanes.take(alone=False)
            second = lanes.take(alone=True)  # not alone on the machine: a narrow lane, beside the first
            assert {first, second} == set(lanes.narrow) and not lanes.has_free()
            lanes.release(first)
            assert lanes.take(alone=True) is first  # the wide lane needs every narrow one idle
        finally:
            lanes.shutdown()

    asyncio.run(scenario())


def test_queue_ahead_puts_a_batch_only_behind_the_lane_expected_to_be_free_first():
    lanes = Lanes(Topology(2, 2, 1, True), configure_thread=lambda threads: None)
    try:
        slow, fast = lanes.take(alone=False, cost_ms=50_000), lanes.take(alone=False, cost_ms=10)
        assert {slow, fast} == set(lanes.narrow)  # idle lanes first
        assert lanes.has_free() and lanes.take(alone=False, cost_ms=10) is fast  # behind the batch that ends first
        assert not lanes.has_free()  # one batch queued per lane, and none behind the long batch
        lanes.release(fast)
        assert lanes.has_free() and lanes.take(alone=True) is fast  # not alone: the wide lane waits for idle
        lanes.release(fast)
        lanes.release(fast)
        assert lanes.take(alone=True) is fast  # idle, but the slow lane is not: still a narrow lane
    finally:
        lanes.shutdown()


def test_each_lane_sizes_its_own_threads_on_its_own_thread():
    seen: dict[str, int] = {}

    def configure(threads: int) -> None:
        seen[threading.current_thread().name] = threads

    async def scenario():
        lanes = Lanes(Topology(4, 2, 2, True), configure)
        try:
            for lane in lanes.all:
                lane.submit(lambda: None).result()
        finally:
            lanes.shutdown()

    asyncio.run(scenario())
    assert sorted(seen.values()) == [2, 2, 4] and len(seen) == 3


ITEM = Encoded(ids=np.ones(3, dtype=np.int64), type_ids=np.zeros(3, dtype=np.int64))


def test_the_arrival_rate_rises_with_arrivals_and_decays_in_silence():
    """Arrivals 1 ms apart on an injected clock: the rate is the share that found company over
    the mean gap, then falls as 1 / silence."""
    async def scenario():
        clock = [100.0]
        queue = InputQueue(capacity=100, clock=lambda: clock[0])
        assert queue.arrival_rate() == 0.0  # nothing seen: never worth waiting for
        for _ in range(5):
            queue.admit([ITEM])  # the first finds the server empty, the next four find company
            clock[0] += 0.001
        clock[0] -= 0.001  # at the last arrival
        company = 1 - (1 - ARRIVAL_SMOOTHING) ** 4
        assert queue.arrival_rate() == pytest.approx(company / 0.001)  # ~590 per second
        clock[0] += 10
        after_10_s = queue.arrival_rate()
        clock[0] += 10
        assert after_10_s == pytest.approx(company / 10) == pytest.approx(queue.arrival_rate() * 2)

    asyncio.run(scenario())


def test_requests_that_each_find_the_server_empty_predict_no_company():
    """A client sending back to back: each request arrives once the last one is answered, at a
    high rate, and never finds company; lingering for the next one would only delay it."""
    async def scenario():
        queue = InputQueue(capacity=100)
        for _ in range(20):
            queue.release(queue.admit([ITEM]))
        assert queue.arrival_rate() == 0.0
        waiting = queue.admit([ITEM])
        queue.admit([ITEM])  # arrives while the first is still in the server
        assert queue.arrival_rate() > 0.0
        queue.release(waiting)

    asyncio.run(scenario())
