"""The snapshot a routing or admission decision is a function of, and the estimates derived from it.

Everything here is frozen and clock-free: the router builds a `RouteSnapshot` from its live state (and
`now`); a simulator builds the same thing from a virtual clock. Units: tokens, seconds.

    uncached_w     = max(0, prompt_tokens - cached_prefix_tokens_w)
    predicted TTFT = ttft_calibration_w * (ttft_base_s_w * (prefill_requests_w + 1)
                                           + (prefill_tokens_w + external_w + uncached_w) / prefill_rate_tps_w)
    external_w     = max(0, worker-reported queued prompt tokens - whole prompts this router has pending there)
                     (last scrape; the gauge counts a waiting request's whole prompt, cached part included)

    behind TTFT    = the same with the held requests ahead of it (RouteRequest.ahead_*) added in front
                     (spread evenly over the workers): what it waits for if it is held

    passing_w      = share of w's time taken, while this request waits, by work that arrives later and is
                     served before it (`tokenmill serve`: cheap prompts, ranked first in the engine; 0 in the
                     router); the wait for the work queued in front stretches by 1 / (1 - passing_w):
    TTFT           = calibration_w * (prefill_time(queued in front) / (1 - passing_w) + prefill_time(own))

ttft_base_s_w (per-request overhead) and prefill_rate_tps_w (per uncached token) are the worker's learned
prefill fit (rates.PrefillFit): the requests whose prefill is pending there, and this one, each cost the
overhead once plus their uncached tokens at the rate.
    predicted TPOT = tpot_base_s_w + tpot_per_stream_s_w * (decode_streams_w + 1)
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router sees it when deciding one request."""

    url: str
    healthy: bool = True
    outstanding: int = 0  # requests the router sent that have not finished
    prefill_tokens: int = 0  # uncached prompt tokens sent whose first token has not come back
    prefill_requests: int = 0  # requests sent whose first token has not come back
    decode_streams: int = 0  # requests past their first token, not finished
    decode_tokens: int = 0  # output tokens still to come for requests sent here (sum of max_tokens - seen)
    cached_prefix_tokens: int = 0  # estimated prefix hit of *this* request here (prefix index)
    ttft_base_s: float = 0.02  # learned: prefill overhead per request, whatever its length (prior: config)
    prefill_rate_tps: float = 8192.0  # learned: uncached prompt tokens per busy second, beyond the overhead
    ttft_calibration: float = 1.0  # learned: observed / modelled TTFT (EWMA)
    decode_rate_tps: float = 512.0  # learned: output tokens per second while streams decode
    tpot_base_s: float = 0.01  # learned: TPOT with one stream
    tpot_per_stream_s: float = 0.0005  # learned: TPOT added per concurrent decode stream
    rate_samples: int = 1000  # busy windows the prefill fit learned from so far (0: still the prior)
    reported_running: int | None = None  # worker's own gauges (/metrics), when it has them
    reported_waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    pending_slack_s: float | None = None  # least TTFT budget left among requests whose prefill is pending here
    observed_ttft_s: float | None = None  # EWMA of observed TTFT: a lagging signal
    draining: bool = False  # removed at runtime: finishes what it has, gets nothing new
    external_prefill_tokens: int = 0  # prefill queued there by others: worker-reported minus this router's prompts
    ttft_error_hi: float = 1.5  # learned: ~p90 of observed / predicted TTFT here (how short predictions fall)
    ttft_error_lo: float = 0.5  # learned: ~p10 (how far predictions overshoot)
    ttft_slo_margin: float = 1.0  # learned: multiplier on ttft_error_hi steered to a target share of missed deadlines
    passing_share: float = 0.0  # share of its time later arrivals served before this request take (< 1)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


_VIEW_DEFAULTS = {f.name: f.default for f in fields(WorkerView) if f.name != "url"}


def new_view(url: str, **values) -> WorkerView:
    """WorkerView(url, **values), the same object, built without the frozen dataclass's __init__ (one
    object.__setattr__ per field: ~2x the time, and a view is built per looked-at worker per decision).
    Only WorkerView's own field names are accepted."""
    v = object.__new__(WorkerView)
    d = v.__dict__
    d.update(_VIEW_DEFAULTS)
    d["url"] = url
    d.update(values)
    if len(d) != len(_VIEW_DEFAULTS) + 1:
        raise TypeError(f"WorkerView has no field(s) {sorted(set(d) - set(_VIEW_DEFAULTS) - {'url'})}")
    return v


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    now: float  # seconds, the caller's clock (monotonic or virtual)
    arrival_s: float  # when the request reached the router (same clock)
    prompt_tokens: int  # exact for token-id prompts, estimated from characters for text
    workload_class: str = "interactive"
    seq: int = 0  # router-wide arrival counter (round-robin's only state)
    max_tokens: int = 16
    exclude: frozenset[str] = frozenset()  # workers already tried for this request (retries)
    ttft_budget_s: float = float("inf")  # what is left of its class's TTFT SLO (class SLO - time waited)
    ahead_requests: int = 0  # requests held (router class queues) that go before this one: its class's older ones,
    ahead_tokens: int = 0  # higher-priority classes'; and their least uncached prompt tokens over the workers


@dataclass(frozen=True)
class RouteSnapshot:
    workers: tuple[WorkerView, ...]
    request: RouteRequest

    def routable(self, exclude: frozenset[str] = frozenset()) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.routable and w.url not in exclude)


def uncached_tokens(w: WorkerView, r: RouteRequest) -> int:
    return max(0, r.prompt_tokens - w.cached_prefix_tokens)


def prefill_time_s(w: WorkerView, requests: float, tokens: float) -> float:
    """Modelled busy time of `requests` prefills of `tokens` uncached tokens in all on w."""
    return w.ttft_base_s * requests + tokens / w.prefill_rate_tps


def queued_prefill_tokens(w: WorkerView) -> int:
    """Prefill work in front of a new prompt on w: what this router sent and what others queued there."""
    return w.prefill_tokens + w.external_prefill_tokens


def _ttft_s(w: WorkerView, r: RouteRequest, requests_ahead: float, tokens_ahead: float) -> float:
    """Its wait for the work in front (stretched by what passes it meanwhile), then its own prefill."""
    wait_s = prefill_time_s(w, requests_ahead, tokens_ahead) / (1.0 - w.passing_share)
    return w.ttft_calibration * (wait_s + prefill_time_s(w, 1, uncached_tokens(w, r)))


def predicted_ttft_s(w: WorkerView, r: RouteRequest) -> float:
    return _ttft_s(w, r, w.prefill_requests, queued_prefill_tokens(w))


def behind_ttft_s(w: WorkerView, r: RouteRequest, share: float = 1.0) -> float:
    """predicted_ttft_s if this request waits for the held ones ahead of it (`share` of them go to w)."""
    return _ttft_s(w, r, w.prefill_requests + share * r.ahead_requests,
                   queued_prefill_tokens(w) + share * r.ahead_tokens)


def own_prefill_s(w: WorkerView, r: RouteRequest) -> float:
    """This request's own prefill on w (calibrated): the most it can delay a prompt queued before it there."""
    return w.ttft_calibration * prefill_time_s(w, 1, uncached_tokens(w, r))


def predicted_tpot_s(w: WorkerView) -> float:
    return w.tpot_base_s + w.tpot_per_stream_s * (w.decode_streams + 1)

