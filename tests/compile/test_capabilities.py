"""compile/capabilities.py: what the capability table says of a target."""

from __future__ import annotations

from compile.capabilities import Capabilities
from tests.support.schedules import cpu_target


def test_vector_lanes_follow_target_features():
    assert Capabilities.of(cpu_target("skylake-avx512")).lanes == 16
    assert Capabilities.of(cpu_target("haswell")).lanes == 8
    assert Capabilities.of(cpu_target("x86-64")).lanes == 4
