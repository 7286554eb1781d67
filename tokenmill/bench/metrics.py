"""Reduce request records to the metrics defined in docs/benchmarks/bench.md. Pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from tokenmill.bench.record import RequestRecord
from tokenmill.bench.slo import SLO


@dataclass(frozen=True)
class Distribution:
    """Of one latency, in milliseconds; percentiles interpolate linearly (numpy's default)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values_s: Iterable[float]) -> Distribution | None:
        ms = np.asarray(list(values_s), dtype=np.float64) * 1000.0
        if ms.size == 0:
            return None
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return Distribution(int(ms.size), float(ms.mean()), float(p50), float(p90), float(p99), float(ms.max()))


@dataclass(frozen=True)
class Summary:
    """Metrics over a set of requests (one class, or all) of a run lasting duration_s."""

    requests: int  # sent
    completed: int  # HTTP 200 and a full stream with output
    rejected: int  # HTTP 429 / 503
    failed: int  # anything else: other statuses, broken streams, timeouts, error events
    good: int  # completed within every bound of their class's SLO
    slo_attainment: float | None  # good / requests
    duration_s: float
    request_throughput: float  # completed / duration_s, req/s
    input_throughput: float  # planned prompt tokens of completed requests / duration_s, tok/s
    output_throughput: float  # output tokens of completed requests / duration_s, tok/s
    goodput: float  # good / duration_s, req/s
    goodput_output_throughput: float  # output tokens of good requests / duration_s, tok/s
    prompt_tokens: int  # planned, of completed requests
    output_tokens: int  # of completed requests
    usage_prompt_tokens: int | None  # as the server counted them, when it reported usage
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, summed, when reported
    prefix_cache_hit_rate: float | None  # cached_tokens / prompt tokens of the requests that reported it
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None  # over completed requests with >= 2 output tokens
    itl_ms: Distribution | None  # over every gap between output chunks of completed requests
    e2e_ms: Distribution | None
    send_lag_ms: Distribution | None  # sent - scheduled: the client's own delay (keep it near 0)

    def as_dict(self) -> dict:
        return asdict(self)


def is_good(rec: RequestRecord, slo: SLO) -> bool:
    """Completed, and TTFT, TPOT (when defined: >= 2 output tokens) and e2e within the SLO's bounds."""
    if not rec.ok:
        return False
    checks = ((rec.ttft_s, slo.ttft_ms), (rec.tpot_s, slo.tpot_ms), (rec.e2e_s, slo.e2e_ms))
    return all(bound is None or value is None or value * 1000.0 <= bound for value, bound in checks)


def summarize(records: list[RequestRecord], slos: dict[str, SLO], duration_s: float) -> Summary:
    done = [r for r in records if r.ok]
    good = [r for r in done if is_good(r, slos.get(r.class_name, SLO()))]
    reported = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported) if reported else None
    cached_of = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens
                    for r in reported)
    with_usage = [r.usage_prompt_tokens for r in done if r.usage_prompt_tokens is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        requests=len(records),
        completed=len(done),
        rejected=sum(r.status == "rejected" for r in records),
        failed=sum(r.status == "failed" for r in records),
        good=len(good),
        slo_attainment=len(good) / len(records) if records else None,
        duration_s=duration_s,
        request_throughput=len(done) * per_s,
        input_throughput=sum(r.prompt_tokens for r in done) * per_s,
        output_throughput=sum(r.output_tokens for r in done) * per_s,
        goodput=len(good) * per_s,
        goodput_output_throughput=sum(r.output_tokens for r in good) * per_s,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        usage_prompt_tokens=sum(with_usage) if with_usage else None,
        cached_tokens=cached,
        prefix_cache_hit_rate=cached / cached_of if reported and cached_of else None,
        ttft_ms=Distribution.of(r.ttft_s for r in done),
        tpot_ms=Distribution.of(r.tpot_s for r in done if r.tpot_s is not None),
        itl_ms=Distribution.of(gap for r in done for gap in r.itl_s),
        e2e_ms=Distribution.of(r.e2e_s for r in done),
        send_lag_ms=Distribution.of(r.sent_s - r.scheduled_s for r in records),
    )


def run_duration(records: list[RequestRecord]) -> float:
    """From the start of the run (t = 0, the first scheduled send) to the last response's end."""
    return max((r.end_s for r in records if r.end_s is not None), default=0.0)


def summarize_by_class(records: list[RequestRecord], slos: dict[str, SLO],
                       duration_s: float) -> dict[str, Summary]:
    classes = sorted({r.class_name for r in records})
    return {c: summarize([r for r in records if r.class_name == c], slos, duration_s) for c in classes}
