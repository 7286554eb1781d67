"""Scheduler with a fake runner: token budget, chunking, decode-first, priority order, preemption."""

import pytest

from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_block_pool import check_invariants

BS = 4


class FakeEngine:
    """Scheduler + KV manager; the 'runner' appends token 7 for every sequence that asks for logits."""

    def __init__(self, num_blocks=64, budget=16, max_seqs=8, caching=True):
        self.kv = KVCacheManager(num_blocks, BS, caching)
        self.s = Scheduler(SchedulerConfig(budget, max_seqs, 100), self.kv)
        self.log = []

    def add(self, rid, n_prompt, max_tokens=3, priority=0, base=0):
        r = Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), priority=priority)
        self.s.add(r)
        return r

    def step(self, **kw):
        out = self.s.schedule(**kw)
        self.log.append(out)
        for seq in out.seqs:
            if seq.num_logits:
                r = self.s.requests[seq.request_id]
                r.append_output(7)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    self.s.finish(r, RequestStatus.FINISHED_LENGTH)
        check_invariants(self.kv)
        return out


def test_budget_and_chunking():
    e = FakeEngine(budget=16)
    e.add("long", 40)
    e.add("short", 5, base=1000)
    out = e.step()
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("long", 16)]
    assert out.num_batched_tokens == 16 and out.seqs[0].num_logits == 0
    out = e.step()
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("long", 16)]
    out = e.step()  # last chunk of long (8) + short's whole prompt (5)
    assert [(s.request_id, len(s.token_ids), s.num_logits) for s in out.seqs] == [("long", 8, 1), ("short", 5, 1)]
    assert out.seqs[0].start_pos == 32


def test_decodes_not_starved_by_long_prefill():
    e = FakeEngine(budget=8)
    e.add("a", 3, max_tokens=10)
    e.step()  # a prefilled, first token sampled
    e.add("big", 100)
    for _ in range(5):
        out = e.step()
        ids = [s.request_id for s in out.seqs]
        assert ids[0] == "a" and len(out.seqs[0].token_ids) == 1  # a decodes every step
        assert out.num_batched_tokens <= 8
        assert ("big", 7) in [(s.request_id, len(s.token_ids)) for s in out.seqs]


def test_priority_order_and_fcfs_within_priority():
    e = FakeEngine(budget=4, max_seqs=1)
    e.add("low", 2, max_tokens=1, priority=5)
    e.add("hi1", 2, max_tokens=1, priority=0)
    e.add("hi2", 2, max_tokens=1, priority=0)
    e.add("mid", 2, max_tokens=1, priority=1)
    order = []
    while e.s.has_unfinished():
        order += [s.request_id for s in e.step().seqs]
    assert order == ["hi1", "hi2", "mid", "low"]


def test_preemption_by_recompute_lowest_priority_first():
    e = FakeEngine(num_blocks=6, budget=64, max_seqs=8)
    hi = e.add("hi", 8, max_tokens=12, priority=0, base=0)
    lo = e.add("lo", 8, max_tokens=12, priority=1, base=100)
    e.step()  # both prefilled: 2 blocks + 2 blocks, plus decode room
    preempted = []
    for _ in range(30):
        if not e.s.has_unfinished():
            break
        out = e.step()
        preempted += out.preempted
    assert preempted and set(preempted) == {"lo"}  # never the higher priority request
    assert hi.status is RequestStatus.FINISHED_LENGTH and lo.status is RequestStatus.FINISHED_LENGTH
    assert lo.num_preemptions >= 1 and len(lo.output_token_ids) == 12
    assert e.kv.pool.num_free == 6  # everything freed at the end
    # the end of each request's waiting phase is reported once, at its first schedule (not on re-admission)
    firsts = [rid for out in e.log for rid in out.first_scheduled]
    assert firsts == ["hi", "lo"] and e.log[0].first_scheduled == ["hi", "lo"]


def test_preempted_request_resumes_with_all_tokens_and_cache():
    e = FakeEngine(num_blocks=5, budget=64)
    e.add("hi", 8, max_tokens=10, priority=0)
    lo = e.add("lo", 6, max_tokens=10, priority=1, base=50)
    seen_lo_restart = False
    while e.s.has_unfinished():
        out = e.step()
        for s in out.seqs:
            if s.request_id == "lo" and s.start_pos < lo.num_tokens - 1 and lo.num_preemptions:
                seen_lo_restart = True
                assert s.token_ids == lo.all_token_ids[s.start_pos:s.start_pos + len(s.token_ids)]
    assert seen_lo_restart


