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

    def step(self):
        out = self.s.schedule()
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
