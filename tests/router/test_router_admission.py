"""Admission control on snapshots: leading indicators vs lagging ones."""

import pytest

from tokenmill.router.admission import AdmissionConfig, admit
from tokenmill.router.classes import DEFAULT_CLASSES, by_name
from tokenmill.router.policies import RouteChoice
from tokenmill.router.snapshot import RouteRequest, RouteSnapshot, WorkerView, predicted_ttft_s

CLASSES = by_name(DEFAULT_CLASSES)
INTERACTIVE, BATCH = CLASSES["interactive"], CLASSES["batch"]  # interactive: TTFT 1 s, max wait 0.5 s
LEADING = AdmissionConfig(hold_drain="fast")  # the band's semantics; the drains are compared below


def decide(workers, cls=INTERACTIVE, chosen=None, now=10.0, arrival=10.0, room=8, held=False, cfg=LEADING,
           prompt_tokens=1000, ahead=(0, 0)):
    s = RouteSnapshot(tuple(workers), RouteRequest("r", now, arrival, prompt_tokens, cls.name,
                                                   ahead_requests=ahead[0], ahead_tokens=ahead[1]))
    return admit(s, RouteChoice(chosen or workers[0].url, "test"), cls, DEFAULT_CLASSES, cfg, room, held)


def busy(url, queued_tokens, **kw):
    kw.setdefault("outstanding", 1 if queued_tokens else 0)
    kw.setdefault("ttft_error_hi", 1.0)  # an exact predictor unless a test says otherwise
    kw.setdefault("ttft_error_lo", 1.0)
    return WorkerView(url, prefill_tokens=queued_tokens, ttft_base_s=0.0, prefill_rate_tps=1000.0, **kw)


def test_predicted_ttft_is_queued_plus_own_uncached_work_over_rate():
    w = busy("a", 500, cached_prefix_tokens=800)
    r = RouteRequest("r", 0.0, 0.0, 1000)
    assert predicted_ttft_s(w, r) == pytest.approx((500 + 200) / 1000.0)


def test_an_idle_worker_is_always_ok_and_a_cold_one_is_preferred_less_but_never_waited_for():
    huge = decide([busy("a", 0)], prompt_tokens=50000)  # 50 s predicted, but nothing is queued there
    assert huge.action == "admit"
    cold = busy("a", 100, rate_samples=0)  # its rate is still the prior's...
    assert decide([cold], prompt_tokens=10).action == "admit"  # ...but it is predicted to meet the SLO: no hold
    warm = busy("b", 300, rate_samples=2)
    a = decide([cold, warm], chosen="a", prompt_tokens=10)  # slow start: a warm worker that meets is preferred
    assert (a.action, a.worker) == ("admit", "b")


def test_admits_the_routing_choice_when_it_meets_the_slo():
    a = decide([busy("a", 0), busy("b", 0)], chosen="b")
    assert (a.action, a.worker) == ("admit", "b")
    assert a.predicted_ttft_s == pytest.approx(1.0)


def test_reroutes_to_a_feasible_worker_when_the_choice_misses_the_slo():
    a = decide([busy("a", 5000), busy("b", 0, cached_prefix_tokens=500)], chosen="a")
    assert (a.action, a.worker) == ("admit", "b")


def test_pending_requests_slack_is_compared_with_the_new_prompts_own_prefill_not_its_whole_ttft():
    """The root of the holds on shared-prompt workloads: a worker serves prompts oldest first, so a new
    prompt delays a pending one by at most its own prefill. The old rule held any request whose *whole*
    predicted TTFT (the pending ones' work included) exceeded the least slack of those pending: here 0.7 s
    against 0.6 s, although the request meets its own SLO and costs the pending one at most 0.5 s."""
    w = busy("a", 200, cached_prefix_tokens=500, pending_slack_s=0.6)  # 0.7 s predicted, own prefill 0.5 s
    a = decide([w])
    assert (a.action, a.worker) == ("admit", "a")
    assert a.predicted_ttft_s == pytest.approx(0.7)