def test_abort_frees_blocks_at_once():
    e = FakeEngine()
    r = e.add("a", 10, max_tokens=50)
    e.step()
    assert e.kv.pool.num_free < 64
    e.s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert e.kv.pool.num_free == 64 and not e.s.has_unfinished()
    w = e.add("w", 10)
    e.s.finish(w, RequestStatus.FINISHED_ABORTED)  # abort while waiting
    assert e.s.num_waiting == 0
    check_invariants(e.kv)


def test_head_of_line_waits_for_blocks():
    e = FakeEngine(num_blocks=4, budget=64)
    e.add("a", 12, max_tokens=3)  # 3 blocks, 4th on decode
    e.step()
    e.add("b", 12, max_tokens=1)
    out = e.step()
    assert [s.request_id for s in out.seqs] == ["a"]  # b waits, nothing over-allocated
    while e.s.has_unfinished():
        e.step()


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_hits_counted(caching):
    e = FakeEngine(budget=64, caching=caching)
    e.add("a", 12, max_tokens=1)
    e.step()
    e.add("b", 14, max_tokens=1)
    e.step()
    # b = a's 12 tokens + 2 more: a's 3 full blocks hit (b's own first 13 tokens cover 3 full blocks)
    assert e.kv.prefix_hits_tokens == (12 if caching else 0)
    assert e.kv.prefix_queries_tokens == 12 + 14


# -- TTFT deadlines and per-step token budgets (issue 17) ------------------------------------------
def add_dl(e, rid, n_prompt, deadline, priority=0, base=0, tpot=None, max_tokens=3):
    r = Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), priority=priority,
                ttft_deadline=deadline, tpot_slo_s=tpot)
    e.s.add(r)
    return r


def run_order(e, now=None):
    """Schedule until done, finishing whatever ran at once (max_seqs=1: one request at a time); the order."""
    order = []
    while e.s.has_unfinished():
        out = e.s.schedule(now=now)
        for s in out.seqs:
            if s.request_id not in order:
                order.append(s.request_id)
            e.s.finish(e.s.requests[s.request_id], RequestStatus.FINISHED_LENGTH)
    return order


def test_earliest_deadline_first_within_a_priority_level():
    e = FakeEngine(budget=8, max_seqs=1)
    add_dl(e, "late-deadline", 4, deadline=10.0, base=0)
    add_dl(e, "early-deadline", 4, deadline=5.0, base=100)
    add_dl(e, "high-priority", 4, deadline=50.0, priority=-1, base=200)
    assert run_order(e, now=0.0) == ["high-priority", "early-deadline", "late-deadline"]


def test_no_deadlines_is_fcfs():
    e = FakeEngine(budget=4, max_seqs=1)
    for i in range(3):
        e.add(f"r{i}", 4, base=100 * i)
    assert run_order(e, now=123.0) == ["r0", "r1", "r2"]


def test_a_request_past_its_deadline_yields_to_one_that_can_still_make_it():
    e = FakeEngine(budget=8, max_seqs=1)
    add_dl(e, "missed", 4, deadline=1.0, base=0)  # earliest deadline, but already past at now=2
    add_dl(e, "on-time", 4, deadline=3.0, base=100)
    add_dl(e, "lower-priority", 4, deadline=2.5, priority=1, base=200)
    out = e.s.schedule(now=2.0)  # "missed" demoted; "on-time" admitted
    assert [s.request_id for s in out.seqs] == ["on-time"]
    assert e.s.num_late == 1 and e.s.num_waiting == len(e.s.waiting_requests()) == 2
    e.s.finish(e.s.requests["on-time"], RequestStatus.FINISHED_LENGTH)
    order = ["on-time"] + run_order(e, now=2.0)
    # the missed one goes after every on-time request of its priority level, not after lower priorities
    assert order == ["on-time", "missed", "lower-priority"]
    assert e.s.num_late == 0 and e.s.num_waiting == 0


def test_a_preempted_request_that_already_streamed_is_never_late():
    r = Request("x", [1, 2, 3], SamplingParams(), ttft_deadline=1.0)
    assert r.late(2.0) and not r.late(0.5) and not r.late(None)
    r.append_output(5)
    assert not r.late(2.0)


def test_late_requests_can_be_aborted_and_counted():
    e = FakeEngine(budget=8, max_seqs=1)
    add_dl(e, "a", 4, deadline=0.5, base=0)
    add_dl(e, "b", 4, deadline=0.6, base=100)
    e.s.schedule(now=1.0)  # a admitted (late, but nothing on time is waiting); b demoted
    assert e.s.num_late == 1
    e.s.finish(e.s.requests["b"], RequestStatus.FINISHED_ABORTED)
    assert e.s.num_late == 0 and e.s.num_waiting == 0


