"""SpecDecoder: speculative decoding's part of an engine step.

    plan      (before scheduling)  k per decoding sequence: fixed K, or the `auto` policy on a snapshot
    propose   (after scheduling)   the proposer fills the KV slots the scheduler reserved with draft tokens:
                                   a sequence's scheduled step becomes [its token, d1..dk] with k+1 logits,
                                   run by the runner with every other sequence of the step (prefill chunks
                                   and plain decodes alike)
    verify    (postprocess)        greedy / rejection sampling (spec/verify.py); the KV of rejected
                                   positions is rolled back (num_computed_tokens cut, blocks past the kept
                                   tokens released, the draft's KV count cut)

When speculation is off the engine holds no SpecDecoder and its step is unchanged.
"""

from __future__ import annotations


import time

import torch

from tokenmill.engine.outputs import TokenLogprob
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.spec.policy import SpecPolicyConfig, SpecSnapshot, StepCost, choose_k
from tokenmill.engine.spec.stats import Acceptance, SpecStats
from tokenmill.engine.spec.verify import verify_greedy, verify_sampled
from tokenmill.engine.step_budget import StepBudget, StepBudgetConfig

EXPLORE_EVERY = 8  # auto: every this many plans k is perturbed by +1 / -1 (alternately): the cost fits need k to vary


