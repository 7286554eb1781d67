"""Prometheus metrics: tokenmill's own series plus the vLLM v1 names that routers and dashboards scrape.

Engine state (running/waiting, KV usage, token counters) is read from the latest `EngineStats` snapshot at
scrape time, so those counters equal the engine's own totals. Per-request latencies (TTFT, inter-token,
end-to-end) are measured by the async engine wrapper and observed here.

vLLM names and types follow vllm/v1/metrics/loggers.py (PrometheusStatLogger): labels `model_name` and
`engine`; counters are exposed with the `_total` suffix; histogram buckets are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.outputs import EngineStats
from tokenmill.hardware import capabilities

# vLLM v1 does the same: no `_created` series next to every counter and histogram.
prometheus_client.disable_created_metrics()

FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


def buckets_1_2_5(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """One CollectorRegistry per server. `snapshot()` returns the engine's latest stats plus the number of
    requests accepted by the server but not yet handed to the engine."""

    def __init__(self, model_name: str, max_model_len: int, snapshot: Callable[[], tuple[EngineStats | None, int]],
                 enable_prefix_caching: bool = True):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.labels = ("model_name", "engine")
        self.label_values = (model_name, "0")
        reg, names, vals = self.registry, list(self.labels), self.label_values

        def hist(name: str, doc: str, buckets: list) -> Any:
            return Histogram(name, doc, names, registry=reg, buckets=buckets).labels(*vals)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot_deprecated = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds.",
            ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        # the phases of a request, as vLLM splits them: waiting (arrival -> first scheduled), prefill
        # (first scheduled -> first token), decode (first token -> finish), running (first scheduled -> finish)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                          token_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = hist("vllm:request_params_max_tokens",
                                       "Histogram of the max_tokens request parameter.", token_buckets)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=reg)
        self.request_success = {r: success.labels(*vals, r) for r in FINISH_REASONS}
        rejected = Counter("tokenmill_requests_rejected", "Requests refused before reaching the engine.",
                           ["model_name", "reason"], registry=reg)
        self.rejected = {r: rejected.labels(model_name, r) for r in ("overloaded", "invalid", "unauthorized")}
        self.engine_errors = Counter("tokenmill_engine_errors", "engine.step() failures (in-flight requests failed).",
                                     ["model_name"], registry=reg).labels(model_name)
        self.registry.register(_EngineCollector(self, snapshot, enable_prefix_caching))

    # -- per-request observations (called on the event loop) ----------------------------------
    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_token_gap(self, itl_s: float) -> None:
        self.itl.observe(itl_s)
        self.tpot_deprecated.observe(itl_s)

    def observe_finished(self, reason: str, e2e_s: float, prompt_tokens: int, generation_tokens: int,
                         max_tokens: int, decode_s: float | None) -> None:
        self.request_success.get(reason, self.request_success["error"]).inc()
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_max_tokens.observe(max_tokens)
        if decode_s is not None and generation_tokens > 1:
            self.request_tpot.observe(decode_s / (generation_tokens - 1))

    def observe_phases(self, arrival: float, scheduled_at: float | None, first_token_at: float | None,
                       finished_at: float) -> None:
        """Per-phase times of a finished request; a phase it never reached is not observed."""
        if scheduled_at is None:  # aborted or refused while waiting
            return
        self.queue_time.observe(max(0.0, scheduled_at - arrival))
        self.inference_time.observe(finished_at - scheduled_at)
        if first_token_at is not None:
            self.prefill_time.observe(first_token_at - scheduled_at)
            self.decode_time.observe(finished_at - first_token_at)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, m: ServerMetrics, snapshot: Callable[[], tuple[EngineStats | None, int]],
                 enable_prefix_caching: bool):
        self.m = m
        self.snapshot = snapshot
        self.enable_prefix_caching = enable_prefix_caching

    def describe(self):  # no samples at registration time (the engine may not have stepped yet)
        return []

    @staticmethod
    def _spec(sp, counter, labels, vals):
        """Speculative decoding: vLLM's spec_decode counters, the chosen-k distribution, k switches."""
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", sp.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", sp.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", sp.num_accepted_tokens)
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.", labels=labels + ["position"])
        for j, n in enumerate(sp.accepted_per_pos):
            c.add_metric(vals + [str(j)], n)
        yield c
        c = CounterMetricFamily("tokenmill_spec_decode_chosen_k",
                                "Decoding sequence-steps by the speculation length chosen (0: off).",
                                labels=labels + ["proposer", "k"])
        for k, n in sorted(sp.chosen_k.items()):
            c.add_metric(vals + [sp.proposer, str(k)], n)
        yield c
        yield counter("tokenmill_spec_decode_k_switches",
                      "Times a decoding sequence's speculation length differed from its previous step's.",
                      sp.num_k_switches)

    def collect(self):
        s, pending = self.snapshot()
        if s is None:
            return
        labels, vals = list(self.m.labels), list(self.m.label_values)

        def gauge(name: str, doc: str, value: float, lab=labels, lv=vals):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float, lab=labels, lv=vals):
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric(lv, value)
            return c

        waiting = s.num_waiting + pending
        # vLLM-compatible names
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc.", s.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits_tokens)
        yield counter("vllm:gpu_prefix_cache_queries",
                      "Prefix cache queries (tokens). DEPRECATED: Use vllm:prefix_cache_queries.",
                      s.prefix_cache_queries_tokens)
        yield counter("vllm:gpu_prefix_cache_hits",
                      "Prefix cache hits (tokens). DEPRECATED: Use vllm:prefix_cache_hits.", s.prefix_cache_hits_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.num_preempted_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total)
        if s.spec is not None:
            yield from self._spec(s.spec, counter, labels, vals)
        info_labels = labels + ["block_size", "num_gpu_blocks", "enable_prefix_caching"]
        info_vals = vals + [str(s.block_size), str(s.kv_blocks_total), str(self.enable_prefix_caching)]
        yield gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1, info_labels, info_vals)
        # tokenmill's own series
        hw = capabilities()
        yield gauge("tokenmill_hardware_info", "What this machine computes natively (the precision --dtype auto picks).",
                    1, ["cpu_model", "cpu_flags", "native_bf16", "native_int8", "cuda", "cuda_native"],
                    [hw.cpu_model, " ".join(hw.cpu_flags), str(hw.native_bf16).lower(), str(hw.native_int8).lower(),
                     f"{hw.cuda_name} sm{hw.cuda_capability[0]}{hw.cuda_capability[1]}" if hw.cuda_name else "",
                     " ".join(hw.cuda_precisions())])
        mlab, mval = ["model_name"], [self.m.model_name]
        yield gauge("tokenmill_requests_running", "Requests in the engine's running batch.", s.num_running, mlab, mval)
        yield gauge("tokenmill_requests_waiting", "Requests in the engine's waiting queue.", s.num_waiting, mlab, mval)
        yield gauge("tokenmill_requests_pending", "Requests accepted by the server, not yet handed to the engine.",
                    pending, mlab, mval)
        yield gauge("tokenmill_batch_invariant", "1: every row of a step gets the same bits whatever the step's "
                    "composition (--batch-invariant; greedy output independent of batching).",
                    int(bool(getattr(s, "batch_invariant", False))), mlab, mval)
        yield gauge("tokenmill_kv_blocks_total", "KV cache blocks.", s.kv_blocks_total, mlab, mval)
        yield gauge("tokenmill_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used, mlab, mval)
        yield gauge("tokenmill_kv_usage_ratio", "Fraction of KV cache blocks in use (0-1).", s.kv_usage, mlab, mval)
        yield gauge("tokenmill_waiting_uncached_prompt_tokens",
                    "Prompt tokens in the waiting queue not served by the prefix cache (prefill work queued).",
                    s.waiting_uncached_prompt_tokens, mlab, mval)
        yield counter("tokenmill_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries_tokens, mlab, mval)
        yield counter("tokenmill_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits_tokens, mlab, mval)
        yield counter("tokenmill_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total, mlab, mval)
        yield counter("tokenmill_generation_tokens", "Tokens generated.", s.generation_tokens_total, mlab, mval)
        yield counter("tokenmill_preemptions", "Requests preempted (KV blocks reclaimed, recomputed later).",
                      s.num_preempted_total, mlab, mval)
        yield counter("tokenmill_engine_steps", "Engine steps.", s.num_steps, mlab, mval)
        if s.kv_tiers:  # KV tiers below the pool (engine/tiers): one series per tier
            from tokenmill.engine.tiers.manager import METRICS as TIER_METRICS

            for key, name, doc, is_counter in TIER_METRICS:
                fam = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=mlab + ["tier"])
                for tier, t in s.kv_tiers.items():
                    fam.add_metric(mval + [tier], t[key])
                yield fam
            from tokenmill.engine.tiers.manager import ENGINE_METRICS

            for key, name, doc, is_counter in ENGINE_METRICS:
                if key in s.kv_tiers_engine:
                    fam = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=mlab)
                    fam.add_metric(mval, s.kv_tiers_engine[key])
                    yield fam
