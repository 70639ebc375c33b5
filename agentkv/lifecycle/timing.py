"""Charging lifecycle, policy and store time to the session's counters without double counting."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from agentkv.metrics import Counters


class SectionTimer:
    """Nested timed sections over one `Counters`."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._stack: list[list[float]] = []

    @contextmanager
    def timed(self, counter: str) -> Iterator[None]:
        """Charge the time spent inside to `counter`, excluding nested sections and model forwards.

        Sections nest: a budget check (`lifecycle_seconds`) moves spans (`store_seconds`),
        a commit scores them (`policy_seconds`), a recomputed span runs the model inside
        `store_seconds`. Charging each section only its own time makes lifecycle + policy
        + store add up to the overhead without double counting, and keeps forwards in
        `forward_seconds` alone.
        """
        counters = self.counters
        frame = [0.0, 0.0]  # [elapsed of nested sections, forward seconds inside them]
        self._stack.append(frame)
        started = time.perf_counter()
        forward_before = counters.forward_seconds
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - started
            forward = counters.forward_seconds - forward_before
            own = max(0.0, elapsed - frame[0] - (forward - frame[1]))
            setattr(counters, counter, getattr(counters, counter) + own)
            if self._stack:
                self._stack[-1][0] += elapsed
                self._stack[-1][1] += forward