class SpecDecoder:
    def __init__(self, proposer, num_speculative_tokens: int | str, max_k: int, max_model_len: int):
        self.proposer = proposer
        self.auto = num_speculative_tokens == "auto"
        self.fixed_k = None if self.auto else int(num_speculative_tokens)
        self.policy = SpecPolicyConfig(k_max=max_k)
        self.max_model_len = max_model_len
        self.stats = SpecStats(proposer.name, accepted_per_pos=[0] * (max_k if self.auto else self.fixed_k))
        self.acceptance = Acceptance()
        # measured costs: the target's step (runner.execute) and the proposer's (steps, tokens)
        self.target_cost = StepBudget()
        # a proposal round: base + per draft step (max k) + per drafted token
        self.draft_cost = StepBudget(StepBudgetConfig(prior_base_s=1e-4, prior_decode_s=2e-4, prior_prefill_s=2e-5))
        self._t_plan = 0.0  # perf_counter at this step's plan()
        self._propose_s = 0.0
        self.prev_k: dict[str, int] = {}
        self.drafts: dict[str, object] = {}  # request id -> this step's Draft
        self.num_plans = 0

    # -- plan ------------------------------------------------------------------------------------
    def cap(self, req: Request) -> int:
        """Drafts worth verifying: the output has room for them plus the target's token, positions fit."""
        return max(0, min(req.params.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens))

    def snapshot(self, decoding: list[Request], prefill_tokens: int, caps: list[int]) -> SpecSnapshot:
        tb, tp, tt = self.target_cost.coef
        dc, dstep, dtok = self.draft_cost.coef
        return SpecSnapshot(
            alphas=tuple(self.acceptance.alpha(r.request_id) for r in decoding),
            caps=tuple(caps),
            prev_k=tuple(self.prev_k.get(r.request_id) for r in decoding),
            prefill_tokens=prefill_tokens, target=StepCost(tb, tp, tt),
            draft_step_s=dstep, draft_token_s=dtok, draft_call_s=dc)

    def plan(self, scheduler: Scheduler, token_budget: int | None) -> dict[str, int]:
        self._t_plan, self._propose_s = time.perf_counter(), 0.0
        decoding = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return {}
        self.num_plans += 1
        caps = [self.cap(r) for r in decoding]
        if self.auto:
            budget = scheduler.config.max_num_batched_tokens if token_budget is None else token_budget
            prefill = min(max(0, budget - len(decoding)), scheduler.waiting_uncached_prompt_tokens())
            ks = choose_k(self.snapshot(decoding, prefill, caps), self.policy)
        else:
            ks = [min(self.fixed_k, c) for c in caps]
        st = self.stats
        plan = {}
        explore = 0
        if self.auto and self.num_plans % EXPLORE_EVERY == 0:
            explore = 1 if self.num_plans % (2 * EXPLORE_EVERY) == 0 else -1
        for i, (r, k) in enumerate(zip(decoding, ks)):
            st.chosen_k[k] = st.chosen_k.get(k, 0) + 1
            prev = self.prev_k.get(r.request_id)
            if prev is not None and prev != k and not k == caps[i] < prev:  # a cap (the output's end) is no switch
                st.num_k_switches += 1
            self.prev_k[r.request_id] = k
            if explore and (k or not self.proposer.has_kv):  # not recorded as the previous k: the plan is unchanged
                k = min(caps[i], self.policy.k_max, max(0, k + explore))  # (a draft model is not woken from 0: that costs a catch-up)
            if k:
                plan[r.request_id] = k
        return plan

    # -- propose ---------------------------------------------------------------------------------
    def propose(self, sched: SchedulerOutput, requests: dict[str, Request], gens: dict) -> None:
        self.drafts = {}
        seqs = [s for s in sched.seqs if s.num_spec_slots > 0]
        if not seqs:
            return
        reqs = [requests[s.request_id] for s in seqs]
        ks = [s.num_spec_slots for s in seqs]
        t0 = time.perf_counter()
        drafts = self.proposer.propose(reqs, ks, seqs, [gens.get(r.request_id) for r in reqs])
        self._propose_s = time.perf_counter() - t0
        if self.proposer.last_catchup <= 2:  # steady state; a long catch-up (first proposal, resuming) is a prefill
            self.draft_cost.observe(max(ks), sum(ks), self._propose_s)
        for s, d in zip(seqs, drafts):
            self.drafts[s.request_id] = d
            if d.tokens:
                s.token_ids = s.token_ids + d.tokens
                s.num_logits = 1 + len(d.tokens)

    def observe_step(self, sched: SchedulerOutput) -> None:
        """After postprocess: the step's time from plan() on, less the proposal, fitted as base + per decoding
        sequence + per other token. Steps with prefill chunks are left out (their tokens cost differently)."""
        if any(len(s.token_ids) != s.num_logits for s in sched.seqs):
            return
        n = len(sched.seqs)
        tokens = sum(len(s.token_ids) for s in sched.seqs)
        self.target_cost.observe(n, tokens - n, time.perf_counter() - self._t_plan - self._propose_s)

    # -- verify ----------------------------------------------------------------------------------
    def verify(self, req: Request, logits: torch.Tensor, gen, default_gen) -> tuple[list[int], int]:
        """logits: the target's rows for this sequence (1 + drafts). Returns (tokens to emit, drafts kept)."""
        d = self.drafts.get(req.request_id)
        drafts = d.tokens if d is not None else []
        if req.params.greedy:
            toks, a = verify_greedy(logits.argmax(dim=-1).tolist(), drafts)
        else:
            toks, a = verify_sampled(logits, drafts, d.probs if d is not None else None, req.params,
                                     gen or default_gen)
        if drafts:
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += len(drafts)
            st.num_accepted_tokens += a
            if a > len(st.accepted_per_pos):
                st.accepted_per_pos.extend([0] * (a - len(st.accepted_per_pos)))
            for j in range(a):
                st.accepted_per_pos[j] += 1
            self.acceptance.observe(req.request_id, len(drafts), a)
        return toks, a

    def rollback(self, scheduler: Scheduler, req: Request, num_kept: int) -> None:
        """After verification kept `num_kept` drafts: KV is valid for the known tokens before the newest."""
        req.num_computed_tokens = req.num_tokens - 1
        scheduler.kv.truncate(req, req.num_tokens)
        self.proposer.rollback(req, req.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        self.prev_k.pop(request_id, None)
        self.acceptance.forget(request_id)
        self.proposer.forget(request_id)
        self.drafts.pop(request_id, None)


def logprobs_for(logits: torch.Tensor, tokens: list[int], k: int | None) -> list[TokenLogprob] | None:
    """TokenLogprobs of emitted tokens (row j: token j), of the raw logits like the sampler's."""
    if k is None:
        return None
    logp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    out = []
    for j, t in enumerate(tokens):
        top = {}
        if k:
            v, i = logp[j].topk(k)
            top = dict(zip(i.tolist(), v.tolist()))
        out.append(TokenLogprob(token_id=t, logprob=float(logp[j, t]), top=top))
    return out
