"""Admission control: a pure function (snapshot, routing choice, class) -> admit | hold | reject.

`leading` (default) predicts from work the router has sent but not yet seen served:

    budget_s  = ttft_slo_s - (now - arrival_s)                 what is left of the class's TTFT SLO
              (sheddable classes: min(budget_s, idle_headroom x tightest non-sheddable TTFT SLO))
    ok(w)     = predicted_ttft_s(w) <= min(budget_s, pending_slack_s(w))  and  predicted_tpot_s(w) <= tpot_slo_s

pending_slack_s(w) is the least TTFT budget left among the requests already sent to w whose first token has
not come: continuous batching serves a new prompt in the same steps as those, so admitting it must not
push them past their SLO either (admitted requests keep their SLO).

An idle worker (nothing outstanding) is always ok: no queue can be blamed, and refusing it traffic would
freeze a pessimistic estimate forever. Slow start: until a worker's prefill rate has `warmup_samples` samples, its rate is mostly the prior, so
ok(w) also needs no prefill pending there (one probe at a time, like TCP slow start).

The routing policy's choice is admitted when ok; else the feasible worker with the least predicted TTFT;
else the request is held in its class queue until its hold deadline
(arrival + min(max_wait_s, ttft_slo_s - fastest ttft_base_s)) when the queue has room and the predicted
wait fits before that deadline, and refused at once with Retry-After otherwise.

`lagging` is the comparison baseline: ok(w) = observed TTFT EWMA <= lagging_ttft_factor x ttft_slo_s and
reported waiting requests <= lagging_max_waiting (signals that move only after the overload happened).
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


def ttft_budget_s(snap: RouteSnapshot, cls: WorkloadClass, classes: tuple[WorkloadClass, ...],
                  cfg: AdmissionConfig) -> float:
    budget = cls.ttft_slo_s - (snap.request.now - snap.request.arrival_s)
    if cls.sheddable:
        tight = [c.ttft_slo_s for c in classes if not c.sheddable]
        if tight:
            budget = min(budget, cfg.idle_headroom * min(tight))
    return budget


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

    budget = ttft_budget_s(snap, cls, classes, cfg)

    def ok(w: WorkerView) -> bool:
        if cfg.mode == "lagging":
            slow = w.observed_ttft_s is not None and w.observed_ttft_s > cfg.lagging_ttft_factor * cls.ttft_slo_s
            busy = w.reported_waiting is not None and w.reported_waiting > cfg.lagging_max_waiting
            return not (slow or busy)
        tpot_ok = not cfg.check_tpot or predicted_tpot_s(w) <= cls.tpot_slo_s
        if w.outstanding == 0:
            return True
        warm = w.rate_samples >= cfg.warmup_samples or w.prefill_tokens == 0
        limit = budget if w.pending_slack_s is None else min(budget, w.pending_slack_s)
        return warm and tpot_ok and predicted_ttft_s(w, r) <= limit

    if ok(chosen):
        return Admission("admit", chosen.url, predicted_ttft_s(chosen, r))
    feasible = [w for w in workers.values() if ok(w)]
    if feasible:
        best = min(feasible, key=lambda w: (predicted_ttft_s(w, r), w.url))
        return Admission("admit", best.url, predicted_ttft_s(best, r))

    reason = "lagging" if cfg.mode == "lagging" else "slo"
    fastest = min(predicted_ttft_s(w, r) for w in workers.values())
    wait_s = max(0.0, fastest - budget)  # how long until the fastest worker drains enough
    deadline = cls.hold_deadline_s(r.arrival_s, min(w.ttft_base_s for w in workers.values()))
    if held and r.now >= deadline:
        return Admission("reject", reason="deadline", retry_after_s=wait_s)
    if not held and queue_room <= 0:
        return Admission("reject", reason="queue-full", retry_after_s=wait_s)
    if cfg.mode == "leading" and r.now + wait_s > deadline:  # it cannot be served in time: say so now
        return Admission("reject", reason="deadline" if held else reason, retry_after_s=wait_s)
    return Admission("hold", reason=reason, retry_after_s=wait_s)