def test_never_holds_while_a_worker_meets_the_slo_but_prefers_one_that_endangers_nobody():
    tight = busy("a", 200, cached_prefix_tokens=500, pending_slack_s=0.3)  # own prefill 0.5 s > 0.3 s slack
    roomy = busy("b", 400, cached_prefix_tokens=500, pending_slack_s=0.9)  # 0.9 s predicted, still meets
    a = decide([tight, roomy], chosen="a")
    assert (a.action, a.worker) == ("admit", "b")
    a = decide([tight, busy("c", 600, cached_prefix_tokens=500)], chosen="a")  # c misses: 1.1 s
    assert (a.action, a.worker) == ("admit", "a")  # a meets the SLO: admitted rather than held


def test_admits_within_refuses_beyond_and_holds_inside_the_predictors_error_band():
    """The prediction is a band [p10, p90] of observed / predicted: admitted where even its upper end fits,
    refused at once only where even its lower end misses, held in between (bounded by the budget)."""
    band = dict(ttft_error_lo=0.7, ttft_error_hi=1.3)
    a = decide([busy("a", 600, **band)], prompt_tokens=100)  # 0.7 s predicted, 0.91 s at the upper end
    assert a.action == "admit"
    a = decide([busy("a", 800, **band)], prompt_tokens=100)  # 0.9 s: may miss by its usual error
    assert (a.action, a.reason) == ("hold", "slo")
    a = decide([busy("a", 950, **band)], prompt_tokens=100)  # 1.05 s, 0.735 s at the lower end: may still meet
    assert (a.action, a.reason) == ("hold", "slo")
    assert a.retry_after_s == pytest.approx(0.05)
    # 1.3 s, 0.91 s at the lower end: it could meet, but the admission test cannot pass before its hold
    # deadline (0.5 s away) even with the queue drained at 1 / 0.7 predicted s per s (0.59 s x 1.3 > 0.5 s)
    a = decide([busy("a", 1200, **band)], prompt_tokens=100)
    assert (a.action, a.reason) == ("reject", "slo")
    a = decide([busy("a", 1500, **band)], prompt_tokens=100)  # 1.6 s, 1.12 s at the lower end: misses for sure
    assert (a.action, a.reason) == ("reject", "slo")
    exact = busy("a", 1200)  # a predictor known to be exact: 1.3 s misses for sure
    assert (decide([exact], prompt_tokens=100).action, decide([exact], prompt_tokens=100).reason) == ("reject", "slo")
    # held: the budget shrinks (0.75 s left; 0.91 s at the lower end misses it): refused then
    assert decide([busy("a", 1200, **band)], prompt_tokens=100, now=10.25, arrival=10.0, held=True).reason == "deadline"


def test_the_slo_margin_widens_the_upper_end_only_and_never_causes_a_refusal():
    """Where admitted requests still miss their deadline the worker's margin k (>= 1) multiplies the band's
    upper end: a request that fits at hi x 1 but not at hi x k is held, not admitted; the refusal test (the
    lower end) is unchanged."""
    band = dict(ttft_error_lo=0.7, ttft_error_hi=1.3)
    assert decide([busy("a", 600, **band)], prompt_tokens=100).action == "admit"  # 0.7 s x 1.3 = 0.91 s fits
    widened = decide([busy("a", 600, ttft_slo_margin=1.2, **band)], prompt_tokens=100)  # x 1.2 = 1.09 s
    assert (widened.action, widened.reason) == ("hold", "slo")
    other = busy("b", 500, **band)  # 0.6 s x 1.3 = 0.78 s: another worker still meets it at once
    a = decide([busy("a", 600, ttft_slo_margin=1.2, **band), other], prompt_tokens=100, chosen="a")
    assert (a.action, a.worker) == ("admit", "b")
    # 1.05 s predicted, 0.735 s at the lower end: held with any margin, never refused because of it
    assert decide([busy("a", 950, ttft_slo_margin=3.0, **band)], prompt_tokens=100).action == "hold"


