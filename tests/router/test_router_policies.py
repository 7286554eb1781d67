"""Routing policies on hand-built snapshots: pure functions, no server."""

import dataclasses

import pytest

from tokenmill.router.policies import POLICIES, PolicyParams, get_policy, prefix_load_cost_s, register_policy
from tokenmill.router.snapshot import RouteRequest, RouteSnapshot, WorkerView, predicted_ttft_s

from router_fakes import simulate_worker

P = PolicyParams()


def snap(*workers, prompt_tokens=1000, seq=0, exclude=()):
    return RouteSnapshot(tuple(workers), RouteRequest("r", 10.0, 10.0, prompt_tokens, seq=seq,
                                                      exclude=frozenset(exclude)))


def test_registry_has_the_four_policies_and_names_them_on_error():
    assert {"round-robin", "least-load", "prefix", "prefix-load"} <= set(POLICIES)
    with pytest.raises(ValueError, match="prefix-load"):
        get_policy("fastest")
    with pytest.raises(ValueError, match="twice"):
        register_policy("prefix")(lambda s, p: None)


def test_round_robin_cycles_over_routable_workers_only():
    a, b, c = WorkerView("a"), WorkerView("b", healthy=False), WorkerView("c")
    picks = [get_policy("round-robin")(snap(a, b, c, seq=i), P).worker for i in range(4)]
    assert picks == ["a", "c", "a", "c"]
    assert get_policy("round-robin")(snap(a, c, seq=0, exclude={"a"}), P).worker == "c"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_routable_worker_gives_none(name):
    s = snap(WorkerView("a", healthy=False), WorkerView("b", draining=True), WorkerView("c"), exclude={"c"})
    assert get_policy(name)(s, P).worker is None


def test_least_load_prefers_fewest_outstanding_then_least_queued_work():
    a = WorkerView("a", outstanding=3)
    b = WorkerView("b", outstanding=1, prefill_tokens=5000)
    c = WorkerView("c", outstanding=1, prefill_tokens=100)
    assert get_policy("least-load")(snap(a, b, c), P).worker == "c"


def test_prefix_follows_the_cache_even_onto_a_hot_spot():
    hot = WorkerView("hot", outstanding=30, prefill_tokens=20000, cached_prefix_tokens=900)
    idle = WorkerView("idle")
    choice = get_policy("prefix")(snap(hot, idle), P)
    assert (choice.worker, choice.reason) == ("hot", "prefix-hit")
    assert get_policy("prefix")(snap(WorkerView("x", outstanding=2), idle), P).worker == "idle"  # no hit: least-load


def test_prefix_load_takes_the_cache_hit_while_it_is_cheaper():
    cached = WorkerView("cached", outstanding=1, prefill_tokens=200, cached_prefix_tokens=900)
    cold = WorkerView("cold")
    # cost: cached 200 + 100 uncached tokens; cold 1000 uncached tokens
    assert get_policy("prefix-load")(snap(cached, cold), P).worker == "cached"


def test_prefix_load_leaves_the_cache_when_its_queue_costs_more_than_the_hit_saves():
    # a miss costs (1 + κ) x 1000 = 2000 tokens on the cold worker; a hit 200 plus the queue on the cached one
    cold = WorkerView("cold", outstanding=1, prefill_tokens=0)
    stay = WorkerView("cached", outstanding=2, prefill_tokens=1700, cached_prefix_tokens=900)
    assert get_policy("prefix-load")(snap(stay, cold), P).worker == "cached"
    leave = WorkerView("cached", outstanding=2, prefill_tokens=1900, cached_prefix_tokens=900)
    choice = get_policy("prefix-load")(snap(leave, cold), P)
    assert choice.worker == "cold"
    costs = dict(choice.costs)
    assert costs["cold"] < costs["cached"]
    greedy = dataclasses.replace(P, miss_weight=0.0)  # per-request TTFT only: leaves much earlier
    assert get_policy("prefix-load")(snap(stay, cold), greedy).worker == "cold"


