"""Class queues: requests held by admission control, one bounded FIFO per workload class."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from tokenmill.router.classes import WorkloadClass


@dataclass
class Held:
    ctx: Any  # the router's RequestCtx
    future: Any  # asyncio.Future resolved with an InFlight, or failed with Refused; cancelled if the client left
    held_s: float  # when it was queued


class ClassQueues:
    def __init__(self, classes: tuple[WorkloadClass, ...]):
        self.classes = tuple(sorted(classes, key=lambda c: c.priority))  # highest priority first
        self._q: dict[str, deque[Held]] = {c.name: deque() for c in classes}

    def __getitem__(self, name: str) -> deque[Held]:
        return self._q[name]

    def room(self, cls: WorkloadClass) -> int:
        return cls.max_queue - len(self._q[cls.name])

    def depths(self) -> dict[str, int]:
        return {name: len(q) for name, q in self._q.items()}

    def any_waiting(self, sheddable: bool | None = None) -> bool:
        return any(self._q[c.name] for c in self.classes if sheddable is None or c.sheddable == sheddable)

    def empty(self) -> bool:
        """No request held in any class (cancelled ones not yet dropped count as held)."""
        return not any(self._q.values())

    def drop_done(self) -> None:
        """Forget entries whose client went away (their future was cancelled)."""
        for name, q in self._q.items():
            if any(h.future.done() for h in q):
                self._q[name] = deque(h for h in q if not h.future.done())