def test_a_request_that_would_wait_behind_held_requests_counts_their_work_and_is_refused_at_once():
    """At 2x the sustainable rate the class queue is full of held requests; a new one would be dispatched
    only after them. Counting only the dispatched work it looked feasible (held, then refused ~2 s later at
    its hold deadline); with the held work ahead it is refused now (the 429 comes in milliseconds)."""
    band = dict(ttft_error_lo=0.7, ttft_error_hi=1.3)
    alone = decide([busy("a", 500, **band)], prompt_tokens=100)  # 0.6 s: admitted
    assert alone.action == "admit"  # nothing held: the queue cannot matter
    assert decide([busy("a", 500, **band)], prompt_tokens=100, ahead=(3, 300)).action == "admit"  # meets now
    a = decide([busy("a", 850, **band)], prompt_tokens=100)  # 0.95 s: held (may meet before its deadline)
    assert (a.action, a.reason) == ("hold", "slo")
    a = decide([busy("a", 850, **band)], prompt_tokens=100, ahead=(2, 600))  # + 0.6 s held in front of it
    assert (a.action, a.reason) == ("reject", "slo")
    assert a.retry_after_s == pytest.approx(0.0, abs=1e-9)  # the excess over the budget of the worker alone
    a = decide([busy("a", 850, **band)], prompt_tokens=100, ahead=(1, 50))  # a little in front: still held
    assert a.action == "hold"
    # two workers: the held ones ahead spread over both (the optimistic split), so less in front on each
    assert decide([busy("a", 850, **band)], prompt_tokens=100, ahead=(2, 200)).action == "reject"  # 1.15 s
    pair = [busy("a", 850, **band), busy("b", 850, **band)]
    assert decide(pair, prompt_tokens=100, ahead=(2, 200)).action == "hold"  # 1.05 s on either
    assert decide(pair, prompt_tokens=100, ahead=(2, 1200)).action == "reject"


def test_work_that_passes_a_waiting_request_stretches_its_wait_not_its_own_prefill():
    """`tokenmill serve` ranks cheap prompts first: the ones arriving while a long prompt waits take a share
    p of the engine's time, so its wait for the work in front is 1 / (1 - p) times longer; its own prefill,
    once started, is not interrupted. p = 0 (the router) leaves the prediction as it was."""
    w = busy("a", 500)
    r = RouteRequest("r", 0.0, 0.0, 100)
    assert predicted_ttft_s(w, r) == pytest.approx(0.6)
    passed = WorkerView("a", prefill_tokens=500, ttft_base_s=0.0, prefill_rate_tps=1000.0, passing_share=0.5)
    assert predicted_ttft_s(passed, r) == pytest.approx(0.5 / 0.5 + 0.1)
    assert decide([busy("a", 500, passing_share=0.5)], prompt_tokens=100).action != "admit"  # 1.1 s > 1 s
    assert decide([busy("a", 200, passing_share=0.5)], prompt_tokens=100).action == "admit"  # 0.5 s


def test_hold_drain_decides_whether_holding_can_still_get_it_admitted_before_its_hold_deadline():
    """Held, a request is admitted once the admission test passes (upper end x margin within what is left of
    the budget); the budget shrinks by 1 s per s while the work in front drains. If that work drains at the
    band's slow end (1 / hi predicted s per s), the upper end shrinks exactly as fast as the budget: holding
    never helps a request that fails the test now, and it is refused at once (the default: 429s in
    milliseconds at 2x the sustainable rate, docs/benchmarks/engine_process.md)."""
    band = dict(ttft_error_lo=0.7, ttft_error_hi=1.3)  # interactive: 1 s budget, hold deadline 0.5 s away
    for tokens, drains in ((780, {"fast": "hold", "expected": "hold", "slow": "reject"}),  # 0.88 s predicted
                           (850, {"fast": "hold", "expected": "reject", "slow": "reject"})):  # 0.95 s
        for drain, action in drains.items():
            a = decide([busy("a", tokens, **band)], prompt_tokens=100, cfg=AdmissionConfig(hold_drain=drain))
            assert a.action == action, (tokens, drain, a)
    # the default never refuses what meets now, and holds what only the margin k keeps out (k never refuses)
    assert decide([busy("a", 600, **band)], prompt_tokens=100, cfg=AdmissionConfig()).action == "admit"
    held = decide([busy("a", 600, ttft_slo_margin=1.5, **band)], prompt_tokens=100, cfg=AdmissionConfig())
    assert held.action == "hold"
    with pytest.raises(ValueError, match="hold_drain"):
        AdmissionConfig(hold_drain="sometimes")


