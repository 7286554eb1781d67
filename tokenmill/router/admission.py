"""Admission control: a pure function (snapshot, routing choice, class) -> admit | hold | reject.

`leading` (default) predicts from work the router has sent but not yet seen served:

    budget_s  = ttft_slo_s - (now - arrival_s)            what is left of the class's TTFT SLO
    meets(w)  = predicted_ttft_s(w) x hi_w x k_w <= budget_s   predicted to meet its SLO there now, even if
                and predicted_tpot_s(w) <= tpot_slo_s     the prediction falls short as much as it usually does
                and (sheddable only) predicted_ttft_s(w) <= idle_headroom x tightest non-sheddable TTFT SLO
    polite(w) = own_prefill_s(w) <= pending_slack_s(w)    a preference, never a reason to wait:
                and slow start (below)                    admitting it here endangers nobody already sent

A request is never held while some worker meets its SLO: the policy's choice is admitted when it meets
and is polite, else the polite worker that meets with the least predicted TTFT, else (none polite) the
policy's choice if it meets, else the meeting worker with the least predicted TTFT.

The predictor's current error margin on w is the band [lo_w, hi_w] of observed / predicted TTFT (online
~p10 and ~p90 over its recent first tokens, worker_state.py): a request is admitted where even the
prediction times hi_w x k_w fits its budget, and refused at once (429, Retry-After = the predicted excess)
only when on every worker even the prediction times lo_w misses it — the best candidate's prediction
exceeds the budget by more than the predictor's error margin — counting, for a request that would be
held, the held requests that go before it (its class's older ones and the higher-priority classes', their
work spread evenly over the workers: `behind_ttft_s`), since it is dispatched only after them:

    refuse    when for every w: behind_ttft_s(w) x lo_w > budget_s
              or, with wait_s = hold deadline - now, even that work drained at the `hold_drain` rate
              (`fast`: 1 / lo_w predicted seconds per second) until the hold deadline leaves
              max(0, behind_ttft_s(w) - wait_s x drain_w) x hi_w > budget_s - wait_s   (or > the idle budget)
              i.e. the admission test (k_w = 1) would still fail at the hold deadline: holding only delays the 429

Without the held work ahead (the earlier rule) a request arriving behind a long queue saw only the
dispatched work, was held, and was refused at its hold deadline: at 2x the sustainable rate the 429s came
after ~1.9 s (docs/benchmarks/engine_process.md).

k_w >= 1 widens the band's upper end where admitted requests still miss their deadline: it is steered from
outcomes, per first token, to ~3% of the requests admitted there missing their TTFT deadline
(worker_state.MissRateMargin), and sits at 1 while none miss.

A newcomer that meets its SLO on the dispatched work is admitted even while requests that go before it are
held (they are not predicted to meet theirs now, it is). Making it meet behind them too (a held request's
"turn" kept) was tried: on the simulator, 2 workers at 2x and 4x the sustainable rate, it cost up to 5% of
goodput and did not remove the late refusals (docs/benchmarks/engine_process.md).

Otherwise (its TTFT is within the predictor's error of the budget, or only the TPOT or idle-headroom test
fails) it is held — with `hold="sheddable"` (`tokenmill serve`'s default) only a sheddable class; any other
is refused at once — in its class queue (if there is room) and re-decided as work completes, until its hold
deadline arrival + min(max_wait_s, ttft_slo_s - ttft_base_s) — never past what is left of its TTFT budget
— then refused.

pending_slack_s(w) is the least TTFT budget left among the requests already sent to w whose first token
has not come. The worker's scheduler serves prompts in arrival order (chunked prefill fills each step's
budget oldest first), so a new prompt delays those at most by its own prefill, `own_prefill_s` — not by
its whole predicted TTFT, which includes theirs: an earlier rule compared that TTFT with their slack and
held requests the worker could serve, which then reached the worker with less slack of their own and held
the next ones (a cascade that turned a short burst into refusals and added latency).

An idle worker (nothing outstanding from this router, no prefill queued there by others as the worker
reports it) always meets and is polite: no queue can be blamed, and refusing it traffic would freeze a
pessimistic estimate forever. Slow start: until a worker's prefill rate has `warmup_samples` samples it
is mostly the prior, so politeness also needs no prefill pending there (one probe at a time, like TCP slow
start) — a preference for warm workers, not a hold.

`lagging` is the comparison baseline: every worker fits, and clear(w) = observed TTFT EWMA <=
lagging_ttft_factor x ttft_slo_s and reported waiting requests <= lagging_max_waiting (signals that move
only after the overload happened); when no worker is clear the request is held.
`off` admits the routing choice whenever a worker is routable.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.router.classes import WorkloadClass
from tokenmill.router.policies import RouteChoice
from tokenmill.router.snapshot import (RouteSnapshot, WorkerView, behind_ttft_s, own_prefill_s, predicted_tpot_s,
                                      predicted_ttft_s)

MODES = ("leading", "lagging", "off")
HOLD_DRAINS = ("fast", "expected", "slow")
HOLDS = ("all", "sheddable")


@dataclass(frozen=True)
class AdmissionConfig:
    mode: str = "leading"
    idle_headroom: float = 0.5  # sheddable classes only use workers predicted under this share of the tightest SLO
    check_tpot: bool = True
    warmup_samples: int = 2  # slow start: one pending prefill per worker until its rate has this many samples
    lagging_ttft_factor: float = 1.0
    lagging_max_waiting: int = 8
    # how fast the work in front of a held request is assumed to drain when judging whether holding it can
    # still get it admitted before its hold deadline: "fast" 1 / lo_w predicted s per s (the band's fast end),
    # "expected" 1 (the calibrated prediction), "slow" 1 / hi_w
    hold_drain: str = "slow"
    # which classes leading admission may hold: "all", or only the "sheddable" ones (the others are refused at
    # once where they would be held: `tokenmill serve`'s default, where the engine's deadline-ordered queue
    # already is the hold and a hold that ends in a refusal only makes the 429 late)
    hold: str = "all"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown admission mode {self.mode!r}; choose from {', '.join(MODES)}")
        if not 0 < self.idle_headroom <= 1:
            raise ValueError(f"admission idle_headroom must be in (0, 1], got {self.idle_headroom}")
        if self.warmup_samples < 0:
            raise ValueError(f"admission warmup_samples must be >= 0, got {self.warmup_samples}")
        if self.hold not in HOLDS:
            raise ValueError(f"unknown admission hold {self.hold!r}; choose from {', '.join(HOLDS)}")
        if self.hold_drain not in HOLD_DRAINS:
            raise ValueError(f"unknown admission hold_drain {self.hold_drain!r}; choose from {', '.join(HOLD_DRAINS)}")
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
    if cfg.mode == "lagging":
        return _lagging(snap, chosen, workers, cls, cfg, queue_room, held)

    budget, idle_budget = ttft_budget_s(snap, cls), idle_budget_s(cls, classes, cfg)
    pred = {u: predicted_ttft_s(w, r) for u, w in workers.items()}

    def meets(w: WorkerView) -> bool:
        """Predicted to meet its SLO there now (TTFT within what is left of the budget, TPOT)."""
        if idle(w):
            return True  # an idle worker: no queue to blame, and no traffic would freeze its estimates
        tpot_ok = not cfg.check_tpot or predicted_tpot_s(w) <= cls.tpot_slo_s
        return tpot_ok and pred[w.url] * w.ttft_error_hi * w.ttft_slo_margin <= min(budget, idle_budget)

    def polite(w: WorkerView) -> bool:
        """Admitting it here endangers no request already sent there, and the worker's rate is learned."""
        if idle(w):
            return True
        warm = w.rate_samples >= cfg.warmup_samples or w.prefill_tokens == 0
        return warm and (w.pending_slack_s is None or own_prefill_s(w, r) <= w.pending_slack_s)

    meeting = [w for w in workers.values() if meets(w)]
    if meeting:
        nice = [w for w in meeting if polite(w)]
        if chosen in nice:
            best = chosen
        elif nice:
            best = min(nice, key=lambda w: (pred[w.url], w.url))
        else:
            best = chosen if chosen in meeting else min(meeting, key=lambda w: (pred[w.url], w.url))
        return Admission("admit", best.url, pred[best.url])

    gap_s = max(0.0, min(pred.values()) - min(budget, idle_budget))
    wait_s = max(0.0, cls.hold_deadline_s(r.arrival_s, min(w.ttft_base_s for w in workers.values())) - r.now)
    share = 1.0 / len(workers)  # the held requests ahead spread evenly over the workers (the optimistic split)

    def hopeless(w: WorkerView) -> bool:
        """Held, it would be refused anyway: even the optimistic end of its TTFT behind the held requests
        ahead misses the budget now, or their work drained by its hold deadline at the band's fastest rate
        (1 / lo predicted seconds per second) still leaves more than the admission test then allows."""
        behind = behind_ttft_s(w, r, share)
        if behind * w.ttft_error_lo > budget:
            return True
        drain = {"fast": 1.0 / w.ttft_error_lo, "expected": 1.0, "slow": 1.0 / w.ttft_error_hi}[cfg.hold_drain]
        left_s = max(0.0, behind - wait_s * drain)
        return left_s * w.ttft_error_hi > min(budget - wait_s, idle_budget)  # k_w never causes a refusal

    if all(hopeless(w) for w in workers.values()) or (cfg.hold == "sheddable" and not cls.sheddable):
        return Admission("reject", reason="deadline" if held else "slo", retry_after_s=gap_s)
    return _hold(snap, cls, workers, gap_s, queue_room, held, "slo")


