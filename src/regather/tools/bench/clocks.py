"""Clocks the bench attaches to the backward's waits, for the span it measures.

The library's hot path has no clock of its own: the regather strategy and MoE's re-dispatch
each wait through an optional observer (:attr:`regather.core.strategies.regather.RegatherSlot.observer`,
:attr:`regather.megatron.moe.inputs.MoEForward.observer`), None in training. These context
managers set one for the span of a measurement, in the process that runs it, and put the
previous one back:

- :func:`regather_waits` — seconds backward spent blocked on the x re-gather, and how many waits;
- :func:`redispatch_times` — per MoE layer, into its re-dispatch counts: ``wait_s`` (backward
  blocked on the re-dispatched tokens) and ``flight_s`` (from a re-dispatch's start to its
  arrival; what was not waited for overlapped the experts' backward).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class WaitClock:
    """Seconds spent in ``wait()`` on the re-gather, and the number of waits."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wait(self, pending):
        t0 = time.perf_counter()
        out = pending.wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class RedispatchClock:
    """Adds ``wait_s`` and ``flight_s`` to a MoE layer's re-dispatch counts."""

    @staticmethod
    def started() -> float:
        return time.perf_counter()

    @staticmethod
    def wait(pending, started: float, counts: dict):
        t0 = time.perf_counter()
        out = pending.wait()
        t1 = time.perf_counter()
        counts["wait_s"] = counts.get("wait_s", 0.0) + t1 - t0  # backward blocked
        counts["flight_s"] = counts.get("flight_s", 0.0) + t1 - started  # start to rows
        return out


@contextmanager
def _observing(cls: type, observer) -> Iterator:
    before = cls.observer
    cls.observer = observer
    try:
        yield observer
    finally:
        cls.observer = before


@contextmanager
def regather_waits() -> Iterator[WaitClock]:
    """A :class:`WaitClock` on every regather slot's backward wait while the block runs."""
    from regather.core.strategies.regather import RegatherSlot

    with _observing(RegatherSlot, WaitClock()) as clock:
        yield clock


@contextmanager
def redispatch_times() -> Iterator[RedispatchClock]:
    """A :class:`RedispatchClock` on every MoE layer's re-dispatch while the block runs."""
    from regather.megatron.moe.inputs import MoEForward

    with _observing(MoEForward, RedispatchClock()) as clock:
        yield clock
