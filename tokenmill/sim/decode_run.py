"""Fast-forward of steady decode: a run of engine steps that the real scheduler would make identical, advanced
in one event instead of one event per step.

A step is *steady* when the real `Scheduler.schedule()` just made it decode-only — every running request got
exactly its one next token, each with a logit, nothing preempted — and nothing is waiting (in the scheduler
or added during a step), no request in it gets its first token, and the decodes leave budget over. Then, until
a request finishes, a block allocation would fail, or a request arrives, each next `schedule()` call does
exactly this, per decoding request in sort order: `kv.allocate_slots(req, computed, 1)` and `computed += 1`
(late-demotion and admission find nothing waiting; the step budget cannot cut a decode-only step: it never
goes below one token per decode + 1). The run of n steps is planned when its first step is scheduled:

    steps      n = min(steps until the first request finishes (max_tokens or max_model_len),
                       1 + steps whose new blocks still fit in the free pool)
    times      the cost model per step (its shape changes only by one context token per decode per step);
               step i ends at end(i-1) + step_s(i), the same float additions as step by step

and *materialized* lazily: at the run's end, or earlier when something looks into the worker (a request is
added, the router's dispatch reads its prefix cache) at time t — then the run is cut to the step in flight at
t. Materializing applies, in step order and sort order within a step, the real `KVCacheManager.allocate_slots`
calls the skipped steps would have made (only the steps where it changes anything: a new block, or a block
becoming full and registered in the prefix cache), appends the output tokens, and feeds the step budget the
skipped steps' times (`StepBudget.observe_many`: the same float operations). The last step of a run ends
through the worker's ordinary step end (finishes, pending requests, the next real `schedule()`).

So the per-request results are exactly those of stepping (tests/sim: fast-forward on vs off, several
workloads); the only approximation is the order of events at *exactly* equal virtual times (a step end of
this worker and an arrival at the same float time), which stepping resolves by scheduling order.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from tokenmill.engine.request import Request
from tokenmill.sim.cost_model import CostModel, StepShape


@dataclass
class DecodeRun:
    reqs: list[Request]  # the running requests, in the scheduler's decode order (sort_key)
    computed0: list[int]  # each one's computed tokens before the run's first step (its decode position)
    first_shape: StepShape
    step_s: list[float]  # per step of the run
    ends: list[float]  # end time of each step
    scheduled: int = 1  # steps 0 .. scheduled-1 are applied to the scheduler/KV state (step 0 by schedule())
    entry: list | None = None  # the event of the run's end (EventLoop entry, cancelled when cut)
    block_limited: bool = False  # shorter than the first finish: the pool would run out of blocks

    @property
    def last(self) -> int:
        return len(self.ends) - 1


def steady(sched, scheduler, pending: list, max_batched: int) -> bool:
    """The step the real scheduler just made is decode-only and will repeat (module docstring)."""
    seqs = sched.seqs
    if sched.preempted or pending or scheduler.num_waiting or len(seqs) != len(scheduler.running):
        return False
    if len(seqs) >= max_batched:
        return False
    requests = scheduler.requests
    for q in seqs:
        if q.num_logits != 1 or len(q.token_ids) != 1 or not requests[q.request_id].output_token_ids:
            return False
    return True


def plan(sched, scheduler, kv, shape: StepShape, step0_s: float, now: float, cost: CostModel,
         max_model_len: int) -> DecodeRun | None:
    """The run starting with the step just scheduled (steady); None when it is a single step."""
    requests = scheduler.requests
    reqs = [requests[q.request_id] for q in sched.seqs]
    computed0 = [q.start_pos for q in sched.seqs]
    # steps (the first included) until the first request finishes: its output reaches max_tokens, or the
    # sequence reaches max_model_len (num_tokens counts the token this step consumes, not the one it makes)
    n = min(min([r.params.max_tokens - len(r.output_token_ids) for r in reqs]),
            max_model_len - max([len(r.all_token_ids) for r in reqs]))  # (r.num_tokens = len(r.all_token_ids))
    if n < 2:
        return None
    bs = kv.block_size
    by_residue: dict[int, int] = {}
    for c in computed0:
        by_residue[c % bs] = by_residue.get(c % bs, 0) + 1
    free, limited = kv.pool.num_free, False
    if blocks_needed(by_residue, bs, n) > free:  # else no step of the run can run out (free only decreases)
        for i in range(1, n):  # step i allocates a block for each request whose position c0 + i starts one
            free -= by_residue.get(-i % bs, 0)
            if free < 0:
                n, limited = i, True  # step i would have to preempt: the real scheduler takes it
                break
    if n < 2:
        return None
    rest = cost.decode_run_s(shape, n)  # = cost.step_s per step i (one more context token per decode each)
    step_s = [step0_s] + rest
    ends = list(accumulate(rest, initial=now + step0_s))  # end(i) = end(i-1) + step_s(i), as step by step
    return DecodeRun(reqs, computed0, shape, step_s, ends, block_limited=limited)


def blocks_needed(by_residue: dict[int, int], bs: int, n: int) -> int:
    """New blocks steps 1 .. n-1 of a run allocate: a request at position c0 starts a block at step i when
    (c0 + i) % bs == 0, i.e. i % bs == -c0 % bs; `by_residue`: requests per c0 % bs. The sum, over the steps,
    of plan's per-step decrements (tests/sim: equal on random runs)."""
    total = 0
    for r, k in by_residue.items():
        t = -r % bs  # the first such step is t (t = 0: bs), then every bs steps
        first = t or bs
        if first <= n - 1:
            total += k * ((n - 1 - first) // bs + 1)
    return total


def materialize(run: DecodeRun, target: int, kv, output_token: int) -> list[float]:
    """Apply the run's steps up to `target` (scheduled; its output still to come) to the real requests and
    KV manager; returns the end times of the steps whose output tokens were appended now (one per request)."""
    done = run.scheduled
    if target < done:
        return []
    times = run.ends[done - 1:target]
    k = len(times)
    for r in run.reqs:
        r.all_token_ids.extend([output_token] * k)
        r.output_token_ids.extend([output_token] * k)
    bs = kv.block_size
    groups: dict[int, list[int]] = {}
    for idx, c in enumerate(run.computed0):
        groups.setdefault(c % bs, []).append(idx)
    reqs, c0 = run.reqs, run.computed0
    for i in range(done, target + 1):
        # allocate_slots(req, c, 1) changes something only when c starts a block (c % bs == 0) or c + 1 fills
        # one ((c + 1) % bs == 0); in between it is a no-op (no new block, nothing to register)
        a, b = groups.get(-i % bs), groups.get((-i - 1) % bs)
        if a is None and b is None:
            continue
        if a is None or b is None or a is b:
            idxs = a if b is None or a is b else b
        else:
            idxs = sorted(a + b)
        for idx in idxs:
            ok = kv.allocate_slots(reqs[idx], c0[idx] + i, 1)
            assert ok, "a planned decode step ran out of blocks"
    for r, c in zip(reqs, c0):
        r.num_computed_tokens = c + target + 1
    run.scheduled = target + 1
    return times