def test_token_budget_caps_the_step_but_never_starves_decodes():
    e = FakeEngine(budget=64, max_seqs=8)
    for i in range(3):
        e.add(f"d{i}", 4, max_tokens=20, base=100 * i)
    e.step()  # all three prefilled
    e.add("big", 40, base=1000)
    out = e.step(token_budget=10)
    toks = {s.request_id: len(s.token_ids) for s in out.seqs}
    assert toks == {"d0": 1, "d1": 1, "d2": 1, "big": 7} and out.num_batched_tokens == 10
    out = e.step(token_budget=1)  # below the decodes: each decode still gets its token, +1 prefill
    toks = {s.request_id: len(s.token_ids) for s in out.seqs}
    assert toks == {"d0": 1, "d1": 1, "d2": 1, "big": 1}


def test_tightest_tpot_slo_counts_only_decoding_requests():
    e = FakeEngine(budget=64, max_seqs=8)
    add_dl(e, "slow", 4, deadline=float("inf"), tpot=0.5, max_tokens=10)
    e.step()
    assert e.s.tightest_tpot_slo_s() == 0.5 and e.s.num_decoding() == 1
    add_dl(e, "prefilling", 200, deadline=float("inf"), tpot=0.05, base=500)
    e.step()  # "prefilling" gets a chunk only (budget 64 of 200): not decoding yet
    assert e.s.tightest_tpot_slo_s() == 0.5


def test_rank_orders_before_deadlines_within_a_priority_level():
    e = FakeEngine(budget=8, max_seqs=1)
    e.s.add(Request("expensive-early", list(range(4)), SamplingParams(max_tokens=3), ttft_deadline=1.0, rank=1))
    e.s.add(Request("cheap-late", list(range(100, 104)), SamplingParams(max_tokens=3), ttft_deadline=5.0, rank=0))
    e.s.add(Request("other-priority", list(range(200, 204)), SamplingParams(max_tokens=3), priority=-1,
                    ttft_deadline=9.0, rank=1))
    assert run_order(e, now=0.0) == ["other-priority", "cheap-late", "expensive-early"]


def test_cached_prefix_tokens_agrees_with_the_schedulers_lookup_and_reuses_hashes():
    from tokenmill.engine.kv.hashing import block_hashes

    e = FakeEngine(budget=64, max_seqs=8)
    e.add("warm", 22, max_tokens=1)  # blocks [0..4), [4..8), ... registered as they fill
    while e.s.has_unfinished():
        e.step()
    assert e.kv.cached_prefix_tokens(list(range(22))) == 20  # 5 full blocks; the last token is always computed
    for prompt in (list(range(22)), list(range(13)) + [999] * 9, list(range(5)), [7], list(range(30))):
        hashes = []
        n = e.kv.cached_prefix_tokens(prompt, hashes)
        _, expect = e.kv.get_computed_blocks(Request("q", prompt, SamplingParams()))
        assert n == expect, (prompt, n, expect)
        assert hashes == block_hashes(prompt, BS)[:len(hashes)]  # the chain, as far as it was walked
        assert e.kv.cached_prefix_tokens(prompt, hashes) == n  # reused, same answer


def test_parked_request_waits_while_others_are_scheduled_and_returns_to_its_place():
    """A request whose KV is being loaded is parked: never admitted, still counted as waiting; unparked it
    goes in its (priority, arrival) place; finishing it while parked frees it like any waiting request."""
    e = FakeEngine(budget=64)
    a, b, c = e.add("a", 8, priority=0), e.add("b", 8, priority=0), e.add("c", 8, priority=1)
    assert e.s.park("a") and not e.s.park("a") and not e.s.park("nope")
    assert e.s.num_waiting == 3 and e.s.has_unfinished()
    assert [s.request_id for s in e.step().seqs] == ["b", "c"]  # a is set aside, the others go on
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
    assert a in e.s.waiting_requests() and a not in e.s.waiting_requests(include_parked=False)
    e.s.unpark("a")
    assert "a" in [s.request_id for s in e.step().seqs]
    d = e.add("d", 8)
    e.s.park("d")
    e.s.finish(d, RequestStatus.FINISHED_ABORTED)
    assert "d" not in e.s.parked and "d" not in e.s.requests
    while e.s.has_unfinished():
        e.step()
    assert all(len(r.output_token_ids) == 3 for r in (a, b, c))
