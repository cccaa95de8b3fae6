"""The CPU capabilities a test may require (`@pytest.mark.requires("amx")`), whether this CPU has
them, and the record of which the suite exercised.

A capability is present where LLVM gives this machine's target its features (the compile stage
then uses them) and /proc/cpuinfo lists them (a library using them runs here), as
artifact/cpu_features.py reads both; a kernel family's also where compile/capabilities.py's table says
its micro-kernels run here. A test that builds for a named CPU and runs only where this one
can run that code skips at run time instead (tests/support/tvm_run.skip_unless_runs_here): its code
generation is checked on every host.

At the end of a run one line says this CPU (LLVM's mcpu and features) and, per required capability,
how many tests ran and how many were skipped for want of it; with `BERT_TEST_FEATURES_FILE` set, the
same record is written there as JSON. Under xdist the controller gathers it from the workers' reports.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from artifact.cpu_features import missing_on_host, target_features

# An x86-64 level needs every feature LLVM gives its CPU; the others are kernel families' (`features`).
LEVELS = {"avx2": "x86-64-v3", "avx512": "x86-64-v4", "avx512_vnni": "cascadelake"}
CAPABILITIES = (*LEVELS, "avx512_bf16", "amx")
FEATURES_FILE = "BERT_TEST_FEATURES_FILE"
# a test's user properties (in its reports, so that an xdist controller sees them): one per capability
# it requires, and one per capability it is skipped for
REQUIRES, LACKS = "requires", "lacks"


@functools.cache
def host() -> tuple[str, tuple[str, ...]]:
    """This machine's CPU as the compile stage targets it: (LLVM's name for it, the features LLVM gives it)."""
    from compile.build import make_target
    from compile.capabilities import cpu_name

    target = make_target("cpu")
    return cpu_name(target), tuple(target_features(target))


@functools.cache
def features(capability: str) -> tuple[str, ...]:
    """The LLVM features `capability` needs."""
    from compile.build import make_target
    from compile.kernels import amx, bf16

    if capability in LEVELS:
        return tuple(target_features(make_target("cpu", mcpu=LEVELS[capability])))
    return {"avx512_bf16": bf16.REQUIRED_FEATURES, "amx": amx.REQUIRED_FEATURES}[capability]


@functools.cache
def missing(capability: str) -> tuple[str, ...]:
    """What this CPU lacks of `capability`: its features that LLVM or /proc/cpuinfo does not list, or,
    for a kernel family, the C compiler that builds its micro-kernels (compile/capabilities.py)."""
    from compile.build import make_target
    from compile.capabilities import Capabilities

    needed = features(capability)
    hidden = missing_on_host(needed) or []
    lacking = tuple(feature for feature in needed if feature not in host()[1] or feature in hidden)
    kernels = {"avx512_bf16": "bf16", "amx": "amx"}.get(capability)
    if not lacking and kernels and not getattr(Capabilities.of(make_target("cpu")), kernels):
        return (f"a C compiler that builds its {kernels} micro-kernels",)
    return lacking


def required(item: pytest.Item) -> list[str]:
    """The capabilities `item`'s requires markers name, in order."""
    return [capability for marker in item.iter_markers("requires") for capability in marker.args]


class FeatureRecord:
    """A pytest plugin: marks a test skipped where this CPU lacks a capability it requires, and counts
    the tests of each capability that ran and that were skipped."""

    def __init__(self) -> None:
        self.ran: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            for capability in required(item):
                if capability not in CAPABILITIES:
                    raise pytest.UsageError(f"{item.nodeid}: unknown capability {capability!r} in requires(); known: "
                                            f"{', '.join(CAPABILITIES)}")
                item.user_properties.append((REQUIRES, capability))
                lacking = missing(capability)
                if lacking:
                    item.user_properties.append((LACKS, capability))
                    item.add_marker(pytest.mark.skip(reason=f"requires {capability}: this CPU lacks {', '.join(lacking)}"))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        properties = [tuple(pair) for pair in report.user_properties]
        if report.when == "setup" and report.skipped:
            self.skipped.update(value for name, value in properties if name == LACKS)
        elif report.when == "call" and not report.skipped:
            self.ran.update(value for name, value in properties if name == REQUIRES)

    def record(self) -> dict:
        mcpu, features = host()
        return {"mcpu": mcpu, "features": list(features), "ran": dict(sorted(self.ran.items())),
                "skipped": dict(sorted(self.skipped.items()))}

    def line(self) -> str:
        record = self.record()
        counts = ", ".join(f"{capability} {record['ran'].get(capability, 0)} ran / {record['skipped'].get(capability, 0)} "
                           "skipped" for capability in CAPABILITIES if capability in self.ran or capability in self.skipped)
        return f"CPU {record['mcpu']} ({' '.join(record['features'])}); required capabilities: {counts or 'none'}"

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
            return
        terminalreporter.write_line(self.line())
        path = os.environ.get(FEATURES_FILE)
        if path:
            Path(path).write_text(json.dumps(self.record(), indent=1) + "\n")
