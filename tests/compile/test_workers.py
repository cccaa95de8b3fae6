"""compile/workers.py: builds in forked worker processes, their failures back in the compile."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from compile import workers as workers_module
from compile.workers import BUILD_NICENESS, BuildFailed, Workers


def _write_pid(path: Path) -> None:
    path.write_text(str(os.getpid()))


def _broken() -> None:
    raise ValueError("a kernel the schedule cannot take")


def test_builds_run_in_other_processes_and_a_failure_comes_back_with_its_traceback(tmp_path):
    with Workers(limit=2) as workers:
        for name in ("a", "b", "c"):
            workers.submit(name, lambda name=name: _write_pid(tmp_path / name))
        workers.submit("broken", _broken)
        seconds = workers.wait("a", "b", "c")
        with pytest.raises(BuildFailed, match=r"building broken failed in its worker process: ValueError: a kernel "
                                              r"the schedule cannot take\n(.|\n)*in _broken"):
            workers.wait("broken")
        with pytest.raises(BuildFailed):
            workers.idle()  # every build, the failed one included
    pids = {int((tmp_path / name).read_text()) for name in ("a", "b", "c")}
    assert os.getpid() not in pids and set(seconds) == {"a", "b", "c"} and min(seconds.values()) >= 0
    with pytest.raises(ValueError, match="submitted twice"):
        workers.submit("a", lambda: None)


def test_leaving_the_block_ends_the_builds_still_running():
    """A failed or stopped compile leaves no build behind."""
    never = multiprocessing.get_context("fork").Event()
    with Workers(limit=1) as workers:
        workers.submit("stuck", never.wait)
        (running,) = workers.running.values()
    assert not running.process.is_alive() and running.process.exitcode is not None


def _ignoring_sigterm(deaf, never) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deaf.set()
    never.wait()


def test_a_build_that_outlives_its_sigterm_is_killed(monkeypatch):
    """A build that goes on after SIGTERM (one that got it before its handler was reset, which hung a
    stopped compile in join) is killed once the grace period is over."""
    monkeypatch.setattr(workers_module, "STOP_GRACE_S", 0.2)
    context = multiprocessing.get_context("fork")
    deaf, never = context.Event(), context.Event()
    with Workers(limit=1) as workers:
        workers.submit("deaf", lambda: _ignoring_sigterm(deaf, never))
        (running,) = workers.running.values()
        assert deaf.wait(60)
    assert running.process.exitcode == -signal.SIGKILL


def test_a_build_beside_the_compiles_own_work_yields_the_cores_to_it(tmp_path):
    """A build submitted `beside_the_compile` runs BUILD_NICENESS below the compile's priority (the int8
    plan's simulation beside it comes first); one the compile only waits for keeps its priority."""
    def write_niceness(name: str) -> None:
        (tmp_path / name).write_text(str(os.nice(0)))

    with Workers(limit=1) as workers:
        with workers.beside_the_compile():
            workers.submit("beside", lambda: write_niceness("beside"))
        workers.submit("waited", lambda: write_niceness("waited"))
        workers.wait("beside", "waited")
    assert int((tmp_path / "beside").read_text()) == min(19, os.nice(0) + BUILD_NICENESS)
    assert int((tmp_path / "waited").read_text()) == os.nice(0)


def _pid_and_square(x: int) -> tuple[int, int]:
    if x == 5:
        raise ValueError("a pass the simulation cannot run")
    if x == 2:  # in this process, after the child has sent everything and exited: its pipe is at its end
        while multiprocessing.active_children():
            time.sleep(0.01)
    return os.getpid(), x * x


def test_a_map_beside_a_child_computes_every_other_item_there_in_order(monkeypatch):
    """The int8 plan's independent passes: half of them in a forked child on the core the plan leaves
    idle, the results in the items' order, the progress counting both processes' items (the child's
    results all read before this process is done with its own); a failure in the child comes back with
    its traceback. Where this process may use one core, one process."""
    from compile.workers import map_beside_a_child

    monkeypatch.setattr(workers_module, "available_cores", lambda: 2)
    heard = []
    results = map_beside_a_child(_pid_and_square, [0, 1, 2, 3, 4], heard.append)
    assert [square for _, square in results] == [0, 1, 4, 9, 16]
    parent, child = {pid for pid, _ in results[::2]}, {pid for pid, _ in results[1::2]}
    assert parent == {os.getpid()} and len(child) == 1 and child != parent
    assert heard == sorted(heard) and heard[-1] == 5 and len(heard) == 5
    with pytest.raises(BuildFailed, match=r"a child computing int8 passes failed: ValueError: a pass the simulation "
                                          r"cannot run\n(.|\n)*in _pid_and_square"):
        map_beside_a_child(_pid_and_square, [0, 5, 2, 3])
    monkeypatch.setattr(workers_module, "available_cores", lambda: 1)
    assert {pid for pid, _ in map_beside_a_child(_pid_and_square, [0, 1, 2])} == {os.getpid()}


def test_a_computation_runs_in_a_child_beside_the_compile_and_idle_waits_for_it(monkeypatch):
    """The int8 plan's calibration, taken while the model is exported: computed in a child forked at
    once, its result pickled back; `idle` (before anything is timed) waits for it; a failure comes back
    with its traceback; leaving the block ends one whose result nobody asked for. Where this process
    may use one core, it is computed here when asked."""
    context = multiprocessing.get_context("fork")
    started, go, never = context.Event(), context.Event(), context.Event()

    def pid_once_let_go() -> int:
        started.set()
        go.wait()
        return os.getpid()

    monkeypatch.setattr(workers_module, "available_cores", lambda: 2)
    with Workers() as workers:
        computed = workers.compute("a pid", pid_once_let_go)
        assert started.wait(60) and not workers.running  # not a build
        go.set()
        workers.idle()
        assert computed.result() not in (None, os.getpid())
        with pytest.raises(BuildFailed, match=r"computing a kernel failed in its child: ValueError: a kernel the "
                                              r"schedule cannot take\n(.|\n)*in _broken"):
            workers.compute("a kernel", _broken).result()
        stuck = workers.compute("nothing", never.wait)
    assert stuck._child.exitcode == -signal.SIGKILL
    monkeypatch.setattr(workers_module, "available_cores", lambda: 1)
    with Workers() as workers:
        assert workers.compute("a pid", os.getpid).result() == os.getpid()
