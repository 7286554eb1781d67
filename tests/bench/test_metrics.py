"""Metrics from hand-built records equal hand-computed values (definitions: docs/benchmarks/bench.md)."""

import pytest

from tokenmill.bench.metrics import is_good, run_duration, summarize, summarize_by_class
from tokenmill.bench.record import RequestRecord
from tokenmill.bench.slo import SLO


def rec(rid, cls, sent, chunks=(), end=None, out=None, status="ok", cached=None, usage_prompt=None, prompt=10):
    r = RequestRecord(rid, cls, int(rid), 0, prompt, 16, scheduled_s=sent, sent_s=sent, status=status)
    r.chunk_s = list(chunks)
    r.first_token_s = chunks[0] if chunks else None
    r.end_s = end
    r.output_tokens = len(chunks) if out is None else out
    r.cached_tokens, r.usage_prompt_tokens = cached, usage_prompt
    return r


@pytest.fixture
def records():
    return [
        rec("0", "interactive", 0.0, [0.1, 0.12, 0.15, 0.2], end=0.21, out=4, cached=2, usage_prompt=10),
        rec("1", "interactive", 1.0, [1.5, 1.6], end=1.6),
        rec("2", "batch", 2.0, end=2.01, status="rejected"),
        rec("3", "batch", 1.2, end=1.3, status="failed"),
        rec("4", "interactive", 0.5, [0.55], end=0.56, out=1, cached=0, usage_prompt=5, prompt=4),
    ]


SLOS = {"interactive": SLO(ttft_ms=200, tpot_ms=50), "batch": SLO()}


def test_per_request_latencies(records):
    a = records[0]
    assert a.ttft_s == pytest.approx(0.1)
    assert a.e2e_s == pytest.approx(0.21)
    assert a.tpot_s == pytest.approx((0.21 - 0.1) / 3)
    assert a.itl_s == pytest.approx([0.02, 0.03, 0.05])
    assert records[4].tpot_s is None  # one output token: TPOT undefined


def test_tpot_uses_reported_token_count_not_chunks():
    r = rec("0", "x", 0.0, [0.2, 1.0], end=1.0, out=9)  # 2 chunks carried 9 tokens
    assert r.tpot_s == pytest.approx(0.8 / 8)


def test_summary_equals_hand_computed(records):
    s = summarize(records, SLOS, run_duration(records))
    assert s.duration_s == pytest.approx(2.01)
    assert (s.requests, s.completed, s.rejected, s.failed, s.good) == (5, 3, 1, 1, 2)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.goodput == pytest.approx(2 / 2.01)
    assert s.goodput_output_throughput == pytest.approx((4 + 1) / 2.01)
    assert s.request_throughput == pytest.approx(3 / 2.01)
    assert s.output_throughput == pytest.approx(7 / 2.01)
    assert s.input_throughput == pytest.approx(24 / 2.01)
    assert s.ttft_ms.mean == pytest.approx((100 + 500 + 50) / 3)
    assert s.ttft_ms.p50 == pytest.approx(100)
    assert s.ttft_ms.p90 == pytest.approx(100 + 0.8 * 400)  # linear interpolation between 100 and 500
    assert s.ttft_ms.p99 == pytest.approx(100 + 0.98 * 400)
    assert s.ttft_ms.max == pytest.approx(500)
    assert s.tpot_ms.count == 2 and s.tpot_ms.mean == pytest.approx((110 / 3 + 100) / 2)
    assert s.itl_ms.count == 4 and s.itl_ms.mean == pytest.approx(50) and s.itl_ms.p50 == pytest.approx(40)
    assert s.e2e_ms.p50 == pytest.approx(210)
    assert s.cached_tokens == 2 and s.prefix_cache_hit_rate == pytest.approx(2 / 15)
    assert s.send_lag_ms.max == pytest.approx(0)


def test_per_class_shares_the_run_duration(records):
    by = summarize_by_class(records, SLOS, 2.01)
    assert set(by) == {"batch", "interactive"}
    assert (by["batch"].requests, by["batch"].rejected, by["batch"].failed, by["batch"].good) == (2, 1, 1, 0)
    assert by["batch"].slo_attainment == 0  # failed and rejected requests are never good, even without an SLO
    assert by["interactive"].goodput + by["batch"].goodput == pytest.approx(2 / 2.01)


def test_slo_bounds_are_inclusive_and_optional():
    r = rec("0", "x", 0.0, [0.25, 0.5, 0.75], end=0.75)  # ttft 250 ms, tpot 250 ms, e2e 750 ms
    assert is_good(r, SLO(ttft_ms=250, tpot_ms=250, e2e_ms=750))
    assert not is_good(r, SLO(ttft_ms=249))
    assert not is_good(r, SLO(tpot_ms=249))
    assert not is_good(r, SLO(e2e_ms=749))
    assert is_good(r, SLO())


def test_no_cache_reports_means_no_hit_rate():
    s = summarize([rec("0", "x", 0.0, [0.1], end=0.1)], {}, 1.0)
    assert s.cached_tokens is None and s.prefix_cache_hit_rate is None and s.tpot_ms is None


def test_bench_judges_goodput_by_the_serving_sides_default_classes():
    """One source of default SLOs: what `tokenmill serve --admission` / `tokenmill route` admit for is what the
    bench counts as good (a mismatch made the server refuse requests the bench would have counted good)."""
    from tokenmill.bench.slo import SLO, resolve_slos
    from tokenmill.router.classes import DEFAULT_CLASSES

    slos = resolve_slos([], {"agent"})
    for c in DEFAULT_CLASSES:
        want = SLO() if c.sheddable else SLO(ttft_ms=c.ttft_slo_s * 1000, tpot_ms=c.tpot_slo_s * 1000)
        assert slos[c.name] == want, c.name
    assert resolve_slos(["agent:tpot=250"], set())["agent"].tpot_ms == 250.0
