"""The router's own Prometheus metrics (its own CollectorRegistry; served at the router's /metrics).

Counters and histograms are updated as requests move; per-worker gauges are read from the live worker
pool at scrape time, so removed workers disappear from the output.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tokenmill.router.worker_state import WorkerPool

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
RELATIVE_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
P = "tokenmill_router_"


class Labelled:
    """A labelled Counter / Histogram whose children are looked up once per label values: prometheus_client's
    own `labels()` checks and locks on every call (~1.2 us; ~10 calls per routed request), a dict hit is ~0.1 us.
    Children are never removed from these metrics, so a cached child is always the live one. Anything else is
    the metric's own (`registry`, `collect`, ...)."""

    __slots__ = ("metric", "children")

    def __init__(self, metric):
        self.metric = metric
        self.children: dict[tuple, object] = {}

    def labels(self, *values):
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child

    def __getattr__(self, name):
        return getattr(self.metric, name)


class RouterMetrics:
    """`prefix`: tokenmill_router_ for the router; the server's admission uses the same series under
    tokenmill_admission_ (its one "worker" is its own engine)."""

    def __init__(self, pool: WorkerPool, queue_depths=lambda: {}, prefix: str = P):
        self.registry = CollectorRegistry()
        r, P = self.registry, prefix
        self.requests = Counter(P + "requests", "Requests by class and outcome "
                                "(ok, rejected, failed, client_error, cancelled)", ["class", "outcome"], registry=r)
        self.routed = Counter(P + "routed_requests", "Attempts sent to each worker", ["worker"], registry=r)
        self.decisions = Counter(P + "route_decisions", "Attempts by why the worker was chosen (the policy's "
                                 "reason, or admission when it overrode the policy) and whether that worker had "
                                 "the longest estimated cached prefix among the candidates (cache=longest|shorter)",
                                 ["reason", "cache"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens sent (estimated for text)", ["worker"],
                                     registry=r)
        self.prefix_hit_tokens = Counter(P + "estimated_prefix_hit_tokens", "Prompt tokens the prefix index "
                                         "expected cached on the worker", ["worker"], registry=r)
        self.reported_cached_tokens = Counter(P + "reported_cached_tokens", "Cached prompt tokens the worker "
                                              "reported (usage.prompt_tokens_details)", ["worker"], registry=r)
        self.predicted_ttft = Histogram(P + "predicted_ttft_seconds", "TTFT predicted at dispatch", ["worker"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.observed_ttft = Histogram(P + "observed_ttft_seconds", "TTFT observed at the router", ["worker"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_error = Histogram(P + "ttft_prediction_abs_error_seconds", "|observed - predicted| TTFT",
                                    ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_relative_error = Histogram(
            P + "ttft_prediction_relative_error", "(observed - predicted) / predicted TTFT, per first token "
            "(-0.5: observed half the prediction; +1: twice)", ["worker"], buckets=RELATIVE_ERROR_BUCKETS, registry=r)
        self.rejections = Counter(P + "rejections", "Requests refused, by class and reason", ["class", "reason"],
                                  registry=r)
        self.admitted = Counter(P + "admitted", "Requests admitted (sent to a worker), by class", ["class"],
                                registry=r)
        self.deadline_misses = Counter(P + "ttft_deadline_misses", "Admitted requests whose first token came after "
                                       "their class's TTFT SLO (from arrival)", ["class"], registry=r)
        self.retries = Counter(P + "retries", "Attempts that failed before the first token and were retried "
                               "elsewhere", ["worker", "reason"], registry=r)
        self.class_ttft = Histogram(P + "class_ttft_seconds", "TTFT per class (from router arrival)", ["class"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.class_tpot = Histogram(P + "class_tpot_seconds", "TPOT per class", ["class"], buckets=TPOT_BUCKETS,
                                    registry=r)
        self.slo_met = Counter(P + "class_slo_met", "Finished requests that met both SLOs of their class",
                               ["class"], registry=r)
        self.queue_wait = Histogram(P + "queue_wait_seconds", "Time held in the class queue before dispatch",
                                    ["class"], buckets=LATENCY_BUCKETS, registry=r)
        for name, value in list(vars(self).items()):
            if isinstance(value, (Counter, Histogram)) and value._labelnames:
                setattr(self, name, Labelled(value))
        r.register(_PoolCollector(pool, queue_depths, P))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    def __init__(self, pool: WorkerPool, queue_depths, prefix: str = P):
        self.pool, self.queue_depths, self.prefix = pool, queue_depths, prefix

    def collect(self):
        gauges = {
            "worker_healthy": ("1 if the worker passes health checks", lambda w: float(w.healthy)),
            "worker_outstanding_requests": ("Requests sent, not finished", lambda w: w.outstanding),
            "worker_outstanding_prefill_tokens": ("Uncached prompt tokens sent, first token not seen",
                                                  lambda w: max(0, w.prefill_tokens)),
            "worker_external_prefill_tokens": ("Prefill tokens queued at the worker beyond this router's (the "
                                               "worker's own gauge at the last scrape minus the router's count)",
                                               lambda w: w.external_prefill_tokens),
            "worker_decode_streams": ("Requests past their first token", lambda w: w.decode_streams),
            "worker_outstanding_decode_tokens": ("Output tokens still to come", lambda w: max(0, w.decode_tokens)),
            "worker_prefill_rate_tokens_per_second": ("Learned prefill rate per uncached prompt token",
                                                      lambda w: w.rates.prefill_rate_tps),
            "worker_prefill_overhead_seconds": ("Learned prefill overhead per request, whatever its length",
                                                lambda w: w.rates.ttft_base_s),
            "worker_ttft_calibration": ("Learned correction of the modelled TTFT: EWMA of observed / modelled",
                                        lambda w: w.ttft_calibration),
            "worker_ttft_error_ratio_p90": ("Admission's error margin, upper end: online ~p90 of observed / predicted "
                                            "TTFT (each floored at 0.1 s)", lambda w: w.ttft_error_hi.value),
            "worker_ttft_error_ratio_p10": ("Admission's error margin, lower end: online ~p10 of observed / predicted "
                                            "TTFT", lambda w: w.ttft_error_lo.value),
            "worker_ttft_slo_margin": ("Admission's multiplier on the p90 error ratio, steered to ~3% of admitted "
                                       "requests missing their TTFT deadline (1: none miss)",
                                       lambda w: w.slo_margin.value),
            "worker_decode_rate_tokens_per_second": ("Learned decode rate", lambda w: w.rates.decode_rate_tps),
            "worker_tpot_per_stream_seconds": ("Learned TPOT added per decode stream",
                                               lambda w: w.rates.tpot_per_stream_s),
        }
        workers, P = list(self.pool), self.prefix
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(P + name, doc, labels=["worker"])
            for w in workers:
                g.add_metric([w.url], float(get(w)))
            yield g
        q = GaugeMetricFamily(P + "queue_depth", "Requests held in each class queue", labels=["class"])
        for name, depth in self.queue_depths().items():
            q.add_metric([name], float(depth))
        yield q
