"""The router process's garbage-collector pauses: while Python's cyclic collector runs, the event loop answers
nothing (no proxied chunk, no Endpoint Picker decision), so a full collection over the startup heap (~45k
tracked objects: aiohttp, gRPC, protobuf, prometheus) is a 10 ms+ stall that lands in the tail latency of
every request in flight.

    watch = GcPauses(registry); watch.start()     # histogram tokenmill_router_gc_pause_seconds{generation}
    settle_heap()                                  # after startup: collect once, then gc.freeze()

`settle_heap` moves everything alive after startup (modules, classes, the app) into the permanent
generation, so later collections only scan what requests allocate (the usual fix for a latency-sensitive
Python server). It is called by `tokenmill route` once the app has started, not by the library.

`young_threshold(YOUNG_THRESHOLD)` (also called by `tokenmill route`) lets 10,000 container objects, not
Python's 700, be allocated (net of those freed) before a young collection. A request's objects are freed by
reference counting as soon as it is answered: under the Endpoint Picker's 500 requests/s the young
collections found **no** garbage cycle (`collected` 0 in every one) and each stopped the loop for ~0.3-0.9 ms,
~2 per second — pure tail latency. With 10,000 they are ~15x rarer (one per ~6,000 picks in-process) and
take about as long each (docs/benchmarks/kubernetes.md, session 9).
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Histogram

PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
YOUNG_THRESHOLD = 10_000


def young_threshold(n: int = YOUNG_THRESHOLD) -> tuple[int, int, int]:
    """Allocations (net) between young collections; the older generations' thresholds unchanged. Returns the
    thresholds before, for gc.set_threshold(*before)."""
    if n < 1:
        raise ValueError(f"the young-generation threshold must be >= 1, got {n}")
    before = gc.get_threshold()
    gc.set_threshold(n, *before[1:])
    return before


def settle_heap() -> int:
    """Collect, then freeze what is left (it is the process's startup state); returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Observes every collection's duration (gc.callbacks) into a histogram labelled by generation."""

    def __init__(self, registry, name: str = "tokenmill_router_gc_pause_seconds"):
        self.pauses = Histogram(name, "Cyclic garbage-collector pauses of the router process (the event loop "
                                "is stopped meanwhile)", ["generation"], buckets=PAUSE_BUCKETS, registry=registry)
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.labels(str(info.get("generation", "?"))).observe(time.perf_counter() - self._t0)

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
