"""Router: owns the live state (worker pool, prefix index, class queues) and applies the pure decisions.

    ctx = router.new_request(body, chat, class, ...)     # prompt hashes, token estimate, arrival time
    f = await router.acquire(ctx)                         # admit now, hold in the class queue, or raise Refused
    router.first_token(f) ... router.finish(f, ...)       # every change of work wakes the held requests

Decisions are `policies.*` and `admission.admit` applied to `snapshot(ctx)`; this class only gathers the
snapshot, commits the choice, and does the bookkeeping. The HTTP side lives in proxy.py and app.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field


from tokenmill.router.admission import Admission, admit
from tokenmill.router.classes import WorkloadClass, by_name
from tokenmill.router.config import RouterConfig
from tokenmill.router.holder_index import HolderIndex
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import RouteChoice, get_policy
from tokenmill.router.prefix_index import PrefixIndex
from tokenmill.router.prompt import PromptKey, TokenEstimator
from tokenmill.router.queues import ClassQueues, Held
from tokenmill.router.snapshot import RouteRequest, RouteSnapshot, uncached_tokens
from tokenmill.router.table_decisions import TABLE_ADMISSION, TABLE_POLICIES, TableSnapshot
from tokenmill.router.table_decisions import admit as admit_on_table
from tokenmill.router.worker_state import InFlight, WorkerPool, WorkerSpec, WorkerState
from tokenmill.router.worker_table import HEALTHY, WorkerTable

_ADMIT = admit  # admission.admit; a patched `admit` here (tests) is decided on the full snapshot
REJECT_STATUS = {"no-worker": 503, "overloaded": 503}  # every other reason: 429


class Refused(Exception):
    """The router will not serve this request now: an HTTP status, a reason code and a Retry-After."""

    def __init__(self, reason: str, retry_after_s: float, message: str):
        super().__init__(message)
        self.reason = reason
        self.status = REJECT_STATUS.get(reason, 429)
        self.retry_after_s = retry_after_s


@dataclass
class RequestCtx:
    request_id: str
    cls: WorkloadClass
    key: PromptKey
    prompt_tokens: int
    arrival_s: float
    seq: int
    max_tokens: int
    tried: set[str] = field(default_factory=set)
    first_token_s: float | None = None
    choice: RouteChoice | None = None  # the routing policy's latest choice for it (metrics only)
    only: frozenset[str] | None = None  # worker URLs it may go to (the EPP's subset hint); None: all
    uncached_tokens: int | None = None  # least uncached prompt tokens over the workers at its latest decision


class Router:
    def __init__(self, cfg: RouterConfig, clock=time.monotonic, metrics_prefix: str = "tokenmill_router_"):
        self.cfg = cfg
        self.clock = clock
        self.pool = WorkerPool(cfg.rate_priors)
        for spec in cfg.workers:
            self.pool.add(spec)
        self.index: PrefixIndex = HolderIndex(cfg.prefix_index)
        self.table = WorkerTable(self.pool)
        self.decisions = {"table": 0, "full": 0}  # decisions made per path (tests, profiles)
        self.tokens = TokenEstimator()
        self.policy = get_policy(cfg.policy)
        self.classes = by_name(cfg.classes)
        self.queues = ClassQueues(cfg.classes)
        self.metrics = RouterMetrics(self.pool, self.queues.depths, prefix=metrics_prefix)
        self.in_flight = 0  # requests accepted and not answered (held ones included)
        self._seq = itertools.count()
        self._ticker: asyncio.Task | None = None
        self._held = asyncio.Event()  # set when a request is held: the ticker sleeps while none is

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick())

    async def close(self) -> None:
        if self._ticker:
            self._ticker.cancel()
        for cls in self.queues.classes:
            for h in self.queues[cls.name]:
                if not h.future.done():
                    h.future.set_exception(Refused("no-worker", 1.0, "the router is shutting down"))

    async def _tick(self, period_s: float = 0.02) -> None:
        """Held requests see time pass (budgets shrink, deadlines expire) even when no work finishes.
        With nothing held it waits for the next hold instead of waking 50 times a second."""
        while True:
            if not self.queues.any_waiting():
                self._held.clear()
                await self._held.wait()
            await asyncio.sleep(period_s)
            if self.queues.any_waiting():
                self.pump()

    # ---- workers -------------------------------------------------------------------------------------
    def add_worker(self, spec: WorkerSpec) -> WorkerState:
        return self.pool.add(spec)

    def remove_worker(self, url: str) -> bool:
        found = self.pool.remove(url)
        if found:
            self.index.forget(url)
        return found

    def mark_down(self, url: str) -> None:
        w = self.pool.get(url)
        if w is not None and w.healthy:
            w.healthy = False
            self.index.forget(url)  # it probably restarts with an empty cache

    def mark_up(self, url: str) -> None:
        w = self.pool.get(url)
        if w is not None and not w.healthy:
            w.healthy = True
            self.pump()

    # ---- one request ---------------------------------------------------------------------------------
    def new_request(self, key: PromptKey, cls: WorkloadClass, max_tokens: int) -> RequestCtx:
        return RequestCtx(f"rt-{os.urandom(8).hex()}", cls, key, self.tokens.prompt_tokens(key), self.clock(),
                          next(self._seq), max_tokens)

    def snapshot(self, ctx: RequestCtx) -> tuple[RouteSnapshot, dict[str, int]]:
        """The snapshot for `ctx` now, and the matched prefix chunks per worker."""
        now = self.clock()
        views, chunks = [], {}
        for w in self.pool:
            if ctx.only is not None and w.url not in ctx.only:
                continue
            hit, chunks[w.url] = self.cached_prefix(ctx, w, now)
            views.append(w.view(hit, now))
        if views:
            ctx.uncached_tokens = min(max(0, ctx.prompt_tokens - v.cached_prefix_tokens) for v in views)
        n_ahead, tokens_ahead = self.held_ahead(ctx)
        req = RouteRequest(ctx.request_id, now, ctx.arrival_s, ctx.prompt_tokens, ctx.cls.name, ctx.seq,
                           ctx.max_tokens, frozenset(ctx.tried), ctx.cls.ttft_slo_s - (now - ctx.arrival_s),
                           n_ahead, tokens_ahead)
        return RouteSnapshot(tuple(views), req), chunks

    def held_ahead(self, ctx: RequestCtx) -> tuple[int, int]:
        """(requests, their least uncached prompt tokens) held that are dispatched before ctx if it is held:
        every held request of a higher-priority class, and those of its own class queued before it (all of
        them when ctx is not held yet). Only the ones `goes_before(ctx, other)` admits are counted."""
        n = tokens = 0
        for cls in self.queues.classes:
            if cls.priority > ctx.cls.priority:
                break
            same = cls.name == ctx.cls.name
            for h in self.queues[cls.name]:
                if same and h.ctx is ctx:
                    break
                if h.future.done() or not self.goes_before(ctx, h.ctx):
                    continue
                n += 1
                tokens += h.ctx.uncached_tokens if h.ctx.uncached_tokens is not None else h.ctx.prompt_tokens
        return n, tokens

    def goes_before(self, ctx: RequestCtx, other: RequestCtx) -> bool:
        """Whether the held `other` is served before ctx (a caller with its own ordering narrows this)."""
        return other.cls.priority < ctx.cls.priority or other.cls.name == ctx.cls.name

    def cached_prefix(self, ctx: RequestCtx, w: WorkerState, now: float) -> tuple[int, int]:
        """(estimated cached prompt tokens of ctx on w, prefix-index chunks matched): the prefix index's
        estimate. A caller that can look into the worker's cache (the server over its own engine) overrides
        this and `remember`."""
        n = self.index.match(w.url, ctx.key.hashes, now) if w.healthy else 0
        if n == 0:  # (hit_tokens of no chunk is 0: skipped for the many workers without a hit)
            return 0, 0
        return self.tokens.hit_tokens(ctx.key, n, ctx.prompt_tokens), n

    def remember(self, url: str, ctx: RequestCtx, now: float) -> None:
        """ctx's prompt was sent to url: its prefix will be cached there."""
        self.index.insert(url, ctx.key.hashes, now)

    def decide(self, ctx: RequestCtx, held: bool = False) -> tuple[Admission, RouteSnapshot, dict[str, int]]:
        """Policy + admission for ctx now. On the table (RouterConfig.snapshot "table", the default) when the
        policy and admission mode have a table form and this router estimates hits with its prefix index:
        the same decision, and the returned snapshot holds only the chosen worker's view and that of one worker
        with the longest prefix hit (what `_dispatch` reads); otherwise on the full snapshot (a view of every
        worker)."""
        if self._on_table(ctx):
            return self._decide_on_table(ctx, held)
        self.decisions["full"] += 1
        snap, chunks = self.snapshot(ctx)
        choice = ctx.choice = self.policy(snap, self.cfg.policy_params)
        if ctx.tried:  # a retry was admitted already: only the routing policy picks among the workers left
            adm = Admission("admit", choice.worker) if choice.worker else Admission("reject", reason="no-worker")
        else:
            adm = admit(snap, choice, ctx.cls, self.cfg.classes, self.cfg.admission,
                        self.queues.room(ctx.cls), held)
        return adm, snap, chunks

    def _on_table(self, ctx: RequestCtx) -> bool:
        cls = type(self)
        return (self.cfg.snapshot == "table" and ctx.only is None and self.policy in TABLE_POLICIES
                and (bool(ctx.tried) or (self.cfg.admission.mode in TABLE_ADMISSION and admit is _ADMIT))
                and cls.snapshot is Router.snapshot and cls.cached_prefix is Router.cached_prefix
                and isinstance(self.index, HolderIndex))

    def _decide_on_table(self, ctx: RequestCtx, held: bool) -> tuple[Admission, RouteSnapshot, dict[str, int]]:
        """decide() on the worker table: Router.snapshot's request, the prefix index matched only on the
        workers holding the prompt's first chunk, table_decisions' policy and admission."""
        self.decisions["table"] += 1
        now = self.clock()
        table = self.table
        rows = table.refresh_rows()
        chunks: dict[str, int] = {}
        hits: dict[int, int] = {}  # column -> estimated cached tokens, where > 0
        hashes = ctx.key.hashes
        if hashes:
            for url in self.index.holders(hashes[0]):
                i = table.col.get(url)
                if i is None or not rows[i][HEALTHY]:
                    continue
                hit, chunks[url] = self.cached_prefix(ctx, table.workers[i], now)
                if hit:
                    hits[i] = hit
        if rows:
            ctx.uncached_tokens = max(0, ctx.prompt_tokens - max(hits.values(), default=0))
        n_ahead, tokens_ahead = self.held_ahead(ctx)
        exclude = frozenset(ctx.tried)
        req = RouteRequest(ctx.request_id, now, ctx.arrival_s, ctx.prompt_tokens, ctx.cls.name, ctx.seq,
                           ctx.max_tokens, exclude, ctx.cls.ttft_slo_s - (now - ctx.arrival_s), n_ahead, tokens_ahead)
        idx = table.routable_list()
        if exclude:
            urls = table.urls
            idx = [i for i in idx if urls[i] not in exclude]
        ts = TableSnapshot(rows, table.urls, table.col, table.rank, hits, idx, req, table)
        choice = ctx.choice = TABLE_POLICIES[self.policy](ts, self.cfg.policy_params)
        if ctx.tried:
            adm = Admission("admit", choice.worker) if choice.worker else Admission("reject", reason="no-worker")
        else:
            adm = admit_on_table(ts, choice, ctx.cls, self.cfg.classes, self.cfg.admission,
                                 self.queues.room(ctx.cls), held)
        # the views `_dispatch` reads: the chosen worker's, and one with the longest hit among the routable,
        # not excluded workers (its `longest`; every other worker's hit is 0 or no longer) -- not a view per
        # holder of a popular prefix (hundreds at 1,000 workers)
        looked = set()
        if adm.worker is not None:
            looked.add(table.col[adm.worker])
        live = [(hit, -i) for i, hit in hits.items() if ts.allowed(i)]
        if live:
            looked.add(-max(live)[1])
        views = tuple(table.workers[i].view(hits.get(i, 0), now) for i in sorted(looked))
        return adm, RouteSnapshot(views, req), chunks

    async def acquire(self, ctx: RequestCtx) -> InFlight:
        """A worker for `ctx` (an attempt started there), after holding it if admission says so."""
        got = self.acquire_now(ctx)
        return got if isinstance(got, InFlight) else await self.wait_held(got)

    def acquire_now(self, ctx: RequestCtx) -> InFlight | Held:
        """`acquire` without waiting: the attempt started (admitted), Refused raised, or — admission holds it —
        the Held entry already in its class queue, for `wait_held` (callers that answer from a callback
        await only when they must: the EPP)."""
        adm, snap, chunks = self.decide(ctx)
        if adm.action == "reject":
            raise self._refuse(ctx, adm.reason, adm.retry_after_s)
        if adm.action == "admit":  # even with others held: it is predicted to meet its SLO now, they are not
            return self._dispatch(ctx, adm, snap, chunks)
        if self.queues.room(ctx.cls) <= 0:
            raise self._refuse(ctx, "queue-full", adm.retry_after_s)
        fut = asyncio.get_running_loop().create_future()
        held = Held(ctx, fut, self.clock())
        self.queues[ctx.cls.name].append(held)
        self._held.set()
        self.pump()
        return held

    async def wait_held(self, held: Held) -> InFlight:
        """The end of a hold started by `acquire_now`: the attempt, or Refused (cancelled: it leaves the queue)."""
        try:
            return await held.future
        except asyncio.CancelledError:  # client left while held
            held.future.cancel()
            self.queues.drop_done()
            raise
        finally:
            self.metrics.queue_wait.labels(held.ctx.cls.name).observe(self.clock() - held.held_s)

    PUMP_SCAN = 8  # held requests re-decided per class per pump: each decision costs a snapshot

    def pump(self) -> None:
        """Admit, or refuse at their deadline, held requests: classes in priority order, oldest first within
        one; a held request that still cannot be admitted does not block the next ones (a shorter or cached
        prompt may meet its SLO now), but at most PUMP_SCAN of them are re-decided per class per call (pump
        runs on every first token, finish and 20 ms tick, and each decision builds a snapshot: re-deciding a
        full queue of 64 each time would be ~64x the old head-only cost). Sheddable classes wait while any
        non-sheddable class has requests held."""
        if self.queues.empty():  # (nothing held: nothing to do; pump runs on every first token and finish)
            return
        self.queues.drop_done()
        for cls in self.queues.classes:
            q = self.queues[cls.name]
            still = []
            while q and len(still) < self.PUMP_SCAN:
                head = q.popleft()
                if head.future.done():
                    continue
                adm, snap, chunks = self.decide(head.ctx, held=True)
                if adm.action == "admit" and cls.sheddable and self.queues.any_waiting(sheddable=False):
                    adm = Admission("hold")
                if adm.action == "hold":
                    still.append(head)
                elif adm.action == "admit":
                    head.future.set_result(self._dispatch(head.ctx, adm, snap, chunks))
                else:
                    head.future.set_exception(self._refuse(head.ctx, adm.reason, adm.retry_after_s))
            q.extendleft(reversed(still))

    def _dispatch(self, ctx: RequestCtx, adm: Admission, snap: RouteSnapshot, chunks: dict[str, int]) -> InFlight:
        w = self.pool.get(adm.worker)
        view = next(v for v in snap.workers if v.url == adm.worker)
        predicted = adm.predicted_ttft_s if adm.predicted_ttft_s is not None else 0.0
        f = w.start(ctx.request_id, uncached_tokens(view, snap.request), predicted, snap.request.now,
                    ctx.arrival_s + ctx.cls.ttft_slo_s, ctx.max_tokens, prompt_tokens=ctx.prompt_tokens)
        f.hit_chunks, f.hit_tokens = chunks.get(w.url, 0), view.cached_prefix_tokens
        ctx.tried.add(w.url)
        self.remember(w.url, ctx, snap.request.now)
        m = self.metrics
        m.routed.labels(w.url).inc()
        m.admitted.labels(ctx.cls.name).inc()
        reason = ctx.choice.reason if ctx.choice is not None and ctx.choice.worker == w.url else "admission"
        longest = max(v.cached_prefix_tokens for v in snap.routable(snap.request.exclude))
        m.decisions.labels(reason, "longest" if view.cached_prefix_tokens >= longest else "shorter").inc()
        m.prompt_tokens.labels(w.url).inc(ctx.prompt_tokens)
        m.prefix_hit_tokens.labels(w.url).inc(view.cached_prefix_tokens)
        m.predicted_ttft.labels(w.url).observe(predicted)
        return f

    def _refuse(self, ctx: RequestCtx, reason: str, retry_after_s: float) -> Refused:
        self.metrics.rejections.labels(ctx.cls.name, reason).inc()
        messages = {
            "no-worker": "no healthy worker is available",
            "queue-full": f"the {ctx.cls.name!r} queue is full",
            "deadline": f"the {ctx.cls.name!r} TTFT SLO ({ctx.cls.ttft_slo_s:g}s) cannot be met before the hold "
                        "deadline",
            "slo": f"no worker can meet the {ctx.cls.name!r} TTFT/TPOT SLO now",
            "lagging": "workers are overloaded (observed latency or queue length over threshold)",
        }
        return Refused(reason, retry_after_s, messages.get(reason, reason))

    # ---- attempt bookkeeping -------------------------------------------------------------------------
    def first_token(self, ctx: RequestCtx, f: InFlight) -> None:
        w = self.pool.get(f.worker)
        now = self.clock()
        ttft_s = w.first_token(f, now)
        if ctx.first_token_s is None:
            ctx.first_token_s = now
            self.metrics.class_ttft.labels(ctx.cls.name).observe(now - ctx.arrival_s)
            if now - ctx.arrival_s > ctx.cls.ttft_slo_s:
                self.metrics.deadline_misses.labels(ctx.cls.name).inc()
        self.metrics.observed_ttft.labels(f.worker).observe(ttft_s)
        self.metrics.ttft_error.labels(f.worker).observe(abs(ttft_s - f.predicted_ttft_s))
        if f.predicted_ttft_s > 0:
            self.metrics.ttft_relative_error.labels(f.worker).observe((ttft_s - f.predicted_ttft_s)
                                                                      / max(f.predicted_ttft_s, 1e-3))
        self.pump()

    def output_tokens(self, f: InFlight, n: int = 1) -> None:
        """Output tokens after the first streamed back: less decode work outstanding there."""
        w = self.pool.get(f.worker)
        if w is not None:
            w.tokens(f, n, self.clock())

    def end_prefill(self, f: InFlight) -> None:
        """Non-streaming attempts: the prefill is assumed done at its predicted TTFT."""
        w = self.pool.get(f.worker)
        if w is not None and not f.prefill_done:
            w.end_prefill(f, self.clock())
            self.pump()

    def finish(self, ctx: RequestCtx, f: InFlight, output_tokens: int, usage: dict | None) -> float | None:
        """The attempt `f` ended (success or not); returns its TPOT when measured."""
        w = self.pool.get(f.worker)
        tpot_s = w.finish(f, self.clock(), output_tokens) if w is not None else None
        if usage:
            self._learn_from_usage(ctx, f, usage)
        if tpot_s is not None:
            self.metrics.class_tpot.labels(ctx.cls.name).observe(tpot_s)
        self.pool.reap()
        self.pump()
        return tpot_s

    def _learn_from_usage(self, ctx: RequestCtx, f: InFlight, usage: dict) -> None:
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            self.tokens.observe(ctx.key, prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            self.metrics.reported_cached_tokens.labels(f.worker).inc(cached)
            self.index.correct(f.worker, f.hit_chunks, self.tokens.chunks_of(ctx.key, cached))