def test_prefix_load_guard_stops_piling_on_a_cached_worker():
    # many decode-light requests on the cached worker keep its cost low, but the guard caps the pile
    cached = WorkerView("cached", outstanding=P.guard_abs + 2, cached_prefix_tokens=999)
    cold = WorkerView("cold", outstanding=1)
    assert prefix_load_cost_s(cached, snap(cached, cold), P) < prefix_load_cost_s(cold, snap(cached, cold), P)
    assert get_policy("prefix-load")(snap(cached, cold), P).worker == "cold"
    loose = dataclasses.replace(P, guard_abs=100)
    assert get_policy("prefix-load")(snap(cached, cold), loose).worker == "cached"


def test_prefix_load_weighs_work_by_each_workers_learned_speed():
    slow = WorkerView("slow", prefill_rate_tps=1000.0)
    fast = WorkerView("fast", prefill_rate_tps=8000.0, prefill_tokens=2000)
    # slow: 2 x 1000 tokens / 1000 tps = 2 s; fast: (2000 + 2 x 1000) tokens / 8000 tps = 0.5 s
    assert get_policy("prefix-load")(snap(slow, fast), P).worker == "fast"


def test_policies_are_pure_and_snapshots_frozen():
    s = snap(WorkerView("a", cached_prefix_tokens=500), WorkerView("b", outstanding=1), seq=7)
    for name, policy in POLICIES.items():
        assert policy(s, P) == policy(s, P), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.workers[0].outstanding = 3



def test_prefix_load_counts_running_streams_not_their_remaining_output_as_queue():
    streaming = WorkerView("streaming", outstanding=3, decode_streams=3, decode_tokens=3000, cached_prefix_tokens=900)
    cold = WorkerView("cold", outstanding=3, decode_streams=3, decode_tokens=30)
    # joining a batch of decodes does not wait for their 3000 tokens: the hit still wins
    assert get_policy("prefix-load")(snap(streaming, cold), P).worker == "streaming"
    busy = WorkerView("busy", outstanding=3, decode_streams=60, cached_prefix_tokens=900)  # 60 x 32 + 2 x 100 > 2 x 1000
    assert get_policy("prefix-load")(snap(busy, WorkerView("idle", outstanding=3)), P).worker == "idle"


def loaded(view, outstanding, streams, pending=(), cached=0):
    """`view` with `streams` decoding and `pending` prefills (uncached tokens each) outstanding."""
    return dataclasses.replace(view, outstanding=outstanding, decode_streams=streams, prefill_requests=len(pending),
                               prefill_tokens=sum(pending), cached_prefix_tokens=cached)


def learned_pair():
    """Two workers of the same true speed (0.12 s per request + tokens / 4000 tps) whose fits learned from
    different traffic: `hot` served mostly 64-token cache hits, `cold` mostly 832-token misses."""
    hot = simulate_worker(hit_share=0.9, arrivals_per_s=4.0, seed=3).view()
    cold = simulate_worker(hit_share=0.1, arrivals_per_s=2.0, seed=4).view()
    return dataclasses.replace(hot, url="hot"), dataclasses.replace(cold, url="cold")


def test_prefix_load_keeps_a_hot_prompt_on_the_worker_that_caches_it_when_loads_are_near_even():
    hot, cold = learned_pair()
    assert hot.prefill_rate_tps == pytest.approx(cold.prefill_rate_tps, rel=0.2)
    # an 832-token request whose 768-token system prompt is cached on `hot` (the docs/router.md example)
    for h, c in [((12, 12), (8, 8)), ((5, 3, [64, 64]), (4, 3, [832])), ((3, 3), (1, 1))]:
        s = snap(loaded(hot, *h, cached=768), loaded(cold, *c), prompt_tokens=832)
        assert get_policy("prefix-load")(s, P).worker == "hot", (h, c)
    # with one busy-seconds rate per worker (tokens / busy s: 427 tok/s on the hit-heavy worker, 2377 on the
    # miss-only one, no per-request term) the same 12-vs-8-streams case went to `cold`
    old_hot = dataclasses.replace(hot, ttft_base_s=0.02, prefill_rate_tps=427.0)
    old_cold = dataclasses.replace(cold, ttft_base_s=0.02, prefill_rate_tps=2377.0)
    s = snap(loaded(old_hot, 12, 12, cached=768), loaded(old_cold, 8, 8), prompt_tokens=832)
    assert get_policy("prefix-load")(s, dataclasses.replace(P, guard_abs=100)).worker == "cold"


