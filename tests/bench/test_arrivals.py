"""Arrival processes and the schedule: rates within tolerance, burstiness, limits, determinism."""

import itertools

import numpy as np
import pytest

from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.runner import LoadConfig, schedule
from tokenmill.bench.tokenizer import approximate_vocab
from tokenmill.bench.workloads import make_workload


def gaps(name, rate, n=20000, burstiness=1.0, seed=0):
    times = np.fromiter(itertools.islice(arrival_times(name, rate, burstiness, seed), n), float)
    return np.diff(times), times


def test_poisson_rate_and_variability():
    g, times = gaps("poisson", 50.0)
    assert times[0] == 0.0
    assert len(g) / times[-1] == pytest.approx(50.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness(burstiness):
    g, times = gaps("gamma", 20.0, burstiness=burstiness)
    assert len(g) / times[-1] == pytest.approx(20.0, rel=0.05)
    assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.15)


def test_constant_is_exact():
    g, _ = gaps("constant", 8.0, n=100)
    assert np.allclose(g, 0.125)


def test_same_seed_same_times():
    assert np.array_equal(gaps("poisson", 5.0, 100, seed=3)[1], gaps("poisson", 5.0, 100, seed=3)[1])
    assert not np.array_equal(gaps("poisson", 5.0, 100, seed=3)[1], gaps("poisson", 5.0, 100, seed=4)[1])


def test_request_rate_accounts_for_turns_per_session():
    w = make_workload("chat:turns_min=2,turns_max=2", approximate_vocab(), 0)
    plan = list(schedule(w, LoadConfig("rate", rate=10.0, arrival="constant", num_requests=40), 0))
    starts = [t for t, _ in plan]
    assert sum(len(s.turns) for _, s in plan) == 40 and len(plan) == 20
    assert np.allclose(np.diff(starts), 2 / 10.0)  # 2-turn sessions start at 5/s for 10 requests/s


def test_limits_cut_sessions_exactly():
    w = make_workload("chat", approximate_vocab(), 0)
    plan = list(schedule(w, LoadConfig("rate", rate=4.0, num_requests=17), 0))
    assert sum(len(s.turns) for _, s in plan) == 17
    timed = list(schedule(w, LoadConfig("rate", rate=4.0, duration_s=10.0), 0))
    assert timed and all(t < 10.0 for t, _ in timed)
    closed = list(schedule(w, LoadConfig("concurrency", concurrency=3, num_requests=9), 0))
    assert sum(len(s.turns) for _, s in closed) == 9 and {t for t, _ in closed} == {0.0}
