"""Admission control: a pure function (snapshot, routing choice, class) -> admit | hold | reject.

`leading` (default) predicts from work the router has sent but not yet seen served:

    budget_s  = ttft_slo_s - (now - arrival_s)                 what is left of the class's TTFT SLO
    fits(w)   = predicted_ttft_s(w) <= budget_s                 waiting cannot change this: the queue drains
                                                                as fast as the budget shrinks
    clear(w)  = predicted_ttft_s(w) <= pending_slack_s(w)       the others' SLOs (see below)
                and predicted_tpot_s(w) <= tpot_slo_s
                and predicted_ttft_s(w) <= idle_headroom x tightest non-sheddable TTFT SLO   (sheddable only)
                and slow start (below)                          all of these can clear by waiting

pending_slack_s(w) is the least TTFT budget left among the requests already sent to w whose first token has
not come: continuous batching serves a new prompt in the same steps as those, so admitting it must not
push them past their SLO either (admitted requests keep their SLO).

An idle worker (nothing outstanding from this router, no prefill queued there by others as the worker
reports it) always fits and is clear: no queue can be blamed, and refusing it traffic would freeze a
pessimistic estimate forever. Slow start: until a worker's prefill rate has
`warmup_samples` samples it is mostly the prior, so clear(w) also needs no prefill pending there (one
probe at a time, like TCP slow start).

The routing policy's choice is admitted when it fits and is clear; else the worker that does with the
least predicted TTFT. When no worker fits, the request is refused at once (429, Retry-After = the
predicted excess). When some fit but none is clear, it is held in its class queue (if there is room)
until its hold deadline arrival + min(max_wait_s, ttft_slo_s - ttft_base_s), then refused.

`lagging` is the comparison baseline: every worker fits, and clear(w) = observed TTFT EWMA <=
lagging_ttft_factor x ttft_slo_s and reported waiting requests <= lagging_max_waiting (signals that move
only after the overload happened).
`off` admits the routing choice whenever a worker is routable.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.router.classes import WorkloadClass
from tokenmill.router.policies import RouteChoice
from tokenmill.router.snapshot import RouteSnapshot, WorkerView, predicted_tpot_s, predicted_ttft_s

MODES = ("leading", "lagging", "off")


@dataclass(frozen=True)
class AdmissionConfig:
    mode: str = "leading"
    idle_headroom: float = 0.5  # sheddable classes only use workers predicted under this share of the tightest SLO
    check_tpot: bool = True
    warmup_samples: int = 2  # slow start: one pending prefill per worker until its rate has this many samples
    lagging_ttft_factor: float = 1.0
    lagging_max_waiting: int = 8

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown admission mode {self.mode!r}; choose from {', '.join(MODES)}")
        if not 0 < self.idle_headroom <= 1:
            raise ValueError(f"admission idle_headroom must be in (0, 1], got {self.idle_headroom}")
        if self.warmup_samples < 0:
            raise ValueError(f"admission warmup_samples must be >= 0, got {self.warmup_samples}")
        if self.lagging_ttft_factor <= 0 or self.lagging_max_waiting < 0:
            raise ValueError("admission lagging thresholds must be positive")


@dataclass(frozen=True)
class Admission:
    action: str  # "admit" | "hold" | "reject"
    worker: str | None = None
    predicted_ttft_s: float | None = None
    reason: str = ""  # "" | "slo" | "queue-full" | "deadline" | "no-worker" | "lagging"
    retry_after_s: float = 0.0


def ttft_budget_s(snap: RouteSnapshot, cls: WorkloadClass) -> float:
    """What is left of the class's TTFT SLO for this request (shrinks while it is held)."""
    return cls.ttft_slo_s - (snap.request.now - snap.request.arrival_s)


def idle_budget_s(cls: WorkloadClass, classes: tuple[WorkloadClass, ...], cfg: AdmissionConfig) -> float:
    """Sheddable classes only take a worker predicted under this (it does not shrink: waiting helps)."""
    tight = [c.ttft_slo_s for c in classes if not c.sheddable]
    return cfg.idle_headroom * min(tight) if cls.sheddable and tight else float("inf")


def idle(w: WorkerView) -> bool:
    """Nothing in front of a new prompt there: nothing outstanding from this router, nothing queued by others."""
    return w.outstanding == 0 and w.external_prefill_tokens == 0


def admit(snap: RouteSnapshot, choice: RouteChoice, cls: WorkloadClass, classes: tuple[WorkloadClass, ...],
          cfg: AdmissionConfig, queue_room: int, held: bool = False) -> Admission:
    """Decide one request. `queue_room`: free places in its class queue; `held`: it is already queued."""
    r = snap.request
    workers = {w.url: w for w in snap.routable(r.exclude)}
    if not workers or choice.worker not in workers:
        return Admission("reject", reason="no-worker", retry_after_s=1.0)
    chosen = workers[choice.worker]
    if cfg.mode == "off":
        return Admission("admit", chosen.url, predicted_ttft_s(chosen, r))

    budget, idle_budget = ttft_budget_s(snap, cls), idle_budget_s(cls, classes, cfg)

    def fits(w: WorkerView) -> bool:
        """Its own TTFT SLO can be met here. Waiting does not change this: the queue drains as fast as
        the budget shrinks."""
        return cfg.mode == "lagging" or idle(w) or predicted_ttft_s(w, r) <= budget

    def clear(w: WorkerView) -> bool:
        """Conditions that waiting can clear: others' SLOs, slow start, TPOT, idle capacity, lagging signals."""
        if cfg.mode == "lagging":
            slow = w.observed_ttft_s is not None and w.observed_ttft_s > cfg.lagging_ttft_factor * cls.ttft_slo_s
            busy = w.reported_waiting is not None and w.reported_waiting > cfg.lagging_max_waiting
            return not (slow or busy)
        if idle(w):
            return True  # an idle worker: no queue to blame, and no traffic would freeze its estimates
        ttft_s = predicted_ttft_s(w, r)
        warm = w.rate_samples >= cfg.warmup_samples or w.prefill_tokens == 0
        tpot_ok = not cfg.check_tpot or predicted_tpot_s(w) <= cls.tpot_slo_s
        slack_ok = w.pending_slack_s is None or ttft_s <= w.pending_slack_s
        return warm and tpot_ok and slack_ok and ttft_s <= idle_budget

    if fits(chosen) and clear(chosen):
        return Admission("admit", chosen.url, predicted_ttft_s(chosen, r))
    feasible = [w for w in workers.values() if fits(w) and clear(w)]
    if feasible:
        best = min(feasible, key=lambda w: (predicted_ttft_s(w, r), w.url))
        return Admission("admit", best.url, predicted_ttft_s(best, r))

    gap_s = max(0.0, min(predicted_ttft_s(w, r) for w in workers.values()) - min(budget, idle_budget))
    if not any(fits(w) for w in workers.values()):  # no wait can help: say so now
        return Admission("reject", reason="deadline" if held else "slo", retry_after_s=gap_s)
    deadline = cls.hold_deadline_s(r.arrival_s, min(w.ttft_base_s for w in workers.values()))
    if held and r.now >= deadline:
        return Admission("reject", reason="deadline", retry_after_s=gap_s)
    if not held and queue_room <= 0:
        return Admission("reject", reason="queue-full", retry_after_s=gap_s)
    return Admission("hold", reason="lagging" if cfg.mode == "lagging" else "slo", retry_after_s=gap_s)
