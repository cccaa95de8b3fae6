"""`--tune SECONDS`: MetaSchedule per bucket, kept only where it beats the hand schedule.

AutoTVM's per-shape tuning on TVM 0.27: each padded bucket's kernels have constant shapes, so each
can be searched on its own. For every kernel of a bucket (its fused PrimFuncs, before the CPU
schedule pass) MetaSchedule samples schedules from its default CPU design space (multi-level
tiling, parallel / vectorise / unroll) and measures them; the best one is then timed against our
hand schedule (`schedule.schedule_func`), interleaved, on the same random inputs, and checked to
give the same outputs. Only a tuned kernel faster by more than `KEEP_MARGIN` is kept: the build
applies it in place of the hand schedule (`schedule.apply_tuned`), and its record ships in the artifact's
`tuning/` database, so the service never tunes. The search uses MetaSchedule's random cost model
(the pinned environment has no xgboost); packed and generic libraries have symbolic token counts
and are not tuned. The budget is spent per bucket, split over its kernels, and is approximate:
a trial costs what a build and a run cost on this machine, measured as the search goes.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from artifact.manifest import KernelTuning, TuningEntry

from .capabilities import KernelConfig
from .kernels import script
from .kernels.common import SCHEDULED_ATTR
from .kernels.fast_math import fast_math
from .lowering import tir_pipeline
from .schedule import fusion_passes, schedule_func, tuning_workload
from .timing import interleaved_medians

log = logging.getLogger(__name__)

KEEP_MARGIN = 0.03  # a tuned kernel must beat the hand schedule by more than this fraction
TRIALS_PER_ROUND = 8
FIRST_TRIAL_SECONDS = 5.0  # the estimate before any trial is measured (a build and a run, 2 cores)
DATABASE_DIR = "tuning"
TENSOR_INTRINSICS = "tvm.s_tir.tensor_intrin"  # every one TVM has: MetaSchedule imports them to start


def keeps(hand_ms: float, tuned_ms: float | None, margin: float = KEEP_MARGIN) -> bool:
    return tuned_ms is not None and tuned_ms < hand_ms * (1 - margin)


class Tuner:
    """Tunes the kernels of one bucket library after another; holds the kept records."""

    def __init__(self, target: Target):
        cores = int(target.attrs.get("num-cores", 0)) or len(os.sched_getaffinity(0))
        self.target = Target({**target.export(), "num-cores": cores})  # MetaSchedule needs it
        self.database = ms.database.MemoryDatabase()
        self.report: list[KernelTuning] = []
        self._seconds_per_trial = FIRST_TRIAL_SECONDS
        script.import_from_new_thread(TENSOR_INTRINSICS)  # MetaSchedule's first step, made cheap
        search_log = logging.getLogger("tvm.s_tir.meta_schedule")  # unset, it prints every trial to stdout
        if search_log.level == logging.NOTSET:
            search_log.setLevel(logging.WARNING)

    def tune(self, library: str, mod: tvm.IRModule, seconds: float) -> None:
        """Spend about `seconds` on the kernels of `mod` (one library's module, before the build):
        the slowest under the hand schedule first, each at least one round of trials (the first
        one whatever the budget)."""
        deadline = time.monotonic() + seconds
        kernels = tunable_kernels(mod, self.target)
        hand = {name: schedule_func(func, self.target, name) or func for name, func in kernels.items()}
        hand_ms = {name: _interleaved_ms({"hand": func}, self.target)["hand"] for name, func in hand.items()}
        order = sorted(kernels, key=hand_ms.get, reverse=True)
        for index, name in enumerate(order):
            rounds = int((deadline - time.monotonic()) / (len(order) - index)
                         / (self._seconds_per_trial * TRIALS_PER_ROUND))
            if index and time.monotonic() + self._seconds_per_trial * TRIALS_PER_ROUND > deadline:
                log.info("%s: budget spent after %d of %d kernels", library, index, len(order))
                return
            self.report.append(self._tune_kernel(library, name, kernels[name], hand[name],
                                                 max(1, rounds) * TRIALS_PER_ROUND))

    def _tune_kernel(self, library: str, name: str, func: tirx.PrimFunc, hand: tirx.PrimFunc,
                     trials: int) -> KernelTuning:
        started = time.monotonic()
        workload = tuning_workload(func)
        with tempfile.TemporaryDirectory(prefix="bert-tune-") as work_dir:
            # each round's builds run in new worker processes, each importing TVM's tensor intrinsics
            builder = ms.builder.LocalBuilder(
                initializer=functools.partial(script.import_from_new_thread, TENSOR_INTRINSICS))
            searched = ms.tune_tir(func, self.target, work_dir, max_trials_global=trials,
                                   num_trials_per_iter=TRIALS_PER_ROUND, builder=builder, cost_model="random",
                                   strategy="replay-trace", num_tuning_cores=int(self.target.attrs["num-cores"]))
            best = searched.query_tuning_record(workload, self.target, "main")
        self._seconds_per_trial = max(0.1, (time.monotonic() - started) / trials)
        candidates = {"hand": hand}
        if best is not None:
            sch = s_tir.Schedule(workload)
            best.trace.apply_to_schedule(sch, remove_postproc=False)
            candidates["tuned"] = sch.mod["main"]
        times = _interleaved_ms(candidates, self.target)
        hand_ms, tuned_ms = times["hand"], times.get("tuned")
        kept = keeps(hand_ms, tuned_ms)
        if kept:
            self.database.commit_tuning_record(ms.database.TuningRecord(
                best.trace, self.database.commit_workload(workload), [tuned_ms / 1e3], self.target, best.args_info))
        log.info("%s %s: hand %.4f ms, tuned %s ms over %d trials%s", library, name, hand_ms, tuned_ms, trials,
                 ": kept" if kept else "")
        return KernelTuning(library=library, kernel=name, trials=trials, hand_ms=hand_ms, tuned_ms=tuned_ms,
                            kept=kept)

    def save(self, directory: Path, seconds: float) -> TuningEntry:
        """Write the kept records as a MetaSchedule JSON database under `directory`; the manifest's entry."""
        kept = self.database.get_all_tuning_records()
        if kept:
            (directory / DATABASE_DIR).mkdir()
            saved = ms.database.JSONDatabase(str(directory / DATABASE_DIR / "workloads.json"),
                                             str(directory / DATABASE_DIR / "records.json"))
            for record in kept:
                saved.commit_tuning_record(ms.database.TuningRecord(
                    record.trace, saved.commit_workload(record.workload.mod), record.run_secs, record.target,
                    record.args_info))
        return TuningEntry(seconds_per_bucket=seconds, database=DATABASE_DIR if kept else None, kernels=self.report)


def tunable_kernels(mod: tvm.IRModule, target: Target) -> dict[str, tirx.PrimFunc]:
    """The PrimFuncs the CPU schedule pass would see in `mod` (a bucket's module), as it would see
    them (fast-math applied), that have constant shapes and only float tensors (random inputs can
    run them safely: no index tensors); one per structure."""
    with target:
        fused = tvm.transform.Sequential(fusion_passes(target, KernelConfig.of(target)))(mod)
    kernels: dict[str, tirx.PrimFunc] = {}
    seen = set()
    for gvar, func in fused.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get(SCHEDULED_ATTR, False):
            continue
        shapes = [getattr(param.ty, "shape", None) for param in func.params]
        if not all(shape is not None and all(isinstance(d, tirx.IntImm) for d in shape)
                   and param.ty.dtype == "float32" for shape, param in zip(shapes, func.params)):
            continue
        func = fast_math(func)
        key = tvm_ffi.structural_hash(func)
        if key not in seen:
            seen.add(key)
            kernels[gvar.name_hint] = func
    return kernels


def _interleaved_ms(funcs: dict[str, tirx.PrimFunc], target: Target) -> dict[str, float | None]:
    """Median ms of each kernel, built as the library will be and run interleaved on the same
    random inputs; None for a kernel whose outputs differ from the first one's."""
    rng = np.random.default_rng(0)
    first = next(iter(funcs.values()))
    inputs = [rng.standard_normal([int(d) for d in param.ty.shape]).astype(np.float32) for param in first.params]
    built = {name: tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target,
                               tir_pipeline=tir_pipeline(target)) for name, func in funcs.items()}
    arguments = {name: [tvm.runtime.tensor(a) for a in inputs] for name in funcs}
    for name in funcs:
        built[name]["main"](*arguments[name])
    reference = [a.numpy() for a in next(iter(arguments.values()))]
    agree = {name: all(np.allclose(a.numpy(), b, rtol=1e-4, atol=1e-4) for a, b in zip(arguments[name], reference))
             for name in funcs}
    stats = interleaved_medians({name: (lambda name=name: built[name]["main"](*arguments[name])) for name in funcs},
                                repeats=7, warmup=2, warm_calls=1)
    return {name: round(stats[name]["median_s"] * 1e3, 4) if agree[name] else None for name in funcs}
