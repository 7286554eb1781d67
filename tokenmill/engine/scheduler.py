"""Scheduler: continuous batching with chunked prefill under a per-step token budget, priorities, TTFT
deadlines, and preemption by recompute.

Each step: (1) running requests that are decoding get their token first (never starved by a prefill),
(2) running requests still prefilling get chunks, (3) waiting requests are admitted in (priority, earliest
TTFT deadline, arrival) order with their prefix-cache hit, chunked to the remaining budget. When blocks run
out, the lowest-priority running request not yet scheduled this step is preempted (its blocks freed; it is
recomputed later).

Deadlines (`Request.ttft_deadline`, on the caller's clock; `now` is passed to `schedule`): within a priority
level the earliest deadline goes first (with equal SLOs that is arrival order). A waiting request whose
deadline has passed before its first token is *late*: it moves behind every on-time request of its priority
level (served later, in arrival order), so it does not take the place of one that can still make its SLO.
The step's token budget can be lowered per step (`schedule(token_budget=...)`): the caller sizes it so the
step stays within the TPOT of the requests decoding (engine/step_budget.py).

Parked requests (`park` / `unpark`): a waiting request whose KV is being brought in from elsewhere (a KV tier
now; another worker under prefill/decode disaggregation) is set aside, not admitted, while the others are
scheduled around it; unparked, it returns to its place in the waiting order. It still counts as waiting.

No clock and no I/O: the same code runs under the real engine and under the simulator's virtual clock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting_requests: int = 4096

    def __post_init__(self):
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_waiting_requests < 1:
            raise ValueError("scheduler limits must be >= 1")


@dataclass
class ScheduledSeq:
    """One request's share of a step: run token_ids at positions start_pos.. and return the logits of the
    last num_logits of them (0 for a prefill chunk that does not reach the end of the known tokens)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_logits: int
    num_spec_slots: int = 0  # speculative decoding: KV slots reserved after token_ids for drafts the engine appends
    # (> 0: the runner attends each of the seq's tokens as a decode query, the decode kernel's path)
    # positions from here on are the request's generated tokens, first computed as decode (or verify) rows: a
    # batch-invariant runner attends them so when they are recomputed (after a preemption), and the prompt's rows
    # with the prefill kernel even one at a time (runner.batch_invariant); default 0: every row a generated one
    # (a batch-invariant runner attends them all as decode rows; without batch invariance it is not read)
    decode_from: int = 0


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    first_scheduled: list[str] = field(default_factory=list)  # requests scheduled for the first time

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[tuple[tuple, Request]] = []  # heap by Request.waiting_key (priority, deadline, seq)
        self.late: list[tuple[tuple, Request]] = []  # waiting requests past their TTFT deadline: (priority, seq)
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # waiting requests set aside while their KV loads (not admitted)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0

    # -- queue ----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.waiting_key, req))

    def waiting_requests(self, include_parked: bool = True) -> list[Request]:
        out = [r for _, r in self.waiting] + [r for _, r in self.late]
        return out + list(self.parked.values()) if include_parked else out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.late) + len(self.parked)

    def park(self, request_id: str) -> bool:
        """Set a waiting request aside (not admitted) until `unpark`; False if it is not waiting."""
        req = self.requests.get(request_id)
        if req is None or request_id in self.parked or not self._remove_waiting(req):
            return False
        self.parked[request_id] = req
        return True

    def unpark(self, request_id: str) -> None:
        req = self.parked.pop(request_id, None)
        if req is not None:
            self._push_waiting(req)  # a deadline that passed meanwhile demotes it at the next schedule()

    def _remove_waiting(self, req: Request) -> bool:
        for heap in (self.waiting, self.late):
            idx = next((i for i, (_, r) in enumerate(heap) if r is req), None)
            if idx is not None:
                heap.pop(idx)
                heapq.heapify(heap)
                return True
        return False

    @property
    def num_late(self) -> int:
        return len(self.late)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.late or self.running or self.parked)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished, aborted, failed) and free its blocks at once."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif self.parked.pop(req.request_id, None) is None:
            self._remove_waiting(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def waiting_uncached_prompt_tokens(self) -> int:
        """Leading indicator: prefill tokens queued (waiting requests, and the unprefilled rest of running)."""
        n = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting_requests())
        n += sum(r.num_tokens - 1 - r.num_computed_tokens for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return n

    def tightest_tpot_slo_s(self) -> float | None:
        """The least TPOT promised to a running request past its prefill (None: none promised)."""
        slos = [r.tpot_slo_s for r in self.running
                if r.tpot_slo_s is not None and r.num_tokens - r.num_computed_tokens == 1]
        return min(slos, default=None)

    def num_decoding(self) -> int:
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self, now: float | None = None, token_budget: int | None = None,
                 spec_tokens: dict[str, int] | None = None) -> SchedulerOutput:
        """One step's batch. `now` (the caller's clock, the one deadlines are on) demotes late waiting
        requests; `token_budget` lowers max_num_batched_tokens for this step (never below one token per
        decoding request plus one). `spec_tokens`: request id -> k, KV slots and budget to reserve for k
        draft tokens after a decoding request's token (speculative decoding; cut to the budget left over
        after one token per decoding request, and dropped rather than preempting anyone for it)."""
        out = SchedulerOutput()
        decoding, prefilling = [], []  # one pass (the late demotion below changes no running request)
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                decoding.append(r)
            elif left > 1:
                prefilling.append(r)
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = max(min(budget, token_budget), min(budget, len(decoding) + 1))
        total = budget
        self._demote_late(now)
        scheduled: set[str] = set()
        decoding.sort(key=lambda r: r.sort_key)
        prefilling.sort(key=lambda r: r.sort_key)
        spare = budget - len(decoding)  # tokens for drafts once every decoding request has its own
        for req in decoding + prefilling:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if spec_tokens and spare > 0 and (k := min(spec_tokens.get(req.request_id, 0), spare)) > 0 \
                    and num_new == 1 and self.kv.allocate_slots(req, req.num_computed_tokens, 1 + k):
                self._emit(req, req.num_computed_tokens, 1, out)
                out.seqs[-1].num_spec_slots = k
                scheduled.add(req.request_id)
                budget -= 1 + k
                spare -= k
                continue
            while not self.kv.allocate_slots(req, req.num_computed_tokens, num_new):
                victim = self._pick_victim(scheduled)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._emit(req, req.num_computed_tokens, num_new, out)
            scheduled.add(req.request_id)
            budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        out.num_batched_tokens = total - budget
        return out

    def _demote_late(self, now: float | None) -> None:
        """Move waiting requests whose TTFT deadline passed behind the on-time ones of their priority. In EDF
        order the late ones of a priority level are at its front, so looking at the heap's head suffices."""
        while self.waiting and self.waiting[0][1].late(now):
            _, req = heapq.heappop(self.waiting)
            heapq.heappush(self.late, (req.sort_key, req))

    def _next_waiting(self) -> list | None:
        """The heap holding the next request to admit: on-time before late within a priority level."""
        if self.waiting and self.late:
            return self.late if self.late[0][0][0] < self.waiting[0][0][0] else self.waiting
        return self.waiting or self.late or None

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while (heap := self._next_waiting()) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = heap[0][1]
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_cached, num_new, computed):
                break  # head of line waits for blocks; lower priorities must not jump ahead of it
            heapq.heappop(heap)
            if req.num_cached_tokens < 0:  # first admission: record the prefix hit of the prompt
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
                self.kv.record_prefix_query(req.num_prompt_tokens, req.num_cached_tokens)
                out.first_scheduled.append(req.request_id)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            self._emit(req, num_cached, num_new, out)
            budget -= num_new
        return budget

    def _emit(self, req: Request, start: int, num_new: int, out: SchedulerOutput) -> None:
        end = start + num_new
        out.seqs.append(ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end],
            start_pos=start,
            block_ids=self.kv.block_ids(req),
            num_logits=1 if end == req.num_tokens else 0,
            decode_from=req.num_prompt_tokens,
        ))
        req.num_computed_tokens = end

    def _pick_victim(self, scheduled: set[str]) -> Request:
        candidates = [r for r in self.running if r.request_id not in scheduled]
        return max(candidates, key=lambda r: r.sort_key)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)
        out.preempted.append(req.request_id)