def test_hold_sheddable_refuses_at_once_what_would_be_held_except_sheddable_classes():
    """`tokenmill serve`'s default: a non-sheddable request that does not meet its SLO now is refused at
    arrival instead of held (a hold that ends in a refusal only made the 429 late); what meets is admitted
    as before, and batch still waits for idle capacity."""
    band = dict(ttft_error_lo=0.7, ttft_error_hi=1.3)
    serve = AdmissionConfig(hold="sheddable")
    w = busy("a", 600, ttft_slo_margin=1.5, **band)  # 0.7 s x 1.3 x 1.5 > 1 s: only the margin k keeps it out
    assert decide([w], prompt_tokens=100, cfg=AdmissionConfig()).action == "hold"
    a = decide([w], prompt_tokens=100, cfg=serve)
    assert (a.action, a.reason) == ("reject", "slo")
    assert decide([w], prompt_tokens=100, held=True, cfg=serve).reason == "deadline"
    assert decide([busy("a", 500, **band)], prompt_tokens=100, cfg=serve).action == "admit"  # meets: as before
    assert decide([busy("a", 900, **band)], cls=BATCH, prompt_tokens=100, cfg=serve).action == "hold"
    with pytest.raises(ValueError, match="hold"):
        AdmissionConfig(hold="never")


def test_full_queue_refuses_and_a_held_request_expires_at_its_deadline():
    blocked = busy("a", 1050, ttft_error_lo=0.5)  # 1.15 s predicted for a 1 s budget: within the error band
    assert decide([blocked], room=0, prompt_tokens=100).reason == "queue-full"
    assert decide([blocked], now=10.1, arrival=10.0, held=True, prompt_tokens=100).action == "hold"
    late = decide([blocked], now=10.6, arrival=10.0, held=True, prompt_tokens=100)  # past arrival + max wait
    assert (late.action, late.reason) == ("reject", "deadline")
    in_time = decide([busy("a", 0, outstanding=1, cached_prefix_tokens=900)], now=10.4, arrival=10.0, held=True)
    assert in_time.action == "admit"  # 0.1 s predicted + 0.4 s waited <= 1 s


def test_batch_only_fills_idle_capacity():
    idle = decide([busy("a", 0, cached_prefix_tokens=900)], cls=BATCH)
    assert idle.action == "admit"
    # 0.8 s predicted: fine for batch's own 60 s SLO, but over idle_headroom (0.5) x interactive's 1 s
    loaded = decide([busy("a", 700, cached_prefix_tokens=900)], cls=BATCH)
    assert loaded.action == "hold"


def test_tpot_slo_counts_decode_streams():
    crowded = WorkerView("a", outstanding=400, decode_streams=400, tpot_base_s=0.01, tpot_per_stream_s=0.001)
    assert decide([crowded]).action != "admit"
    assert decide([crowded], cfg=AdmissionConfig(check_tpot=False)).action == "admit"


def test_lagging_admission_misses_a_backlog_it_has_not_observed_yet():
    backlog = busy("a", 50000, observed_ttft_s=0.2, reported_waiting=2)  # 50 s of queued prefill, fast so far
    lagging = AdmissionConfig(mode="lagging")
    assert decide([backlog], cfg=lagging).action == "admit"
    assert decide([backlog]).action == "reject"
    slow = busy("a", 0, observed_ttft_s=1.5, outstanding=1)
    assert decide([slow], cfg=lagging).reason == "lagging"
    assert decide([busy("a", 0, reported_waiting=50)], cfg=lagging).action != "admit"


