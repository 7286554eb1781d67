"""One simulated load level: the bench's planned sessions, the real router (routing policy, admission,
class queues, learned rates, prefix index) over N simulated workers, all on one virtual clock.

    arrival  -> RequestRecord (the bench's) -> router.decide: admit (dispatch) | hold (class queue) | reject
    dispatch -> the worker's engine gets the request with the server's priority, TTFT deadline, TPOT SLO and
                rank (server/admission.py: cheap prompts, <= 256 uncached tokens, rank 0)
    tokens   -> router.first_token / output_tokens / finish (its rates and calibration learn), the record's
                first_token_s / chunk_s / end_s; the session's next turn is due after its think time

`SimRouter` is router.Router with a synchronous acquire (the real one awaits an asyncio future while a request
is held): the decision (`Router.decide`: policy + admission on a snapshot), the hold queue and `Router.pump`
are the router's own code. Its 20 ms ticker becomes a virtual-clock event while requests are held.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokenmill.bench.record import RequestRecord
from tokenmill.bench.runner import LoadConfig
from tokenmill.bench.session import Session
from tokenmill.engine.kv.hashing import block_hashes_of_array
from tokenmill.engine.kv.named_tokens import NamedTokens
from tokenmill.router.config import RouterConfig
from tokenmill.router.prompt import PromptKey
from tokenmill.router.prefix_index import chunk_hashes, named_chunk_hashes
from tokenmill.router.queues import Held
from tokenmill.router.router import Refused, RequestCtx, Router
from tokenmill.router.worker_state import WorkerSpec
from tokenmill.sim.clock import EventLoop
from tokenmill.sim.cost_model import CostModel
from tokenmill.sim.tiers import TierCluster
from tokenmill.sim.worker import SimWorker, WorkerConfig


REFUSED_RTT_S = 1e-3  # a refused request's round trip to the bench's client (loopback HTTP), closed loop


def spec_summary(per_worker: list[dict]) -> dict:
    """The workers' speculative-decoding counts summed; acceptance and tokens per verify; the guards' caps
    (auto) as {bucket: {cap: workers}}."""
    keys = ("drafts", "draft_tokens", "accepted_tokens", "k_switches", "draft_passes", "lookups")
    out = {k: sum(w[k] for w in per_worker) for k in keys}
    chosen: dict[int, int] = {}
    caps: dict[str, dict[int, int]] = {}
    for w in per_worker:
        for k, n in w["chosen_k"].items():
            chosen[k] = chosen.get(k, 0) + n
        for b, c in w.get("guard_caps", {}).items():
            caps.setdefault(b, {})[c] = caps.setdefault(b, {}).get(c, 0) + 1
    out["chosen_k"] = {str(k): chosen[k] for k in sorted(chosen)}
    out["acceptance_rate"] = out["accepted_tokens"] / out["draft_tokens"] if out["draft_tokens"] else None
    out["mean_accepted_per_verify"] = out["accepted_tokens"] / out["drafts"] if out["drafts"] else None
    if caps:
        out["guard_caps"] = {b: {str(c): n for c, n in sorted(v.items())} for b, v in
                             sorted(caps.items(), key=lambda x: int(x[0]))}
    return out

CHEAP_PREFILL_TOKENS = 256  # server/admission.py ServerAdmissionConfig.cheap_prefill_tokens (default)
TICK_S = 0.02  # Router._tick's period


class SimFuture:
    """What Router.pump resolves for a held request: calls back instead of waking a coroutine."""

    def __init__(self, callback: Callable):
        self.callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, flight) -> None:
        self._done = True
        self.callback(flight, None)

    def set_exception(self, exc: Refused) -> None:
        self._done = True
        self.callback(None, exc)


class _Discarded:
    """A metric child that records nothing: `labels(...)` is itself; inc / observe / set do nothing."""

    __slots__ = ()

    def labels(self, *values):
        return self

    def inc(self, amount=1):
        pass

    def observe(self, value):
        pass

    def set(self, value):
        pass


_DISCARDED = _Discarded()


class DiscardedMetrics:
    """The router's Prometheus metrics (router/metrics.py) with nothing recorded: the simulator never reads
    them (no decision does: they are written, then only rendered for /metrics), and updating ~10 of them per
    routed request was ~4% of the event loop at 1,000 workers. Every metric attribute is a `_Discarded`."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _DISCARDED

    def render(self) -> bytes:
        return b""


