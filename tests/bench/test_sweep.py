"""--sweep: bracketing and bisection find the highest rate meeting the attainment target."""

import asyncio
import json

import pytest

from tokenmill.bench.sweep import SweepConfig, SweepPoint, find_max_rate

from .fake_server import Script
from .helpers import run_bench


def sweep(knee: float, **cfg):
    """A server whose attainment is 1.0 up to `knee` req/s and 0.5 above."""
    tried = []

    async def trial(rate):
        tried.append(rate)
        return SweepPoint(rate, 1.0 if rate <= knee else 0.5, rate)

    return asyncio.run(find_max_rate(trial, SweepConfig(**cfg))), tried


def test_brackets_up_then_bisects():
    out, tried = sweep(7.3, start_rate=1.0, rel_tol=0.05, max_trials=20)
    assert tried[:4] == [1, 2, 4, 8]  # doubling until a failure brackets the knee
    assert tried[4:6] == [6, 7]
    assert out.bracketed and 7.3 * 0.95 <= out.max_rate <= 7.3
    assert [p.rate for p in out.points] == tried


def test_brackets_down_when_the_start_fails():
    out, tried = sweep(0.3, start_rate=2.0, rel_tol=0.1, max_trials=20)
    assert tried[:4] == [2.0, 1.0, 0.5, 0.25]
    assert out.bracketed and 0.3 * 0.9 <= out.max_rate <= 0.3


def test_nothing_passes_or_nothing_fails():
    out, tried = sweep(0.0, start_rate=1.0, min_rate=0.1)
    assert out.max_rate == 0.0 and tried == [1.0, 0.5, 0.25, 0.125]
    out, tried = sweep(1e9, start_rate=1.0, max_trials=5)
    assert not out.bracketed and out.max_rate == 16.0 and len(tried) == 5


@pytest.mark.slow
def test_sweep_end_to_end(fake_server, tmp_path):
    # TTFT grows with the number of requests in flight: attainment falls as the rate rises
    server = fake_server(Script(ttft_s=0.01, ttft_per_inflight_s=0.03, tpot_s=0.002))
    rc, result, _ = run_bench(server.url, tmp_path, "--workload", "batch:prompt=8,output=3,spread=0",
                              "--sweep", "--rate", "8", "--arrival", "constant", "--num-requests", "16",
                              "--sweep-trials", "5", "--slo", "batch:ttft=60", plots=True)
    assert rc == 0
    sw = result["sweep"]
    points = sorted(sw["points"], key=lambda p: p["rate"])
    passing = [p["rate"] for p in points if p["attainment"] >= 0.9]
    assert sw["max_rate"] == (max(passing) if passing else 0.0)
    assert all(p["attainment"] == p["summary"]["slo_attainment"] for p in points)
    assert sw["bracketed"] and any(p["attainment"] < 0.9 for p in points)
    assert result["summary"] is None or result["load"]["rate"] == sw["max_rate"]
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert len(list((tmp_path / "runs").glob("*/requests.jsonl"))) == len(points)
    assert "Sweep: max rate" in (tmp_path / "summary.md").read_text()
    json.dumps(result)