def test_off_admits_and_no_worker_refuses():
    assert decide([busy("a", 10**6)], cfg=AdmissionConfig(mode="off")).action == "admit"
    a = decide([WorkerView("a", healthy=False)])
    assert (a.action, a.reason) == ("reject", "no-worker")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="admission mode"):
        AdmissionConfig(mode="eventually")
    with pytest.raises(ValueError, match="idle_headroom"):
        AdmissionConfig(idle_headroom=0)


def test_router_admits_a_request_that_meets_its_slo_even_while_others_of_its_class_are_held():
    """Held requests wait because no worker is predicted to serve them in time; a later request that a
    worker can serve in time (a shorter prompt here) is not queued behind them (it was, FIFO)."""
    import asyncio

    async def run():
        t = [100.0]
        router, key = one_busy_worker_router(t)
        big = router.new_request(key(200), INTERACTIVE, 4)  # 1.1 s predicted: within the margin, held
        big_task = asyncio.ensure_future(router.acquire(big))
        await asyncio.sleep(0)
        assert router.queues.depths()["interactive"] == 1
        small = await asyncio.wait_for(router.acquire(router.new_request(key(50), INTERACTIVE, 4)), 1.0)
        assert small.worker == "http://a"  # 0.95 s predicted: admitted at once
        assert router.queues.depths()["interactive"] == 1 and not big_task.done()
        big_task.cancel()
        await router.close()

    asyncio.run(run())


def test_router_refuses_at_once_a_request_queued_behind_held_ones_it_cannot_outlast():
    """Router-level: the held requests of its class ahead of a new one are in its snapshot. Three held
    requests of 0.2 s each sit in front of a fourth: behind them it needs 1.7 s (predicted) for a 1 s SLO,
    more than draining at the band's fastest rate can recover before its 0.5 s hold deadline, so the 429
    is immediate (the old snapshot saw 1.1 s, held it, and refused it 0.5 s later). Once the held ones are
    gone (their clients left) the same request is held again."""
    import asyncio

    from tokenmill.router.router import Refused

    async def run():
        t = [100.0]
        router, key = one_busy_worker_router(t)
        held = [asyncio.ensure_future(router.acquire(router.new_request(key(200), INTERACTIVE, 4))) for _ in range(3)]
        await asyncio.sleep(0)
        assert router.queues.depths()["interactive"] == 3 and not any(h.done() for h in held)
        with pytest.raises(Refused) as e:
            await asyncio.wait_for(router.acquire(router.new_request(key(200), INTERACTIVE, 4)), 0.1)
        assert (e.value.status, e.value.reason) == (429, "slo")
        assert t[0] == 100.0  # refused with no time passing: not at a hold deadline
        for h in held:
            h.cancel()
        await asyncio.sleep(0)
        again = asyncio.ensure_future(router.acquire(router.new_request(key(200), INTERACTIVE, 4)))
        await asyncio.sleep(0)
        assert router.queues.depths()["interactive"] == 1 and not again.done()
        again.cancel()
        await router.close()

    asyncio.run(run())


def one_busy_worker_router(t):
    """A router over one worker with 0.9 s of prefill queued (1000 tok/s) whose TTFT predictions are never
    short and may overshoot by 2x; `t` is its clock (a one-element list). Returns (router, prompt key maker)."""
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.prefix_index import PrefixIndexConfig
    from tokenmill.router.prompt import prompt_key
    from tokenmill.router.rates import RatePriors
    from tokenmill.router.router import Router
    from tokenmill.router.worker_state import WorkerSpec

    cfg = RouterConfig(workers=(WorkerSpec("http://a"),), rate_priors=RatePriors(ttft_base_s=0.0, prefill_rate_tps=1000.0),
                       admission=LEADING)
    router = Router(cfg, clock=lambda: t[0])
    w = router.pool.get("http://a")
    w.healthy, w.rates.prefill.samples = True, 5
    w.ttft_error_hi.value, w.ttft_error_lo.value = 1.0, 0.5  # never short; may overshoot by 2x
    w.start("earlier", 900, 0.9, now=t[0])  # 0.9 s of prefill queued there
    return router, lambda n: prompt_key({"prompt": list(range(n))}, False, PrefixIndexConfig())