class SimRouter(Router):
    def __init__(self, cfg: RouterConfig, loop: EventLoop, metrics: bool = False):
        super().__init__(cfg, clock=loop)
        self.loop = loop
        if not metrics:  # ClusterSim(router_metrics=...): the same decisions either way (tests/sim)
            self.metrics = DiscardedMetrics()
        self._tick_pending = False
        self._uuid = itertools.count()

    def new_request(self, key: PromptKey, cls, max_tokens: int) -> RequestCtx:
        ctx = super().new_request(key, cls, max_tokens)
        ctx.request_id = f"sim-{next(self._uuid)}"  # deterministic ids (the router's are random)
        return ctx

    def submit(self, ctx: RequestCtx, callback: Callable) -> None:
        """Router.acquire without asyncio: callback(flight, None) when dispatched, (None, Refused) when refused."""
        adm, snap, chunks = self.decide(ctx)
        if adm.action == "reject":
            return callback(None, self._refuse(ctx, adm.reason, adm.retry_after_s))
        if adm.action == "admit":
            return callback(self._dispatch(ctx, adm, snap, chunks), None)
        if self.queues.room(ctx.cls) <= 0:
            return callback(None, self._refuse(ctx, "queue-full", adm.retry_after_s))
        self.queues[ctx.cls.name].append(Held(ctx, SimFuture(callback), self.clock()))
        self.pump()
        self._arm_tick()

    def _arm_tick(self) -> None:
        if not self._tick_pending and self.queues.any_waiting():
            self._tick_pending = True
            self.loop.at(self.loop.now + TICK_S, self._tick_event)

    def _tick_event(self) -> None:
        self._tick_pending = False
        if self.queues.any_waiting():
            self.pump()
            self._arm_tick()


@dataclass
class _Live:
    rec: RequestRecord
    session: Session
    ctx: RequestCtx
    flight: object = None
    worker: SimWorker | None = None


@dataclass
class LevelStats:
    events: int = 0
    steps: int = 0
    busy_s: list[float] = field(default_factory=list)  # per worker
    prompt_tokens: int = 0
    output_tokens: int = 0
    sim_end_s: float = 0.0
    fast_forward: dict = field(default_factory=dict)  # runs, steps in them, runs cut short, runs block-limited
    spec: dict | None = None  # speculative decoding: the decoders' counts summed, the guards' caps (sim/spec.py)
    tiers: dict | None = None  # KV tier counters (sim/tiers.py TierCluster.stats); None: tiers off


