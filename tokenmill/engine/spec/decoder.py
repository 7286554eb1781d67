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


import dataclasses
import json
import os
import time

import torch

from tokenmill.engine.outputs import TokenLogprob
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import greedy_tokens
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.spec.guard import GoodputGuard, GuardConfig
from tokenmill.engine.spec.policy import SpecPolicyConfig, SpecSnapshot, StepCost, choose_k
from tokenmill.engine.spec.stats import Acceptance, SpecStats
from tokenmill.engine.spec.step_cost import SpecStepCost, StepCostConfig
from tokenmill.engine.spec.verify import verify_greedy, verify_sampled

SHORT_CATCHUP = 16  # draft tokens a catch-up may hold and still be a steady-state step (the decode-kernel path)
# `auto` with a proposer whose lookup is nearly free (n-gram, ~7-25 us): at most this many new shadow proposals per
# step (sequences at k = 0), so a big batch pays ~0.1 ms a step for them at most
SHADOW_PER_STEP = 8
# the time between steps (the engine's output processing, the core process's IPC, the scheduler's bookkeeping of
# finished requests) is a cost of every step, paid between one step's postprocess and the next plan(): a gap longer
# than this many times its EMA (a GC pause, a stall of the shared machine) counts as that long
GAP_OUTLIER = 4.0

# the cost model's prior (seconds: base, per decoding seq, per drafted token, per draft step, per spec seq):
# the demo pair on the 2-core dev box, whole engine steps; measurements replace it within a few steps
PRIOR_DRAFT = (8e-4, 1e-4, 5e-5, 2.5e-4, 3e-5)
PRIOR_NGRAM = (8e-4, 1e-4, 5e-5, 5e-6, 2e-5)


def guard_config(max_k: int, free_probes: bool = False) -> GuardConfig:
    """The guard's config for `auto`: k_max = the largest k; diagnostics: TOKENMILL_SPEC_GUARD="FIELD=VALUE,..."
    overrides GuardConfig fields (an A/B of a guard parameter through the server in one run); a field it does not
    have or a value of the wrong type is an error naming it."""
    over = {}
    env = os.environ.get("TOKENMILL_SPEC_GUARD", "")
    fields = {f.name: f.type for f in dataclasses.fields(GuardConfig)}
    for item in filter(None, (x.strip() for x in env.split(","))):
        name, eq, value = item.partition("=")
        if not eq or name not in fields or name == "k_max":
            raise ValueError(f"TOKENMILL_SPEC_GUARD: {item!r} is not FIELD=VALUE with FIELD one of "
                             f"{', '.join(n for n in fields if n != 'k_max')}")
        if fields[name] in (bool, "bool"):
            if value not in ("0", "1"):
                raise ValueError(f"TOKENMILL_SPEC_GUARD: {name}={value!r} is not 0 or 1")
            over[name] = value == "1"
            continue
        try:
            over[name] = int(value) if fields[name] in (int, "int") else float(value)
        except ValueError:
            raise ValueError(f"TOKENMILL_SPEC_GUARD: {name}={value!r} is not a number") from None
    return GuardConfig(**{"k_max": max_k, "free_probes": free_probes, **over})


