"""A model-free engine with LLMEngine's interface, for fast HTTP-layer tests.

Every running request gets one token per step from a fixed cycle of words; `step_s` of sleep stands for the
compute, plus `prefill_s_per_token` per uncached prompt token the step prefills. Prompts are prefilled in
chunks under a per-step token budget (`max_num_batched_tokens`, or the `token_budget` the caller passes);
a request's first token comes in the step that finishes its prompt. Prefix caching is simulated on full blocks, KV usage is counted per request. Failure hooks:
`fail_next_step` makes step() raise once; a request with `seed == ERROR_SEED` finishes with reason "error".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from tokenmill.errors import EngineOverloadedError, InvalidRequestError
from tokenmill.model.tokenizer import SHIPPED_TOKENIZER_DIR, Tokenizer

ERROR_SEED = 13


@dataclass
class _Config:
    max_num_batched_tokens: int


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: object
    priority: int
    out: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    started: bool = False
    prefilled: int = 0  # prompt tokens computed (the cached ones included)
    tpot_slo_s: float | None = None
    rank: int = 0


class FakeEngine:
    def __init__(self, max_model_len: int = 256, block_size: int = 4, num_blocks: int = 512, max_running: int = 64,
                 max_waiting: int = 256, step_s: float = 0.002, enable_prefix_caching: bool = True,
                 prefill_s_per_token: float = 0.0, max_num_batched_tokens: int = 1 << 30):
        self.tokenizer = Tokenizer(SHIPPED_TOKENIZER_DIR)
        self.model_name = "fake"
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_capacity_tokens = num_blocks * block_size
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.step_s = step_s
        self.enable_prefix_caching = enable_prefix_caching
        self.prefill_s_per_token = prefill_s_per_token
        self.config = _Config(max_num_batched_tokens)
        self.last_step_decodes = self.last_step_prefill_tokens = 0
        self.budgets: list[int | None] = []  # the token_budget of each step (tests read it)
        self.words = self.tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta")
        self.waiting: list[_Req] = []
        self.running: dict[str, _Req] = {}
        self.cached_blocks: set[tuple] = set()
        self.fail_next_step = False
        self.added: list[str] = []
        self.admitted: list[str] = []
        self.aborted: list[str] = []
        self.c = dict(queries=0, hits=0, prompt=0, gen=0, steps=0)

    def add_request(self, request_id, prompt_token_ids, params, priority=0, ttft_deadline=None, tpot_slo_s=None,
                    rank=0):
        if not prompt_token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("prompt + max_tokens > max_model_len", param="max_tokens")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("token id out of range", param="prompt")
        if len(self.waiting) >= self.max_waiting:
            raise EngineOverloadedError(f"waiting queue full ({self.max_waiting})")
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params, priority, tpot_slo_s=tpot_slo_s,
                                 rank=rank))
        self.waiting.sort(key=lambda r: (r.priority, r.rank))  # stable: FCFS among equals
        self.added.append(request_id)

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        self.waiting = [r for r in self.waiting if r.rid != request_id]

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def num_decoding(self):
        return sum(1 for r in self.running.values() if r.started and r.prefilled >= len(r.prompt))

    def tightest_tpot_slo_s(self):
        return min((r.tpot_slo_s for r in self.running.values() if r.tpot_slo_s is not None
                    and r.started and r.prefilled >= len(r.prompt)), default=None)

    def cached_prefix_tokens(self, prompt: list[int], hashes=None) -> int:
        bs, hit = self.block_size, 0
        for end in range(bs, len(prompt), bs):
            if not self.enable_prefix_caching or tuple(prompt[:end]) not in self.cached_blocks:
                break
            hit = end
        return hit

    def _prefix_hit(self, prompt: list[int]) -> int:
        bs, hit = self.block_size, 0
        for end in range(bs, len(prompt), bs):  # the last token is always computed
            key = tuple(prompt[:end])
            if not self.enable_prefix_caching or key not in self.cached_blocks:
                break
            hit = end
        for end in range(bs, len(prompt) + 1, bs):
            self.cached_blocks.add(tuple(prompt[:end]))
        return hit

    def step(self, now=None, token_budget=None):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        self.budgets.append(token_budget)
        budget = min(self.config.max_num_batched_tokens, token_budget or self.config.max_num_batched_tokens)
        self.last_first_scheduled = []
        decoding = [r for r in self.running.values() if r.started and r.prefilled >= len(r.prompt)]
        budget -= len(decoding)
        prefill_tokens, ready = 0, list(decoding)

        def chunk_of(r):  # the next chunk of r's prompt within the budget left
            nonlocal budget, prefill_tokens
            chunk = min(len(r.prompt) - r.prefilled, budget)
            r.prefilled += chunk
            budget -= chunk
            prefill_tokens += chunk
            if r.prefilled >= len(r.prompt):
                ready.append(r)

        for r in list(self.running.values()):  # prompts already started go first (like the real scheduler)
            if r not in decoding and budget > 0:
                chunk_of(r)
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            r = self.waiting.pop(0)
            self.running[r.rid] = r
            self.admitted.append(r.rid)
            self.last_first_scheduled.append(r.rid)
            r.started = True
            r.cached = r.prefilled = self._prefix_hit(r.prompt)
            self.c["queries"] += len(r.prompt)
            self.c["hits"] += r.cached
            self.c["prompt"] += len(r.prompt)
            chunk_of(r)
        self.last_step_decodes, self.last_step_prefill_tokens = len(decoding), prefill_tokens
        time.sleep(self.step_s + self.prefill_s_per_token * prefill_tokens)
        self.c["steps"] += 1
        outs = []
        for r in ready:
            tid = self.words[len(r.out) % len(self.words)]
            r.out.append(tid)
            self.c["gen"] += 1
            new_text = self.tokenizer.decode([tid])
            r.text += new_text
            lps = None
            if r.params.logprobs is not None:
                top = {t: -1.0 - i for i, t in enumerate(self.words[: r.params.logprobs])}
                lps = [TokenLogprob(tid, -0.5, top)]
            finish = stop_reason = None
            if r.params.seed == ERROR_SEED:
                finish = "error"
            elif any(s in r.text for s in r.params.stop):
                s = next(s for s in r.params.stop if s in r.text)
                r.text, finish, stop_reason = r.text[: r.text.index(s)], "stop", s
                new_text = ""
            elif len(r.out) >= r.params.max_tokens:
                finish = "length"
            out = RequestOutput(r.rid, [tid], new_text, r.text, list(r.out), len(r.prompt), r.cached,
                                finished=finish is not None, finish_reason=finish, stop_reason=stop_reason,
                                new_logprobs=lps, error="injected request error" if finish == "error" else None)
            outs.append(out)
            if finish:
                del self.running[r.rid]
        return outs

    def blocks_used(self) -> int:
        bs = self.block_size
        return sum(-(-(len(r.prompt) + len(r.out)) // bs) for r in self.running.values())

    def stats(self):
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_preempted_total=0,
            kv_blocks_total=self.num_blocks, kv_blocks_used=self.blocks_used(), block_size=self.block_size,
            waiting_uncached_prompt_tokens=sum(len(r.prompt) for r in self.waiting),
            prefix_cache_queries_tokens=self.c["queries"], prefix_cache_hits_tokens=self.c["hits"],
            prompt_tokens_total=self.c["prompt"], generation_tokens_total=self.c["gen"], num_steps=self.c["steps"],
        )