class ClusterSim:
    def __init__(self, router_cfg: RouterConfig, num_workers: int, worker_cfg: WorkerConfig, cost: CostModel,
                 record_chunks: bool = True, router_metrics: bool = False, draft_cost: CostModel | None = None,
                 tier_model: str = "sim"):
        self.loop = EventLoop()
        self.router = SimRouter(router_cfg, self.loop, router_metrics)
        self.classes = self.router.classes
        self.chunk_tokens = router_cfg.prefix_index.chunk_tokens
        self.workers: dict[str, SimWorker] = {}
        t = worker_cfg.tiers
        self.tiers = TierCluster(t, worker_cfg.block_size, self.loop, tier_model) if t and t.enabled else None
        for i in range(num_workers):
            url = f"http://sim-worker-{i}"
            self.workers[url] = SimWorker(url, worker_cfg, cost, self.loop, self._on_token, self._on_tokens,
                                          self.tiers, draft_cost)
            self.router.add_worker(WorkerSpec(url, "tokenmill")).healthy = True
        self.record_chunks = record_chunks
        self.records: list[RequestRecord] = []
        self._live: dict[str, _Live] = {}
        self._deadline: float | None = None
        self._next_session: Iterator | None = None

    # -- load -----------------------------------------------------------------------------------
    def run(self, plan: Iterator[tuple[float, Session]], load: LoadConfig) -> tuple[list[RequestRecord], LevelStats]:
        self._deadline = load.duration_s
        if load.mode == "concurrency":
            self._next_session = iter(plan)
            for _ in range(load.concurrency):
                self._start_next_session()
            self.loop.run()
        else:
            plan = iter(plan)
            self._feed(plan)  # arrivals are scheduled lazily, one ahead: a trace of millions is never all in memory
            self.loop.run()
        stats = LevelStats(self.loop.events, sum(w.steps for w in self.workers.values()),
                           [w.busy_s for w in self.workers.values()],
                           sum(w.prompt_tokens for w in self.workers.values()),
                           sum(w.output_tokens for w in self.workers.values()), self.loop.now,
                           {k: sum(w.ff[k] for w in self.workers.values()) for k in ("runs", "steps", "cut",
                                                                                     "block_limited")})
        if any(w.spec is not None for w in self.workers.values()):
            stats.spec = spec_summary([w.spec_stats() for w in self.workers.values()])
        if self.tiers is not None:
            stats.tiers = self.tiers.stats()
        return self.records, stats

    def _feed(self, plan: Iterator) -> None:
        item = next(plan, None)
        if item is None:
            return
        start_s, session = item
        self.loop.at(start_s, self._start_planned, session, start_s, plan)

    def _start_planned(self, session: Session, start_s: float, plan: Iterator) -> None:
        self._feed(plan)
        self._send(session, 0, start_s)

    def _start_next_session(self) -> None:
        if self._deadline is not None and self.loop.now >= self._deadline:
            return
        item = next(self._next_session, None)
        if item is not None:
            self._send(item[1], 0, self.loop.now)

    def _session_over(self, session: Session, failed: bool = False) -> None:
        """A closed-loop slot (concurrency mode) takes the next session: at once after a completed turn, one
        REFUSED_RTT_S later after a refused or failed one (the bench's client gets its 429/503/400 a round trip
        later; at zero virtual time a refusing router would be asked again at the same instant, forever)."""
        if self._next_session is not None:
            if failed:
                self.loop.at(self.loop.now + REFUSED_RTT_S, self._start_next_session)
            else:
                self._start_next_session()

    # -- one request ----------------------------------------------------------------------------
    def _send(self, session: Session, k: int, due: float) -> None:
        if self._deadline is not None and due >= self._deadline:
            return self._session_over(session)
        turn = session.turns[k]
        named = turn.named
        if named is None:
            arr = turn.flat_tokens()
            ids = arr.tolist()
        else:  # token-free (a Mooncake trace's block names): no token ids (engine/kv/named_tokens.py)
            arr, ids = None, NamedTokens(named.names, named.length, named.block_size)
        rec = RequestRecord(f"{session.index}-{k}", session.class_name, session.index, k, turn.prompt_tokens,
                            turn.max_tokens, due, sent_s=self.loop.now, digest=turn.digest())
        self.records.append(rec)
        cls = self.classes.get(session.class_name)
        if cls is None:  # the router answers 400 for a class it does not know
            rec.status, rec.http_status, rec.end_s = "failed", 400, self.loop.now
            rec.error = f"HTTP 400: unknown workload class {session.class_name!r}"
            return self._session_over(session, failed=True)
        chunks = chunk_hashes(arr, self.chunk_tokens) if named is None else \
            named_chunk_hashes(named.names, named.length, named.block_size, self.chunk_tokens)
        key = PromptKey(chunks, True, len(ids), self.chunk_tokens)
        ctx = self.router.new_request(key, cls, turn.max_tokens)
        live = _Live(rec, session, ctx)
        self.router.submit(ctx, lambda flight, refused: self._dispatched(live, ids, flight, refused, arr))

    def _dispatched(self, live: _Live, ids: list[int], flight, refused: Refused | None, arr=None) -> None:
        rec, now = live.rec, self.loop.now
        if refused is not None:
            rec.status, rec.http_status, rec.end_s = "rejected", refused.status, now
            rec.error = f"HTTP {refused.status}: {refused}"
            return self._session_over(live.session, failed=True)
        w = self.workers[flight.worker]
        live.flight, live.worker = flight, w
        cls = live.ctx.cls
        # the prompt's block hashes, computed once (as the server's admission keeps them), from the planned
        # array's buffer when there is one (the same values as hashing the list block by block)
        if not w.cfg.enable_prefix_caching:
            hashes = []
        elif isinstance(ids, NamedTokens):
            hashes = ids.block_hashes(ids.length // ids.block_size)
        else:
            hashes = block_hashes_of_array(arr, w.cfg.block_size) if arr is not None else []
        hit = min(w.cached_prefix_tokens(ids, hashes), len(ids) - 1)
        rank = 0 if 0 < len(ids) - hit <= CHEAP_PREFILL_TOKENS else 1
        rid = live.ctx.request_id
        self._live[rid] = live
        delay = w.cost.request_overhead_s
        if delay > 0:  # HTTP, parsing, the server's admission: the request reaches the engine later
            self.loop.at(now + delay, self._enter, live, w, ids, rank, hashes)
        else:
            self._enter(live, w, ids, rank, hashes)

    def _enter(self, live: _Live, w: SimWorker, ids: list[int], rank: int, hashes: list[int]) -> None:
        rec, now, cls, rid, flight = live.rec, self.loop.now, live.ctx.cls, live.ctx.request_id, live.flight
        err = w.add(rid, ids, rec.max_tokens, priority=cls.priority, ttft_deadline=live.ctx.arrival_s + cls.ttft_slo_s,
                    tpot_slo_s=cls.tpot_slo_s, rank=rank, block_hashes=hashes)
        if err is not None:
            del self._live[rid]
            status = 400 if err.startswith("invalid") else 503
            rec.status, rec.http_status, rec.end_s = ("failed" if status == 400 else "rejected"), status, now
            rec.error = f"HTTP {status}: {err}"
            self.router.finish(live.ctx, flight, 0, None)
            self._session_over(live.session, failed=True)

    def _on_tokens(self, w: SimWorker, req, times: list[float]) -> None:
        """Tokens of fast-forwarded decode steps (none first, none last), each at its step's end time; the
        router counts them now (its decode bookkeeping feeds no decision: worker_state.tokens)."""
        live = self._live.get(req.request_id)
        if live is None:
            return
        if self.record_chunks:
            live.rec.chunk_s.extend(times)
        self.router.output_tokens(live.flight, len(times))

    def _on_token(self, w: SimWorker, req, first: bool, finished: bool, count: int = 1) -> None:
        """A chunk of `count` output tokens (more than one: a speculating sequence's kept drafts + its token)."""
        live = self._live.get(req.request_id)
        if live is None:
            return
        now, rec = self.loop.now, live.rec
        if self.record_chunks:
            rec.chunk_s.append(now)
        if first:
            rec.first_token_s = now
            self.router.first_token(live.ctx, live.flight)
            if count > 1:
                self.router.output_tokens(live.flight, count - 1)
        else:
            self.router.output_tokens(live.flight, count)
        if not finished:
            return
        del self._live[req.request_id]
        n = len(req.output_token_ids)
        rec.end_s, rec.output_tokens, rec.output_tokens_from_usage = now, n, True
        rec.usage_prompt_tokens, rec.cached_tokens = req.num_prompt_tokens, max(req.num_cached_tokens, 0)
        usage = {"prompt_tokens": req.num_prompt_tokens, "prompt_tokens_details": {"cached_tokens": rec.cached_tokens}}
        self.router.finish(live.ctx, live.flight, n, usage)
        session, k = live.session, live.rec.turn + 1
        if k < len(session.turns):
            self.loop.at(now + session.turns[k].think_s, self._send, session, k, now + session.turns[k].think_s)
        else:
            self._session_over(session)
