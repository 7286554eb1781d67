"""The virtual clock: a heap of [time, sequence, callback, args]. Nothing in the simulator reads a real clock.
`at` returns the entry; `cancel(entry)` drops it (it is skipped, and not counted, when its time comes)."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[list] = []
        self._seq = 0

    def __call__(self) -> float:  # the router's `clock`
        return self.now

    def at(self, t: float, fn: Callable, *args) -> list:
        """Run fn(*args) at virtual time t (never before now); equal times run in scheduling order."""
        self._seq += 1
        entry = [t if t > self.now else self.now, self._seq, fn, args]
        heapq.heappush(self._heap, entry)
        return entry

    @staticmethod
    def cancel(entry: list) -> None:
        entry[2] = None

    def run(self, until: float = float("inf")) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            if fn is None:
                continue
            self.now = t
            self.events += 1
            fn(*args)

    @property
    def pending(self) -> int:
        return len(self._heap)
