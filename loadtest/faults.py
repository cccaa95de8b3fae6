"""Fault injection for the serving path: a backend wrapper that raises, returns too few rows, or
blocks, at chosen calls or at random; used by the fault-injection tests and the soak benchmark."""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Iterable


class InjectedFault(RuntimeError):
    """What a faulty backend raises, so a log line can never be mistaken for a real failure."""


class FaultyBackend:
    """The real backend, except at the calls of `run` (counted from 1) or warm-ups named here.

    `poison_id`: a batch holding this token raises. `block_calls`: the call waits until `release`
    is set (and sets `blocked` first, so a test knows it has started). `fail_rate`: the share of
    calls that raise, drawn from a seeded generator.
    """

    def __init__(self, backend, *, fail_calls: Iterable[int] = (), short_calls: Iterable[int] = (),
                 block_calls: Iterable[int] = (), fail_warmups: Iterable[int] = (), poison_id: int | None = None,
                 fail_rate: float = 0.0, seed: int = 0):
        self._backend = backend
        self.fail_calls, self.short_calls, self.block_calls = set(fail_calls), set(short_calls), set(block_calls)
        self.fail_warmups = set(fail_warmups)
        self.poison_id = poison_id
        self.fail_rate = fail_rate
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.calls = 0
        self.warmups = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def warmup(self) -> None:
        with self._lock:
            self.warmups += 1
            call = self.warmups
        if call in self.fail_warmups:
            raise InjectedFault(f"warm-up {call} failed")
        self._backend.warmup()

    def run(self, input_ids, attention_mask, token_type_ids, bucket=None, tokens=False):
        with self._lock:
            self.calls += 1
            call = self.calls
            unlucky = self._random.random() < self.fail_rate
        if call in self.block_calls:
            self.blocked.set()
            self.release.wait()
        if call in self.fail_calls or unlucky or (self.poison_id is not None and (input_ids == self.poison_id).any()):
            raise InjectedFault(f"call {call} failed")
        result = self._backend.run(input_ids, attention_mask, token_type_ids, bucket, tokens)
        if call in self.short_calls:
            return dataclasses.replace(result, output=result.output[:-1])
        return result
