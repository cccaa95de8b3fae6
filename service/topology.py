"""How the server's inference workers share the cores it may use (`artifact.cores`).

The workers never ask for more threads than that: W narrow workers of T intra-op threads each
(W x T <= cores) run independent batches side by side under load, and, when the server is
otherwise idle, a lone batch runs on a *wide* worker that uses every core (TVM keeps one thread
pool per calling thread, so each worker's pool is sized once, on its own thread). The wide
worker and the narrow ones never run at once (see `service.lanes`), so the cores are never
oversubscribed. docs/PERFORMANCE.md has the measurements behind the default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class TopologyError(ValueError):
    """Flags that would oversubscribe the cores the process may use."""


@dataclass(frozen=True)
class Topology:
    cores: int  # what the process may use
    workers: int  # batches that run side by side under load
    threads_per_worker: int  # intra-op threads of each of those
    wide: bool  # a lone batch on an idle server runs on every core
    queue_ahead: bool = True  # a busy worker holds the next batch, to start it without the event loop

    def describe(self) -> dict:
        return asdict(self)


def cores_to_use(asked: int | None, usable: int) -> int:
    """`--cores` where given, else every core the process may use (`usable`); more than it may use is
    refused: the extra threads would have no core to run on (64 on 2 cores took 25 s to start and 0.3 s
    a call)."""
    if asked is not None and asked > usable:
        raise TopologyError(f"--cores {asked} is more than the {usable} cores this process may use "
                            "(affinity and cgroup quota)")
    return asked or usable


def plan_topology(cores: int, backend: str, workers: int | None = None, threads_per_worker: int | None = None,
                  wide: bool | None = None, queue_ahead: bool = True, gpu: bool = False) -> Topology:
    """The default, or the flags' choice checked against the cores.

    TVM: one single-threaded worker per core (independent batches scale perfectly, while a
    2-thread batch of a small bucket gains little) plus the wide worker for latency when idle.
    PyTorch: one worker over every core (its OpenMP threads are shared process-wide, so a wide
    worker beside narrow ones is not possible), which is also what a PyTorch server runs.
    `gpu` (CUDA artifacts): one worker, since every call shares the GPU's one stream and runs
    alone (artifact/loader.py); more workers only queue batches that could have merged (on an
    H100 one worker served 156 req/s of mixed traffic, the default CPU topology 99:
    docs/CUDA.md).
    """
    if gpu:
        workers = workers or 1
        wide = False if wide is None else wide
    if backend == "torch":
        workers = workers or max(1, cores // (threads_per_worker or cores))
        threads_per_worker = threads_per_worker or max(1, cores // workers)
        wide = False if wide is None else wide
        if wide:
            raise TopologyError("--wide-worker needs --backend tvm (PyTorch's thread count is process-wide)")
    else:
        threads_per_worker = threads_per_worker or max(1, cores // (workers or cores))
        workers = workers or max(1, cores // threads_per_worker)
        wide = (cores > threads_per_worker) if wide is None else wide
    if workers * threads_per_worker > cores:
        raise TopologyError(
            f"{workers} workers x {threads_per_worker} threads would oversubscribe the {cores} cores this process "
            f"may use (affinity and cgroup quota); lower --workers or --threads-per-worker"
        )
    return Topology(cores, workers, threads_per_worker, wide and cores > threads_per_worker, queue_ahead)
