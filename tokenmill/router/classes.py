"""Workload classes: each names its SLOs, its priority and how long its requests may be held.

A request's class comes from the header `x-tokenmill-class`, else from its API key (config `api_keys`),
else the default class. `batch` is sheddable: it is admitted only into idle capacity and is held (then
refused) first when workers are busy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CLASS_HEADER = "x-tokenmill-class"
PRIORITY_HEADER = "x-tokenmill-priority"


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    ttft_slo_s: float  # time to first token a request of this class must meet
    tpot_slo_s: float  # time per output token after the first
    priority: int  # lower first; sent to workers as JSON `priority` and header x-tokenmill-priority
    sheddable: bool = False  # admitted only while workers have idle capacity; held requests shed first
    max_queue: int = 64  # requests held in this class's queue at most (then 429)
    max_wait_s: float = 1.0  # a held request is refused after this long (bounded by the TTFT SLO too)

    def __post_init__(self):
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"workload class name {self.name!r} must be alphanumeric (with - or _)")
        for field in ("ttft_slo_s", "tpot_slo_s", "max_wait_s"):
            value = getattr(self, field)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"workload class {self.name!r}: {field} must be > 0, got {value}")
        if self.max_queue < 0:
            raise ValueError(f"workload class {self.name!r}: max_queue must be >= 0, got {self.max_queue}")

    def hold_deadline_s(self, arrival_s: float, min_ttft_s: float) -> float:
        """The latest time a held request may still be dispatched: it must be able to meet its TTFT SLO."""
        return arrival_s + max(0.0, min(self.max_wait_s, self.ttft_slo_s - min_ttft_s))


# The one source of the default SLOs: the router, `tokenmill serve`'s admission and `tokenmill bench`'s
# goodput (tokenmill/bench/slo.py derives its defaults from these) judge a request by the same bounds.
DEFAULT_CLASSES: tuple[WorkloadClass, ...] = (
    WorkloadClass("interactive", ttft_slo_s=1.0, tpot_slo_s=0.10, priority=0, max_queue=64, max_wait_s=0.5),
    WorkloadClass("agent", ttft_slo_s=4.0, tpot_slo_s=0.10, priority=1, max_queue=128, max_wait_s=2.0),
    WorkloadClass(
        "batch", ttft_slo_s=60.0, tpot_slo_s=1.0, priority=2, sheddable=True, max_queue=256, max_wait_s=30.0
    ),
)


def by_name(classes: tuple[WorkloadClass, ...]) -> dict[str, WorkloadClass]:
    return {c.name: c for c in classes}
