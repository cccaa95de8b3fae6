"""Library builds in worker processes, one per core at a time: LLVM's code generation is single-threaded,
so libraries built one after another leave every core but one idle.

Each build runs in a child forked from the compile, which inherits the Relax module and everything the
build reads (nothing is serialised), writes its library and exits; its failure comes back as the
compile's error. Nothing is timed while a child builds: every phase that times (attention's products,
auto's precision, the strategies, each library's latency) first waits for the builds it reads
(`Workers.wait`), and the compile waits for all of them before timing anything else (`idle`), so that
timings, which decide precisions and strategies, are taken on an otherwise idle machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable, Generic, Sequence, TypeVar

MESSAGE_CHARS = 8000  # of a failed build's message and traceback (its end) that come back
# A build the compile's own work runs beside (the int8 plan's simulation beside auto's candidates),
# which the next step waits for, yields the cores to it and takes whatever it leaves idle. Builds the
# compile only waits for keep their priority (niced, they would yield to other tenants).
BUILD_NICENESS = 10
# Seconds a build has to end after SIGTERM before it is killed: a child that receives it before
# `_build_in_child` restores the default handler runs the compile's inherited one and goes on building.
STOP_GRACE_S = 5.0


class BuildFailed(RuntimeError):
    """A build failed in its worker: a fault of the compile (its traceback is the worker's), not of its input."""


Item, Result = TypeVar("Item"), TypeVar("Result")


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


@dataclass
class _Running:
    process: multiprocessing.Process
    errors: Connection
    started: float


def _failure(exc: BaseException) -> str:
    """A child's failure as the compile reports it: the exception and the end of its traceback."""
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"[-MESSAGE_CHARS:]


def _build_in_child(build: Callable[[], None], errors: Connection, niceness: int) -> None:
    """A child's work: `build`, its failure sent back as one message with its traceback (a SIGTERM
    ends it at once: the compile's own handler would raise inside TVM)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if niceness:
            os.nice(niceness)
        build()
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the compile
        errors.send(_failure(exc))  # within the pipe's buffer: sent whole before the compile reads it
        errors.close()
        os._exit(1)
    errors.close()


class Workers:
    """Builds running in forked children, at most `limit` at once (default: the cores this process
    may run on). `submit` waits for a free slot; `wait` returns each named build's seconds, or raises
    its failure; leaving the `with` block ends whatever still runs (a failed or stopped compile)."""

    def __init__(self, limit: int | None = None):
        self.limit = max(1, limit or available_cores())
        self.running: dict[str, _Running] = {}
        self.seconds: dict[str, float] = {}  # finished builds
        self.failures: dict[str, str] = {}
        self.niceness = 0  # of the builds submitted now (`beside_the_compile`)
        self.computing: list[Computed] = []  # `compute`'s children (not builds: `limit` does not count them)
        self._context = multiprocessing.get_context("fork")

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *_) -> None:
        for computed in self.computing:
            computed.stop()
        for running in self.running.values():
            running.process.terminate()
        for running in self.running.values():
            running.process.join(STOP_GRACE_S)
            if running.process.exitcode is None:  # the SIGTERM came before the child's handler was reset
                running.process.kill()
                running.process.join()
            running.errors.close()
        self.running.clear()

    @contextlib.contextmanager
    def beside_the_compile(self):
        """Builds submitted inside the block run BUILD_NICENESS below the compile's priority: it works
        beside them."""
        self.niceness = BUILD_NICENESS
        try:
            yield
        finally:
            self.niceness = 0

    def submit(self, name: str, build: Callable[[], None]) -> None:
        """Start `build` (writing one library) in a child as soon as fewer than `limit` run."""
        if name in self.running or name in self.seconds:
            raise ValueError(f"build {name} submitted twice")
        while len(self.running) >= self.limit:
            self._reap(block=True)
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_build_in_child, args=(build, sender, self.niceness), name=f"build {name}",
                                        daemon=True)
        process.start()
        sender.close()
        self.running[name] = _Running(process, receiver, time.perf_counter())

    def wait(self, *names: str) -> dict[str, float]:
        """The seconds of each build named (of every one submitted where none is), once finished; a
        failed build raises its error."""
        names = names or (*self.running, *self.seconds, *self.failures)
        while any(name in self.running for name in names):
            self._reap(block=True)
        for name in names:
            if name in self.failures:
                raise BuildFailed(f"building {name} failed in its worker process: {self.failures[name]}")
        return {name: self.seconds[name] for name in names}

    def idle(self) -> None:
        """Wait for every build and computation: what is timed next has the machine to itself."""
        for computed in self.computing:
            computed.result()
        self.wait()

    def compute(self, name: str, function: Callable[[], Result]) -> "Computed[Result]":
        """`function()` started in a child forked now, beside the compile's own work (where it leaves a
        core idle); `result()` waits for it, and so does `idle`."""
        computed = Computed(name, function)
        self.computing.append(computed)
        return computed

    def _reap(self, block: bool) -> None:
        if not self.running:
            return
        sentinels = {running.process.sentinel: name for name, running in self.running.items()}
        for sentinel in wait(list(sentinels), timeout=None if block else 0):
            name = sentinels[sentinel]
            running = self.running.pop(name)
            running.process.join()
            try:  # a failed build's message; a child that succeeded closed its end unsent
                message = running.errors.recv() if running.errors.poll() else None
            except EOFError:
                message = None
            running.errors.close()
            if running.process.exitcode != 0:
                self.failures[name] = message or f"its process exited {running.process.exitcode}"
            else:
                self.seconds[name] = time.perf_counter() - running.started


def _map_in_child(function: Callable, items: Sequence, results: Connection) -> None:
    """A child's share of `map_beside_a_child`: each result sent as it is done, or the failure."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        for index, item in enumerate(items):
            results.send((index, function(item)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the compile
        results.send((None, _failure(exc)))
        results.close()
        os._exit(1)
    results.close()


def _start_mapping(function: Callable, items: Sequence, name: str) -> tuple[multiprocessing.Process, Connection]:
    """A child forked now running `_map_in_child` over `items`, and the end of the pipe its results come on."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_map_in_child, args=(function, items, sender), name=name, daemon=True)
    child.start()
    sender.close()
    return child, receiver


def _end(child: multiprocessing.Process, receiver: Connection) -> None:
    """Close `child`'s pipe and reap it: it exits once it has sent (killed if it has not within STOP_GRACE_S)."""
    receiver.close()
    child.join(STOP_GRACE_S)
    if child.exitcode is None:
        child.kill()
        child.join()


class Computed(Generic[Result]):
    """`function()` computed in a child forked at construction (in this process, at `result()`, where
    it may use one core only), its result sent back pickled. A failure in the child raises at
    `result()` (BuildFailed, with its traceback)."""

    def __init__(self, name: str, function: Callable[[], Result]):
        self.name, self._function = name, function
        self._done: tuple[Result] | None = None
        self._child = None
        if available_cores() >= 2:
            self._child, self._receiver = _start_mapping(lambda _item: function(), [None], name)

    def result(self) -> Result:
        if self._done is None:
            self._done = (self._function() if self._child is None else self._received(),)
        return self._done[0]

    def _received(self) -> Result:
        try:
            index, value = self._receiver.recv()
        except EOFError:
            raise BuildFailed(f"the child computing {self.name} exited {self._child.exitcode} without its "
                              f"result") from None
        finally:
            _end(self._child, self._receiver)
        if index is None:
            raise BuildFailed(f"computing {self.name} failed in its child: {value}")
        return value

    def stop(self) -> None:
        """End the child where its result was never asked for (a failed compile)."""
        if self._child is not None and self._done is None and self._child.exitcode is None:
            self._receiver.close()
            self._child.kill()
            self._child.join()


def map_beside_a_child(function: Callable[[Item], Result], items: Sequence[Item],
                       progress: Callable[[int], None] = lambda done: None) -> list[Result]:
    """`[function(item) for item in items]`, every other item computed in a child forked now, on the core
    this process leaves idle (the int8 plan's passes run PyTorch on one thread), its results sent back
    pickled; `progress(done)` hears how many are done. One process where this one may use one core. A
    failure in the child raises here (BuildFailed, with its traceback)."""
    if available_cores() < 2 or len(items) < 2:
        results = []
        for item in items:
            results.append(function(item))
            progress(len(results))
        return results
    child, receiver = _start_mapping(function, items[1::2], "int8 passes")
    done: dict[int, Result] = {}
    awaited = len(items[1::2])

    def collect(block: bool) -> None:
        nonlocal awaited
        while awaited and (block or receiver.poll()):  # (poll is also true at the end of a child's sends)
            try:
                index, result = receiver.recv()
            except EOFError:
                raise BuildFailed(f"a child computing {len(items) // 2} of {len(items)} int8 passes "
                                  f"exited {child.exitcode} without its results") from None
            if index is None:
                raise BuildFailed(f"a child computing int8 passes failed: {result}")
            done[2 * index + 1] = result
            awaited -= 1
            progress(len(done))

    try:
        for index in range(0, len(items), 2):
            done[index] = function(items[index])
            progress(len(done))
            collect(block=False)
        collect(block=True)
    finally:
        _end(child, receiver)
    return [done[index] for index in range(len(items))]
