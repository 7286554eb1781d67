"""Scheduler: continuous batching with chunked prefill under a per-step token budget, priorities, and
preemption by recompute.

Each step: (1) running requests that are decoding get their token first (never starved by a prefill),
(2) running requests still prefilling get chunks, (3) waiting requests are admitted in (priority, arrival)
order with their prefix-cache hit, chunked to the remaining budget. When blocks run out, the lowest-priority
running request not yet scheduled this step is preempted (its blocks freed; it is recomputed later).

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
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by (priority, arrival_seq)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0

    # -- queue ----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[req.request_id] = req
        heapq.heappush(self.waiting, (req.sort_key, req))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished, aborted, failed) and free its blocks at once."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            idx = next((i for i, (_, r) in enumerate(self.waiting) if r is req), None)
            if idx is not None:
                self.waiting.pop(idx)
                heapq.heapify(self.waiting)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def waiting_uncached_prompt_tokens(self) -> int:
        """Leading indicator: prefill tokens queued (waiting requests, and the unprefilled rest of running)."""
        n = sum(r.num_tokens - r.num_computed_tokens for _, r in self.waiting)
        n += sum(r.num_tokens - 1 - r.num_computed_tokens for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return n

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        decoding.sort(key=lambda r: r.sort_key)
        prefilling.sort(key=lambda r: r.sort_key)
        for req in decoding + prefilling:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
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
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0][1]
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_cached, num_new, computed):
                break  # head of line waits for blocks; lower priorities must not jump ahead of it
            heapq.heappop(self.waiting)
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
        heapq.heappush(self.waiting, (req.sort_key, req))
        out.preempted.append(req.request_id)
