"""A simulated worker: the real Scheduler and KVCacheManager (prefix cache included) and the server's real
step-budget model, with the model runner replaced by a cost model.

One step, as the server's engine thread runs it (server/async_engine.py `_step`):

    budget = step_budget.budget_for(scheduler, max_num_batched_tokens)   # as server/engine_core.py
    sched  = scheduler.schedule(now, budget)          # the real scheduler: admission, chunking, preemption
    step_s = cost_model.step_s(StepShape.of(sched))   # instead of runner.execute(sched)
    step_budget.observe(*step_composition(sched), step_s)                # as LLMEngine.step + engine_core
    at now + step_s: every sequence with a logit gets one output token; a request ends at max_tokens or
                     max_model_len (LLMEngine._check_stop's length rules; no EOS: the sim has no model)

Requests added while a step runs wait for its end (the engine thread applies commands between steps).
Steady decode (every running request decoding, nothing waiting) is fast-forwarded: a run of identical
decode steps is one event (decode_run.py; `WorkerConfig.fast_forward`, exactly the per-request results of
stepping).
The seam is the Scheduler, not LLMEngine: LLMEngine's __init__ loads a model and its _postprocess samples
logits; what the sim replaces is exactly ModelRunner.execute + Sampler (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.kv.named_tokens import NamedTokens
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.step_budget import StepBudget, StepBudgetConfig, step_composition
from tokenmill.model.row_buckets import onednn_rows
from tokenmill.sim import decode_run
from tokenmill.sim.clock import EventLoop
from tokenmill.sim.cost_model import CostModel, StepShape
from tokenmill.sim.spec import Content, SimProposer, SpecSimConfig
from tokenmill.sim.tiers import TierCluster, TierConfig

OUTPUT_TOKEN = 1  # every simulated output token (the sim has no model; outputs run to max_tokens)


class SimKVCacheManager(KVCacheManager):
    """The real KV manager; only `block_ids` -- the block table the scheduler copies into each ScheduledSeq for
    the model runner, O(context) per sequence per step and read by nothing but the runner -- is left empty, as
    the sim has no runner. Allocation, prefix lookups, registration and eviction are the real ones."""

    full_tables = False  # set with KV tiers: KVTiers.store_computed reads the step's block ids (sim/tiers.py)

    def block_ids(self, req: Request) -> list[int]:
        return super().block_ids(req) if self.full_tables else []


def budget_can_bind(scheduler: Scheduler) -> bool:
    """Whether the step budget can change the next `schedule()`: not when nothing waits and every running
    request is decoding. Then schedule(token_budget=t) gives any t the batch of no budget -- the budget is never
    below min(max_num_batched_tokens, decodes + 1), enough for every decode, and there is nothing else to
    batch -- so the worker skips sizing it (the fit's solve: engine/step_budget.py). Not for the engine: with
    speculative decoding the budget also sizes the drafts (the sim has none). tests/sim checks the results
    with and without this shortcut are identical."""
    if scheduler.num_waiting:
        return True
    return any(r.num_tokens - r.num_computed_tokens != 1 for r in scheduler.running)


@dataclass(frozen=True)
class WorkerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting_requests: int = 4096
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    step_budget: bool = True  # the server's TPOT-sized step budget (engine/step_budget.py)
    fast_forward: bool = True  # steady decode steps in one event (decode_run.py); same results as stepping
    spec: SpecSimConfig | None = None  # speculative decoding (sim/spec.py): the engine's SpecDecoder; no fast-forward
    tiers: TierConfig | None = None  # KV tiers below the pool (sim/tiers.py); None: off (fast-forward needs off)

    def __post_init__(self):
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 2:
            raise ValueError("a simulated worker needs num_blocks >= 1, block_size >= 1, max_model_len >= 2")
        SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, self.max_waiting_requests)


class SimWorker:
    """Calls on_token(worker, request, first, finished, count) at the end of each step per output chunk (count:
    its tokens; more than one where a speculating sequence kept drafts), and
    on_tokens(worker, request, times) for the tokens of fast-forwarded steps (never a first or last token;
    `times`: each one's step end, delivered later, when the run is materialized)."""

    def __init__(self, name: str, cfg: WorkerConfig, cost: CostModel, loop: EventLoop, on_token: Callable,
                 on_tokens: Callable, tiers: TierCluster | None = None, draft_cost: CostModel | None = None):
        self.name, self.cfg, self.cost, self.loop = name, cfg, cost, loop
        self.on_token, self.on_tokens = on_token, on_tokens
        self.kv = SimKVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                   cfg.max_waiting_requests), self.kv)
        self.step_budget = StepBudget(StepBudgetConfig(enabled=cfg.step_budget))
        self.busy = False
        self.pending: list[Request] = []  # added during a step: enter the scheduler at its end
        self.run: decode_run.DecodeRun | None = None  # a fast-forwarded run of decode steps in flight
        self.shapes_run: set[int] = set()  # the wide row counts this worker's engine has run (new_shape_s)
        self.ff = {"runs": 0, "steps": 0, "cut": 0, "block_limited": 0}  # fast-forward counters
        self.steps = 0
        self.busy_s = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.tiers = tiers.attach(self) if tiers is not None else None  # the engine's KVTiers (sim/tiers.py)
        self.spec = self.content = self.proposer = None
        if cfg.spec is not None:  # the engine's own SpecDecoder, on this loop's clock (sim/spec.py)
            from tokenmill.engine.spec.decoder import SpecDecoder

            self.proposer = SimProposer(cfg.spec, draft_cost)
            self.spec = SpecDecoder(self.proposer, cfg.spec.num_speculative_tokens, cfg.spec.k_max, cfg.max_model_len,
                                    clock=lambda: loop.now)
            self.content = Content(cfg.spec.acceptance, cfg.spec.seed)

    def cached_prefix_tokens(self, token_ids: list[int], hashes: list[int] | None = None) -> int:
        self.cut_run()
        return self.kv.cached_prefix_tokens(token_ids, hashes)

    def add(self, request_id: str, token_ids: list[int] | NamedTokens, max_tokens: int, priority: int = 0,
            ttft_deadline: float = float("inf"), tpot_slo_s: float | None = None, rank: int = 0,
            block_hashes: list[int] | None = None) -> str | None:
        """Queue a request; returns an error ('invalid: ...' or 'overloaded: ...') instead of raising, as the
        server turns LLMEngine.add_request's errors into HTTP 400 / 503. `block_hashes`: the hashes of the
        prompt's leading blocks already computed (by cached_prefix_tokens), so the KV manager does not hash
        them again."""
        n = len(token_ids)
        if n == 0 or n + max_tokens > self.cfg.max_model_len:
            return (f"invalid: this model's maximum context length is {self.cfg.max_model_len} tokens; "
                    f"{n + max_tokens} requested")
        if self.scheduler.num_waiting + len(self.pending) >= self.cfg.max_waiting_requests:
            return f"overloaded: waiting queue is full ({self.cfg.max_waiting_requests} requests)"
        named = isinstance(token_ids, NamedTokens)  # a token-free prompt (engine/kv/named_tokens.py)
        if named and token_ids.block_size != self.cfg.block_size:
            raise ValueError(f"a token-free prompt of {token_ids.block_size}-token named blocks on a worker with "
                             f"{self.cfg.block_size}-token KV blocks")
        req = Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                      max_total_tokens=self.cfg.max_model_len, ttft_deadline=ttft_deadline, tpot_slo_s=tpot_slo_s,
                      rank=rank, all_token_ids=token_ids.copy() if named else [])
        if block_hashes:
            req.block_hashes = block_hashes
        self.prompt_tokens += n
        self.cut_run()
        if self.busy:
            self.pending.append(req)
        else:
            self.scheduler.add(req)
            self._step()
        return None

    def _step(self) -> None:
        s, spec = self.scheduler, self.spec
        tier_s = self.tiers.before_schedule() if self.tiers is not None else 0.0
        if spec is None:
            budget = self.step_budget.budget_for(s, self.cfg.max_num_batched_tokens) if budget_can_bind(s) else None
            sched = s.schedule(self.loop.now, budget)
        else:  # LLMEngine._step's order with the SpecDecoder (sim/spec.py); the budget also sizes the drafts
            budget = self.step_budget.budget_for(s, self.cfg.max_num_batched_tokens)
            sched = s.schedule(self.loop.now, budget, spec.plan(s, budget))
        if sched.empty:
            self.busy = False
            if self.tiers is not None:
                self.tiers.idle(self._wake)
            return
        composition = step_composition(sched)  # before any drafts are appended, as LLMEngine._step records it
        if spec is not None:
            spec.propose(sched, s.requests, {})
        shape = StepShape.of(sched)
        step_s = self.cost.step_s(shape)
        if spec is not None:
            step_s += self.proposer.take_s()
        wide = self.cost.wide_rows
        rows = onednn_rows(shape.tokens)  # oneDNN's row count: the engine buckets wide calls (linear.onednn_rows)
        if wide is not None and shape.tokens > wide and rows not in self.shapes_run:
            self.shapes_run.add(rows)  # the engine's first step of this many rows (cost_model: new_shape_s)
            step_s += self.cost.new_shape_s(shape)
        if self.tiers is not None:  # the engine thread's tier copies around execute (sim/tiers.py)
            step_s = tier_s + step_s + self.tiers.after_schedule(sched, tier_s, step_s)
        self.step_budget.observe(*composition, step_s)
        self.busy = True
        self.steps += 1
        self.busy_s += step_s
        if spec is not None:  # no fast-forward while speculating
            self.loop.at(self.loop.now + step_s, self._end_spec_step, sched)
            return
        ff = self.cfg.fast_forward and self.tiers is None  # tiers: every step's full blocks are written through
        if ff and decode_run.steady(sched, s, self.pending, self.cfg.max_num_batched_tokens):
            run = decode_run.plan(sched, s, self.kv, shape, step_s, self.loop.now, self.cost, self.cfg.max_model_len)
            if run is not None:
                self.run = run
                self.ff["runs"] += 1
                self.ff["steps"] += len(run.ends)
                self.ff["block_limited"] += run.block_limited
                run.entry = self.loop.at(run.ends[-1], self._end_run)
                return
        self.loop.at(self.loop.now + step_s, self._end_step, [q.request_id for q in sched.seqs if q.num_logits])

    def cut_run(self) -> None:
        """Something looks into this worker now: bring the fast-forwarded run to the step in flight now."""
        run = self.run
        if run is None:
            return
        now = self.loop.now
        k = run.scheduled - 1  # the step in flight is the first one ending after now
        while k < run.last and run.ends[k] <= now:
            k += 1
        if k == run.last:
            self._materialize(k)
            return
        self._materialize(k)
        self.ff["cut"] += 1
        self.ff["steps"] -= run.last - k
        del run.ends[k + 1:], run.step_s[k + 1:]
        self.loop.cancel(run.entry)
        run.entry = self.loop.at(run.ends[k], self._end_run)

    def _materialize(self, target: int) -> None:
        run = self.run
        first = run.scheduled
        times = decode_run.materialize(run, target, self.kv, OUTPUT_TOKEN)
        skipped = run.step_s[first:target + 1]
        if skipped:
            self.step_budget.observe_many(run.first_shape.decode_seqs, 0, skipped)
            for x in skipped:
                self.busy_s += x
            self.steps += len(skipped)
        if times:
            self.output_tokens += len(times) * len(run.reqs)
            for r in run.reqs:
                self.on_tokens(self, r, times)

    def _end_run(self) -> None:
        run = self.run
        self._materialize(run.last)
        self.run = None
        self._end_step([r.request_id for r in run.reqs])

    def _end_step(self, request_ids: list[str]) -> None:
        requests = self.scheduler.requests
        max_len = self.cfg.max_model_len
        for rid in request_ids:
            req = requests.get(rid)
            if req is None:
                continue
            req.append_output(OUTPUT_TOKEN)
            self.output_tokens += 1
            n_out = len(req.output_token_ids)
            finished = n_out >= req.params.max_tokens or req.num_tokens >= max_len
            if finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                if self.tiers is not None:
                    self.tiers.forget(rid)
            self.on_token(self, req, n_out == 1, finished, 1)
        for req in self.pending:
            self.scheduler.add(req)
        self.pending.clear()
        self._step()

    def _wake(self) -> None:
        """A tier load ended (or reached its deadline) while the worker was idle."""
        if not self.busy:
            self._step()

    # -- speculative decoding (sim/spec.py) -----------------------------------------------------------------
    def _end_spec_step(self, sched) -> None:
        """LLMEngine._postprocess_spec: a speculating sequence is verified (the real verify_greedy, on argmax rows
        from the request's content) and emits its kept drafts + the target's token in one chunk; the others one
        token. Then rollback of rejected positions and the decoder's step observation (its clock: now)."""
        s, spec, content = self.scheduler, self.spec, self.content
        requests = s.requests
        max_len = self.cfg.max_model_len
        for q in sched.seqs:
            if not q.num_logits:
                continue
            req = requests.get(q.request_id)
            if req is None:
                continue
            rid = req.request_id
            n0 = len(req.output_token_ids)
            verified = q.num_spec_slots and rid in spec.drafts
            if verified:
                rows = [content.token(rid, n0 + j) for j in range(q.num_logits)]
                toks, kept = spec.verify_argmax(req, rows)
            else:
                toks = [content.token(rid, n0)]
            finished = False
            count = 0
            for tok in toks:
                req.append_output(tok)
                count += 1
                if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= max_len:
                    finished = True
                    break
            self.output_tokens += count
            if finished:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
                spec.forget(rid)
                content.forget(rid)
                if self.tiers is not None:
                    self.tiers.forget(rid)
            elif verified:
                spec.rollback(s, req, kept)
            self.on_token(self, req, n0 == 0, finished, count)
        spec.observe_step(sched)
        for req in self.pending:
            s.add(req)
        self.pending.clear()
        self._step()

    def spec_stats(self) -> dict:
        """What the decoder counted (SpecStats) and the guard's caps per batch-size bucket (auto)."""
        st = self.spec.stats
        out = {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens, "accepted_tokens": st.num_accepted_tokens,
               "chosen_k": dict(st.chosen_k), "k_switches": st.num_k_switches,
               "draft_passes": self.proposer.draft_passes, "lookups": self.proposer.lookups}
        if self.spec.guard is not None:
            g = self.spec.guard
            out["guard_caps"] = {str(b): g.buckets[b].cur for b in sorted(g.buckets)}  # bucket -> cap in force
        return out