def test_prefix_load_still_moves_a_hot_prompt_off_an_overloaded_cached_worker():
    hot, cold = learned_pair()
    guarded = snap(loaded(hot, 14, 14, cached=768), loaded(cold, 8, 8), prompt_tokens=832)  # 14 - 8 > 4, 14 > 1.5 x 8
    assert get_policy("prefix-load")(guarded, P).worker == "cold"
    assert get_policy("prefix")(guarded, P).worker == "hot"
    # a queue of pending prefills costs its per-request overhead each: 7 x 0.12 s > the miss's 2 x 832 tokens
    queued = snap(loaded(hot, 7, 0, [64] * 7, cached=768), loaded(cold, 4, 4), prompt_tokens=832)
    choice = get_policy("prefix-load")(queued, P)
    assert choice.worker == "cold" and dict(choice.costs)["cold"] < dict(choice.costs)["hot"]


def test_predicted_ttft_and_queue_count_the_overhead_once_per_pending_request():
    from tokenmill.router.policies import queue_s
    from tokenmill.router.snapshot import predicted_ttft_s

    w = WorkerView("w", ttft_base_s=0.1, prefill_rate_tps=1000.0, prefill_requests=3, prefill_tokens=600,
                   decode_streams=2, cached_prefix_tokens=800)
    r = RouteRequest("r", 0.0, 0.0, 1000)
    assert predicted_ttft_s(w, r) == pytest.approx(4 * 0.1 + (600 + 200) / 1000)
    assert queue_s(w, P) == pytest.approx(3 * 0.1 + (600 + 2 * P.decode_stream_tokens) / 1000)
    assert prefix_load_cost_s(w, snap(w, prompt_tokens=1000), P) == pytest.approx(
        0.1 + (1 + P.miss_weight) * 200 / 1000 + queue_s(w, P))


def test_prefix_load_guard_spreads_only_to_a_worker_that_can_meet_the_ttft_budget():
    hot, cold = learned_pair()
    hot, cold = dataclasses.replace(hot, ttft_calibration=1.0), dataclasses.replace(cold, ttft_calibration=1.0)
    # the guard trips (14 - 8 > 4, 14 > 1.5 x 8); `cold` has 8 pending misses in front of this one
    views = loaded(hot, 14, 6, [64] * 8, cached=768), loaded(cold, 8, 0, [832] * 8)
    cold_ttft = predicted_ttft_s(views[1], RouteRequest("r", 10.0, 10.0, 832))
    room = dataclasses.replace(snap(*views, prompt_tokens=832).request, ttft_budget_s=cold_ttft * 1.01)
    choice = get_policy("prefix-load")(RouteSnapshot(views, room), P)
    assert (choice.worker, choice.reason) == ("cold", "load-guard")
    # the same pool when even `cold` cannot serve it in time: a miss there only adds work, the cache keeps it
    no_room = dataclasses.replace(room, ttft_budget_s=cold_ttft * 0.99)
    choice = get_policy("prefix-load")(RouteSnapshot(views, no_room), P)
    assert (choice.worker, choice.reason) == ("hot", "saturated")
    # without a budget (a snapshot that carries none) the guard applies as before
    assert get_policy("prefix-load")(snap(*views, prompt_tokens=832), P).worker == "cold"


def test_prefix_only_follows_the_cache_whatever_the_load_and_spreads_ties_uniformly():
    hot = WorkerView("hot", cached_prefix_tokens=512, outstanding=50, prefill_tokens=100000)
    cold = [WorkerView(f"c{i}") for i in range(3)]
    assert all(get_policy("prefix-only")(snap(*cold, hot, seq=i), P).worker == "hot" for i in range(50))
    picks = [get_policy("prefix-only")(snap(*cold, seq=i), P).worker for i in range(3000)]
    counts = [picks.count(w.url) for w in cold]
    assert all(900 < c < 1100 for c in counts), counts  # ~1000 each: no load term, no fixed order
    assert picks == [get_policy("prefix-only")(snap(*cold, seq=i), P).worker for i in range(3000)]  # reproducible