class SpecDecoder:
    def __init__(self, proposer, num_speculative_tokens: int | str, max_k: int, max_model_len: int,
                 clock=time.perf_counter):
        self.proposer = proposer
        self.clock = clock  # the step's seconds: the engine's perf_counter, the simulator's virtual clock
        self.auto = num_speculative_tokens == "auto"
        self.fixed_k = None if self.auto else int(num_speculative_tokens)
        self.policy = SpecPolicyConfig(k_max=max_k)
        self.max_model_len = max_model_len
        self.stats = SpecStats(proposer.name, accepted_per_pos=[0] * (max_k if self.auto else self.fixed_k))
        self.acceptance = Acceptance()
        # measured cost of whole decode steps (plan .. postprocess) by shape (n, Σk, max k, speculating seqs)
        self.cost = SpecStepCost(StepCostConfig(prior=PRIOR_DRAFT if proposer.has_kv else PRIOR_NGRAM),
                                 k_scale=max_k)
        self._t_plan = 0.0  # perf_counter at this step's plan()
        # the step's share of the engine's time between steps: perf_counter where the last step's measured seconds
        # ended (None: consumed by a plan, or the engine had no unfinished work after it), the request ids that
        # step decoded, this step's gap (None: not a back-to-back step), and the EMA of the gaps counted
        self._t_end: float | None = None
        self._end_ids: frozenset[str] = frozenset()
        self._gap: float | None = None
        self.gap_s: float | None = None
        self._step_gap = 0.0  # the gap counted for this step (its seconds are plan .. observe_step + this)
        # diagnostics: TOKENMILL_SPEC_GAP=0 leaves the gap out (a step's seconds plan .. postprocess only, as before
        # session 21), for an A/B of the two accounts in one run (benchmarks/spec_serve_sweep.py --config ...@ENV)
        gap = os.environ.get("TOKENMILL_SPEC_GAP", "1")
        if gap not in ("0", "1"):
            raise ValueError(f"TOKENMILL_SPEC_GAP must be 0 or 1, got {gap!r}")
        self.count_gap = gap == "1"
        self._shape: tuple[int, int, int, int] | None = None  # this step's planned shape (decode-only steps)
        self.prev_k: dict[str, int] = {}
        self.drafts: dict[str, object] = {}  # request id -> this step's Draft
        self.num_plans = 0
        # auto: the cap on k per batch-size bucket by measured tokens/s (0 = off), so a wrong cost model
        # cannot keep speculation below off (spec/guard.py); None for a fixed k
        self.guard = GoodputGuard(guard_config(max_k, free_probes=bool(getattr(proposer, "shadow", False)))) \
            if self.auto else None
        self._guard_step: tuple[int, int] | None = None  # this decode step's (decoding seqs, cap or fixed k)
        # seconds per prefill token of the target (an EMA over k = 0 steps with a prefill chunk: their excess over
        # the guard's measured decode-only step at that batch size): a chunk's share of a mixed step, taken out
        # before the guard weighs the step's rate; None until measured (mixed steps are not weighed until then)
        self.prefill_s_per_token: float | None = None
        self._step_accepted = 0  # drafts kept in this step (tokens emitted = decoding seqs + this)
        self._step_seqs: dict[str, tuple[int, int]] = {}  # this step's (drafted, accepted) per verified request
        # diagnostics: TOKENMILL_SPEC_TRACE=FILE ({pid}: the process id) appends one JSON line per step (benchmarks/spec_trace.py reads it)
        path = os.environ.get("TOKENMILL_SPEC_TRACE")
        self._trace = open(path.replace("{pid}", str(os.getpid())), "a", buffering=1 << 16) if path else None
        self._catchup = 0  # this step's longest draft catch-up (tokens the draft had not seen)
        # shadow proposals (auto, n-gram): on a sequence's k = 0 steps the lookup still runs and its proposal is
        # scored against the tokens the target then emits (the counterfactual acceptance, no verify): request id ->
        # (position of the proposal's first token, the proposal); see _shadow_step
        self.shadow = self.auto and getattr(proposer, "shadow", False)
        self._shadow: dict[str, tuple[int, list[int]]] = {}
        self.num_shadow = 0  # shadow proposals scored (resolved)
        self.num_shadow_drafts = 0  # their drafted tokens
        self.num_shadow_accepted = 0  # of which the target's own tokens matched (the counterfactual acceptance)

    # -- plan ------------------------------------------------------------------------------------
    def cap(self, req: Request) -> int:
        """Drafts worth verifying: the output has room for them plus the target's token, positions fit."""
        return max(0, min(req.params.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens))

    def snapshot(self, decoding: list[Request], prefill_tokens: int, caps: list[int]) -> SpecSnapshot:
        c = self.cost.at(len(decoding))
        get = self.prev_k.get
        return SpecSnapshot(
            alphas=self.acceptance.alphas([r.request_id for r in decoding]),
            caps=tuple(caps),
            prev_k=tuple(get(r.request_id) for r in decoding),
            prefill_tokens=prefill_tokens, target=StepCost(c.base, c.per_seq, c.per_token),
            draft_step_s=c.per_draft_step, draft_token_s=0.0, spec_seq_s=c.per_spec_seq)

    def plan(self, scheduler: Scheduler, token_budget: int | None) -> dict[str, int]:
        self._t_plan = t = self.clock()
        end, self._t_end = self._t_end, None
        # back to back: a sequence the last step decoded is still running, so the engine had unfinished work and did
        # not wait for input in between (the core process blocks only when it has none): the time since then is
        # this step's overhead. After an idle wait (or an empty step) the gap is not known (the EMA stands in)
        self._gap = (t - end if end is not None and any(r.request_id in self._end_ids for r in scheduler.running)
                     else None)
        self._shape = None
        self._guard_step = None
        self._step_accepted = 0
        self._step_seqs = {}
        self._catchup = 0
        decoding = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return {}
        self.num_plans += 1
        n = len(decoding)
        st = self.stats
        chosen = st.chosen_k
        if self.auto:
            guard = self.guard
            rcaps = [self.cap(r) for r in decoding]
            suggest = None
            if not guard.has_bucket(n):  # a batch size not seen yet: it starts off; the cost model's choice
                budget = scheduler.config.max_num_batched_tokens if token_budget is None else token_budget
                prefill = min(max(0, budget - n), scheduler.waiting_uncached_prompt_tokens())
                suggest = max(choose_k(self.snapshot(decoding, prefill, rcaps), self.policy))  # is its first probe
            cap_k = guard.cap(n, suggest)
            self._guard_step = (n, cap_k)
            probing = cap_k != guard.current(n)  # a probe, like an exploration, is not the step's choice
            ks = [min(cap_k, c) for c in rcaps]  # the bucket's measured-best k (a probe: its neighbour)
        else:
            self._guard_step = (n, self.fixed_k)
            rcaps = [self.cap(r) for r in decoding]
            ks = [min(self.fixed_k, c) for c in rcaps]
            probing = False
        for k in ks:
            chosen[k] = chosen.get(k, 0) + 1
        if self.shadow:
            # a bucket running k_max (not probing) verifies the very proposals a shadow lookup would make: its exact
            # counts price every cap (all are at or below it), so the lookups are skipped (~70 us a step at batch 1,
            # 5% of a step there, session 22); the content trigger still runs
            if self.auto and cap_k == self.policy.k_max and not probing:
                self.guard.content_check(n)
            else:
                self._shadow_step(decoding, ks, rcaps)
        if not probing:
            self._record_k(decoding, ks, rcaps)
        self._shape = (n, sum(ks), max(ks), sum(1 for k in ks if k))
        return {r.request_id: k for r, k in zip(decoding, ks) if k}

    def _shadow_step(self, decoding: list[Request], ks: list[int], rcaps: list[int]) -> None:
        """Counterfactual acceptance (auto, a proposer whose lookup is free: n-gram).

        A sequence gets a shadow proposal of min(k_max, its cap) tokens for the positions from its next token on
        (the proposal a k_max cap would have verified in this step). On its next steps the tokens
        the target emitted are compared with it: the first mismatch at j (or j = all, the target's next token
        known) resolves it as (drafted, j kept), exactly what a verify of that proposal would have kept (greedy:
        the target's token at each position after a kept prefix is the one it emitted; sampled with a point-mass
        proposal: accepted with probability p(d), the chance the emitted token is d), covering j + 1 tokens, so
        the next shadow proposal starts where a speculating sequence's next proposal would. Resolved proposals
        feed the guard's content table (GoodputGuard.observe_shadow: a cap is priced on the content around now
        without a probe) and, for a sequence at k = 0, the acceptance EMAs (per request and per proposer: the
        policy's α). A speculating sequence keeps its shadow proposals too (on any step, the target emits the same
        tokens: lossless), so while on the guard prices the caps above the running one on that content; its own
        verify counts stay the acceptance EMAs' measurement. No output changes: the lookup has no side effects."""
        pend = self._shadow
        counts = []
        n = len(decoding)
        budget = SHADOW_PER_STEP
        k_max = self.policy.k_max
        start_i = (self.num_plans * SHADOW_PER_STEP) % n  # rotate who gets the step's new proposals
        lookup = self.proposer.lookup
        for i in range(n):
            j = (start_i + i) % n
            r = decoding[j]
            rid = r.request_id
            toks = r.all_token_ids
            nt = len(toks)
            p = pend.get(rid)
            while p is not None:
                start, prop = p
                m = 0
                while m < len(prop) and start + m < nt and toks[start + m] == prop[m]:
                    m += 1
                if start + m >= nt:  # the token that decides is not known yet
                    break
                del pend[rid]
                p = None
                counts.append((len(prop), m))
                if prop:
                    self.num_shadow += 1
                    self.num_shadow_drafts += len(prop)
                    self.num_shadow_accepted += m
                    if not ks[j]:
                        self.acceptance.observe(rid, len(prop), m)
                # the chain goes on where a k_max sequence's next proposal would start: after the token that
                # resolved this one (a speculating sequence may be several tokens further by now; starting at its
                # current position would skip the positions right after a mismatch, where lookups fail most,
                # and overstate the longer caps' content: session 20, batch 32, +16% at k = 2)
                pos = start + m + 1
                if budget and pos < nt:
                    budget -= 1
                    p = pend[rid] = (pos, lookup(toks, min(k_max, rcaps[j] + nt - pos), pos, rid))
            if rid not in pend and budget and rcaps[j] > 0:
                budget -= 1
                pend[rid] = (nt, lookup(toks, min(k_max, rcaps[j]), None, rid))
        if counts:
            self.guard.observe_shadow(n, counts)

    def _record_k(self, decoding: list[Request], ks: list[int], caps: list[int]) -> None:
        """The policy's choice becomes each sequence's previous k (the policy's hysteresis, the switch count)."""
        st = self.stats
        prev_k = self.prev_k
        for r, k, cap in zip(decoding, ks, caps):
            rid = r.request_id
            prev = prev_k.get(rid)
            if prev is not None and prev != k and not k == cap < prev:  # a cap (the output's end) is no switch
                st.num_k_switches += 1
            prev_k[rid] = k  # the policy's choice: an exploration below is not recorded as the previous k

    # -- propose ---------------------------------------------------------------------------------
    def propose(self, sched: SchedulerOutput, requests: dict[str, Request], gens: dict) -> None:
        self.drafts = {}
        seqs = [s for s in sched.seqs if s.num_spec_slots > 0]
        if not seqs:
            return
        reqs = [requests[s.request_id] for s in seqs]
        ks = [s.num_spec_slots for s in seqs]
        drafts = self.proposer.propose(reqs, ks, seqs, [gens.get(r.request_id) for r in reqs])
        self._catchup = self.proposer.last_catchup
        if self.proposer.last_catchup > SHORT_CATCHUP:  # a long catch-up (first proposal) is a prefill: not
            self._shape = None  # this shape's steady-state cost for the cost model. The guard records it under
            # its cap: a new request's draft prefill is a cost of the cap being on (leaving it out made k = 1
            # look like a win through the server at 16 sessions, where it lost 11%). A short catch-up (a
            # sequence back from a few k = 0 steps beside others that speculated) is recorded by both.
        elif self._shape is not None:  # the shape as run: a lookup may find fewer tokens than k (or none)
            lens = [len(d.tokens) for d in drafts]
            self._shape = (self._shape[0], sum(lens), max(lens), sum(1 for x in lens if x))
        for s, d in zip(seqs, drafts):
            self.drafts[s.request_id] = d
            if d.tokens:
                s.token_ids = s.token_ids + d.tokens
                s.num_logits = 1 + len(d.tokens)

    def observe_step(self, sched: SchedulerOutput) -> None:
        """After postprocess: the whole step's time from plan() on (proposal, verify, bookkeeping). The cost
        model records decode-only steps under their planned shape, leaving out steps whose proposal was a long
        draft catch-up (a request's first proposal: the draft's prefill of its context). The guard records
        every step whose planned decodes all ran, under its cap: long catch-ups included (while a cap is on,
        every new request pays one: a cost of the cap, not noise) and steps with a prefill chunk, less the
        chunk's share (seconds per prefill token measured on k = 0 steps)."""
        gs = self._guard_step
        now = self.clock()
        self._t_end = now
        self._end_ids = frozenset(s.request_id for s in sched.seqs)
        self._step_gap = self._count_gap(now - self._t_plan)
        if self._trace is not None:
            self._write_trace(sched)
        if gs is None:
            return
        # the step's cost is its whole period: plan .. postprocess, plus its share of the time between steps (per
        # step, whatever k: leaving it out made every step look cheaper by it and favoured short drafts, session 21:
        # 0.2 ms of ~1 ms at batch 1, 1.1-1.8 ms of 3.7-13 ms at 32 sequences, through the server)
        seconds = now - self._t_plan + self._step_gap
        decodes, prefill = 0, 0
        counts = []  # per decode: (drafted, accepted), for the guard's content-matched comparison
        for s in sched.seqs:
            if s.num_logits and len(s.token_ids) == s.num_logits:  # a decode: its token and its drafts
                decodes += 1
                counts.append(self._step_seqs.get(s.request_id, (0, 0)))
            else:
                prefill += len(s.token_ids)
        if decodes != gs[0]:  # not every planned decode ran (a preemption): not this cap's step
            return
        guard = self.guard
        if guard is not None:
            if not prefill:
                guard.observe(gs[0], gs[1], gs[0] + self._step_accepted, seconds, counts)
            elif gs[1] == 0:  # no speculative work: the excess over a decode-only step is the target's prefill
                base = guard.off_step_s(gs[0])
                if base is not None:
                    x = max(0.0, seconds - base) / prefill
                    p = self.prefill_s_per_token
                    self.prefill_s_per_token = x if p is None else 0.9 * p + 0.1 * x
            if prefill and self.prefill_s_per_token is not None:
                # the chunk's share is not the cap's cost; what speculation adds to such a step (a new request's
                # draft catch-up, verify rows) is
                spec_s = seconds - self.prefill_s_per_token * prefill
                guard.observe(gs[0], gs[1], gs[0] + self._step_accepted, max(spec_s, 0.25 * seconds), counts)
        if self._shape is not None and not prefill:
            self.cost.observe(*self._shape, seconds)

    def _count_gap(self, step_s: float) -> float:
        """The time between steps counted for this step: the measured gap before it (at most GAP_OUTLIER x the
        EMA of those counted; the first, GAP_OUTLIER x the step's own seconds), else the EMA (0 before any)."""
        g, ema = self._gap, self.gap_s
        if not self.count_gap:
            return 0.0
        if g is None:
            return ema or 0.0
        g = min(g, GAP_OUTLIER * (ema if ema is not None else step_s))
        self.gap_s = g if ema is None else 0.9 * ema + 0.1 * g
        return g

    def _write_trace(self, sched: SchedulerOutput) -> None:
        now = self._t_end
        gs = self._guard_step
        n = gs[0] if gs is not None else 0
        rec = {"t": now, "s": now - self._t_plan, "gap": self._step_gap, "n": n, "seqs": len(sched.seqs),
               "prefill": sum(len(s.token_ids) for s in sched.seqs
                              if not (s.num_spec_slots or (len(s.token_ids) == 1 and s.num_logits))),
               "k": gs[1] if gs is not None else 0, "spec": sum(1 for s in sched.seqs if s.num_spec_slots),
               "cur": self.guard.current(n) if self.guard is not None and n else None,
               "emitted": n + self._step_accepted, "catchup": self._catchup}
        self._trace.write(json.dumps(rec) + "\n")

    # -- verify ----------------------------------------------------------------------------------
    def verify(self, req: Request, logits: torch.Tensor, gen, default_gen) -> tuple[list[int], int]:
        """logits: the target's rows for this sequence (1 + drafts). Returns (tokens to emit, drafts kept)."""
        d = self.drafts.get(req.request_id)
        drafts = d.tokens if d is not None else []
        if req.params.greedy:
            toks, a = verify_greedy(greedy_tokens(logits), drafts)  # C++ argmax_rows: torch.argmax's rule
        else:
            toks, a = verify_sampled(logits, drafts, d.probs if d is not None else None, req.params,
                                     gen or default_gen)
        self._count(req, drafts, a)
        return toks, a

    def verify_argmax(self, req: Request, argmax_rows: list[int]) -> tuple[list[int], int]:
        """A greedy request verified from the target's per-row argmax (an all-greedy step: the runner fused the
        head with the argmax, no logits). Returns (tokens to emit, drafts kept)."""
        d = self.drafts.get(req.request_id)
        drafts = d.tokens if d is not None else []
        toks, a = verify_greedy(argmax_rows, drafts)
        self._count(req, drafts, a)
        return toks, a

    def _count(self, req: Request, drafts: list[int], a: int) -> None:
        self._step_seqs[req.request_id] = (len(drafts), a)
        if drafts:
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += len(drafts)
            st.num_accepted_tokens += a
            self._step_accepted += a
            if a > len(st.accepted_per_pos):
                st.accepted_per_pos.extend([0] * (a - len(st.accepted_per_pos)))
            for j in range(a):
                st.accepted_per_pos[j] += 1
            self.acceptance.observe(req.request_id, len(drafts), a)

    def rollback(self, scheduler: Scheduler, req: Request, num_kept: int) -> None:
        """After verification kept `num_kept` drafts: KV is valid for the known tokens before the newest."""
        req.num_computed_tokens = req.num_tokens - 1
        scheduler.kv.truncate(req, req.num_tokens)
        self.proposer.rollback(req, req.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        self.prev_k.pop(request_id, None)
        self._shadow.pop(request_id, None)
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