def _hold(snap: RouteSnapshot, cls: WorkloadClass, workers: dict[str, WorkerView], gap_s: float, queue_room: int,
          held: bool, reason: str) -> Admission:
    """Hold in the class queue until the hold deadline; refuse past it, or when the queue is full."""
    r = snap.request
    deadline = cls.hold_deadline_s(r.arrival_s, min(w.ttft_base_s for w in workers.values()))
    if held and r.now >= deadline:
        return Admission("reject", reason="deadline", retry_after_s=gap_s)
    if not held and queue_room <= 0:
        return Admission("reject", reason="queue-full", retry_after_s=gap_s)
    return Admission("hold", reason=reason, retry_after_s=gap_s)


def _lagging(snap: RouteSnapshot, chosen: WorkerView, workers: dict[str, WorkerView], cls: WorkloadClass,
             cfg: AdmissionConfig, queue_room: int, held: bool) -> Admission:
    """The baseline: only signals that move after the overload happened."""
    r = snap.request

    def clear(w: WorkerView) -> bool:
        slow = w.observed_ttft_s is not None and w.observed_ttft_s > cfg.lagging_ttft_factor * cls.ttft_slo_s
        busy = w.reported_waiting is not None and w.reported_waiting > cfg.lagging_max_waiting
        return not (slow or busy)

    if clear(chosen):
        return Admission("admit", chosen.url, predicted_ttft_s(chosen, r))
    feasible = [w for w in workers.values() if clear(w)]
    if feasible:
        best = min(feasible, key=lambda w: (predicted_ttft_s(w, r), w.url))
        return Admission("admit", best.url, predicted_ttft_s(best, r))
    gap_s = max(0.0, min(predicted_ttft_s(w, r) for w in workers.values()) - ttft_budget_s(snap, cls))
    return _hold(snap, cls, workers, gap_s, queue_room, held, "lagging")
