"""Routing policies: pure functions (RouteSnapshot, PolicyParams) -> RouteChoice. No I/O, no clock.

    round-robin   the (seq mod n)-th routable worker
    least-load    fewest outstanding requests; ties: least outstanding work (queue_w, below)
    prefix        longest estimated cached prefix; ties (and no hit anywhere): least-load
    prefix-only   longest estimated cached prefix, no load term at all; ties (and no hit anywhere) uniformly at
                  random (a hash of the request's sequence number: pure, reproducible) -- llm-d's prefix-cache
                  scorer alone with its max-score picker, the baseline of its prefix+load comparison
    prefix-load   (default) least estimated cost among the workers the load guard allows:
                      cost_w  = c0_w + (1 + κ)·uncached_w / rate_w + queue_w
                      queue_w = c0_w·prefill_requests_w + work_w / rate_w      (outstanding work, seconds)
                      work_w  = prefill_tokens_w + external_w + λ·decode_streams_w   (outstanding work, tokens;
                                                                                     external_w: snapshot.py)
                  with the worker's learned prefill fit: c0_w (ttft_base_s) per request whatever its
                  length, rate_w (prefill_rate_tps) per uncached token. I.e. this request's own prefill
                  after the prefix hit plus the worker's outstanding work, in seconds. The per-request
                  overhead is not divided by a rate: a short (cache-hit) request costs c0 + its few tokens,
                  so a worker serving mostly hits does not look slow per token. A running stream counts λ tokens: it does
                  not queue in front of a new prompt (continuous batching), it only slows the shared steps;
                  its remaining output (decode_tokens) is deliberately not counted as a queue. κ (miss_weight) counts a cache miss's prefill a
                  second time: it is not only this request's wait but work added in front of every request
                  that queues behind it there (and a stall for the decodes sharing its steps), so a greedy
                  per-request choice does not trade cache hits for a slightly shorter queue and raise the
                  total work under load. Load guard: a worker is skipped when
                      outstanding_w - min_outstanding > guard_abs  and  outstanding_w > guard_rel · min_outstanding
                  so a cache hit can never pile more than ~guard_abs requests onto one worker -- while the
                  worker the guard leaves can still serve the request within its TTFT budget
                  (RouteRequest.ttft_budget_s, predicted TTFT). When none of the allowed workers can, the pool is
                  saturated and the cheapest worker keeps the request: a spread there only adds a cache miss.

Workers in `request.exclude` (already tried for this request) and unhealthy or draining workers are never
chosen. `worker` is None when no worker is routable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tokenmill.router.snapshot import (RouteSnapshot, WorkerView, predicted_ttft_s, prefill_time_s,
                                      queued_prefill_tokens, uncached_tokens)


@dataclass(frozen=True)
class PolicyParams:
    miss_weight: float = 1.0  # κ: extra weight on uncached prompt tokens (their cost to other requests)
    decode_stream_tokens: float = 32.0  # λ: one running decode stream weighs like this many queued prompt tokens
    guard_abs: int = 4  # load guard: outstanding requests over the least-loaded worker ...
    guard_rel: float = 1.5  # ... and this many times its outstanding requests

    def __post_init__(self):
        if self.miss_weight < 0 or self.decode_stream_tokens < 0:
            raise ValueError("policy miss_weight and decode_stream_tokens must be >= 0")
        if self.guard_abs < 0 or self.guard_rel < 1:
            raise ValueError("policy load guard needs guard_abs >= 0 and guard_rel >= 1")


@dataclass(frozen=True)
class RouteChoice:
    worker: str | None
    reason: str  # why: "round-robin" | "least-load" | "prefix-hit" | "least-cost" | "load-guard" | "saturated" | "no-worker"
    costs: tuple[tuple[str, float], ...] = ()  # per candidate worker, for debugging and metrics


Policy = Callable[[RouteSnapshot, PolicyParams], RouteChoice]
POLICIES: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    def register(fn: Policy) -> Policy:
        if name in POLICIES:
            raise ValueError(f"routing policy {name!r} is registered twice")
        POLICIES[name] = fn
        return fn

    return register


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


def work_tokens(w: WorkerView, p: PolicyParams) -> float:
    """Outstanding work on w in prompt-token units: queued prefill plus λ per running stream."""
    return queued_prefill_tokens(w) + p.decode_stream_tokens * w.decode_streams


def queue_s(w: WorkerView, p: PolicyParams) -> float:
    """Outstanding work on w in seconds: pending prefills (overhead + tokens) plus λ tokens per stream."""
    return prefill_time_s(w, w.prefill_requests, work_tokens(w, p))


def _load_key(w: WorkerView, p: PolicyParams) -> tuple:
    return (w.outstanding, queue_s(w, p), w.url)


NO_WORKER = RouteChoice(None, "no-worker")


@register_policy("round-robin")
def round_robin(snap: RouteSnapshot, p: PolicyParams) -> RouteChoice:
    workers = snap.routable(snap.request.exclude)
    if not workers:
        return NO_WORKER
    return RouteChoice(workers[snap.request.seq % len(workers)].url, "round-robin")


@register_policy("least-load")
def least_load(snap: RouteSnapshot, p: PolicyParams) -> RouteChoice:
    workers = snap.routable(snap.request.exclude)
    if not workers:
        return NO_WORKER
    best = min(workers, key=lambda w: _load_key(w, p))
    return RouteChoice(best.url, "least-load", tuple((w.url, float(w.outstanding)) for w in workers))


@register_policy("prefix")
def prefix(snap: RouteSnapshot, p: PolicyParams) -> RouteChoice:
    workers = snap.routable(snap.request.exclude)
    if not workers:
        return NO_WORKER
    best = min(workers, key=lambda w: (-w.cached_prefix_tokens,) + _load_key(w, p))
    reason = "prefix-hit" if best.cached_prefix_tokens > 0 else "least-load"
    return RouteChoice(best.url, reason, tuple((w.url, float(-w.cached_prefix_tokens)) for w in workers))


def _spread(seq: int, n: int) -> int:
    """An index in [0, n), uniform over request sequence numbers (splitmix64 of seq): a random tie-break
    that is a pure function of the snapshot."""
    m = 0xFFFFFFFFFFFFFFFF
    x = (seq + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return (x ^ (x >> 31)) % n


@register_policy("prefix-only")
def prefix_only(snap: RouteSnapshot, p: PolicyParams) -> RouteChoice:
    workers = snap.routable(snap.request.exclude)
    if not workers:
        return NO_WORKER
    longest = max(w.cached_prefix_tokens for w in workers)
    ties = [w for w in workers if w.cached_prefix_tokens == longest]
    best = ties[_spread(snap.request.seq, len(ties))]
    return RouteChoice(best.url, "prefix-hit" if longest > 0 else "random",
                       tuple((w.url, float(-w.cached_prefix_tokens)) for w in workers))


def prefix_load_cost_s(w: WorkerView, snap: RouteSnapshot, p: PolicyParams) -> float:
    own_s = prefill_time_s(w, 1, (1 + p.miss_weight) * uncached_tokens(w, snap.request))
    return own_s + queue_s(w, p)


def load_guard(workers: tuple[WorkerView, ...], p: PolicyParams) -> tuple[WorkerView, ...]:
    least = min(w.outstanding for w in workers)
    return tuple(w for w in workers if not (w.outstanding - least > p.guard_abs and w.outstanding > p.guard_rel * least))


@register_policy("prefix-load")
def prefix_load(snap: RouteSnapshot, p: PolicyParams) -> RouteChoice:
    workers = snap.routable(snap.request.exclude)
    if not workers:
        return NO_WORKER
    costs = tuple((w.url, prefix_load_cost_s(w, snap, p)) for w in workers)
    cost_of = dict(costs)

    def key(w: WorkerView) -> tuple:
        return (cost_of[w.url],) + _load_key(w, p)

    best = min(workers, key=key)
    allowed = load_guard(workers, p)
    if best in allowed:
        return RouteChoice(best.url, "least-cost", costs)
    # The guard vetoes the cheapest worker. Spreading buys latency only where there is room for it: the
    # cheapest allowed worker takes the request if it can serve it within what is left of its TTFT SLO.
    # When none can (every worker saturated), moving it would add a cache miss -- more work on an
    # overloaded pool -- for no request's gain, so the cheapest worker keeps it.
    spread = min(allowed, key=key)
    if predicted_ttft_s(spread, snap.request) <= snap.request.ttft_budget_s:
        return RouteChoice(spread.url, "load-guard", costs)
    return RouteChoice(best.url, "saturated", costs)
