"""Admission control inside `tokenmill serve`: the router's classes and pure admission policy, with the
server's own engine as the one worker.

    cls = admission.workload_class(header, body_field)     # x-tokenmill-class / "workload_class", else default
    ticket = await admission.acquire(rid, cls, ids, max_tokens)   # admit, hold in the class queue, or Refused
    engine.add(..., priority=cls.priority, ttft_deadline=ticket.ttft_deadline, tpot_slo_s=cls.tpot_slo_s)
    admission.progress(first_token_ids, finished)          # once per engine step (AsyncEngine.on_progress)
    admission.release(rid)                                 # the handler's end, whatever happened

One implementation, two callers: this is `router.Router` (class queues, hold/refuse/admit, learned
prefill and TPOT fits, TTFT calibration, error band and miss-rate margin, metrics) over a pool holding a
single worker — the engine — and `router.admission.admit` decides on the same `RouteSnapshot`. What the
server knows better than a router replaces the router's estimates: the cached prefix of a new request is
looked up in the engine's own prefix cache (exact block hashes, not the router's character-chunk index),
and all work on the engine went through this admission (no external queue to guess at). Its metrics are
the router's series named `tokenmill_admission_*`.

The leading indicator is the router's: the predicted TTFT of the new request = calibration x (overhead x
(pending prefills + 1) + (uncached prompt tokens pending + its own uncached tokens) / learned prefill
rate), and the predicted TPOT = base + per-stream x (decode streams + 1). What meets its SLO is admitted;
what does not is refused at once (429 + Retry-After from the predicted excess) unless its class is
sheddable (`AdmissionConfig.hold="sheddable"`, the default here): the engine's deadline-ordered queue is the
hold, and holding in the admission queue under sustained overload mostly ended in a refusal 0.1-0.5 s late.

The clock is `time.perf_counter` (the engine core passes it to `step(now=...)`), so the TTFT deadline
each admitted request carries into the engine's EDF ordering is on the same clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError
from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.classes import CLASS_HEADER, DEFAULT_CLASSES, WorkloadClass
from tokenmill.router.config import RouterConfig
from tokenmill.router.prompt import PromptKey
from tokenmill.router.rates import RatePriors
from tokenmill.router.router import Refused, RequestCtx, Router
from tokenmill.router.snapshot import prefill_time_s
from tokenmill.router.worker_state import InFlight, WorkerSpec, WorkerState

LOCAL_WORKER = "http://engine.local"  # the pseudo-worker's name in the admission metrics (worker label)
CLASS_FIELD = "workload_class"  # the request-body field naming the class (the header wins)


@dataclass(frozen=True)
class ServerAdmissionConfig:
    classes: tuple[WorkloadClass, ...] = DEFAULT_CLASSES
    default_class: str = "interactive"
    # only sheddable classes are held: the engine's deadline-ordered queue is the others' hold (router.admission)
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig(hold="sheddable"))
    rate_priors: RatePriors = field(default_factory=RatePriors)
    max_in_flight: int = 4096  # held + admitted, then 503
    cheap_prefill_tokens: int = 256  # a request with at most this many uncached prompt tokens is "cheap" (0: none)

    def __post_init__(self):
        if self.cheap_prefill_tokens < 0 or self.max_in_flight < 1:
            raise ValueError("cheap_prefill_tokens must be >= 0 and max_in_flight >= 1")

    def router_config(self) -> RouterConfig:
        return RouterConfig(policy="round-robin", classes=self.classes, default_class=self.default_class,
                            admission=self.admission, rate_priors=self.rate_priors, max_in_flight=self.max_in_flight)


@dataclass
class ServerCtx(RequestCtx):
    token_ids: list[int] = field(default_factory=list)
    cheap: bool = False  # its uncached prefill is small: admitted ahead of the others of its priority level
    block_hashes: list[int] = field(default_factory=list)  # the prompt's block hashes, computed once


@dataclass
class Ticket:
    ctx: ServerCtx
    flight: InFlight
    ttft_deadline: float  # arrival + the class's TTFT SLO (perf_counter clock)
    rank: int = 1  # the engine's order within a priority level: 0 cheap, 1 the rest


class _EngineRouter(Router):
    """The router over one worker, the engine: prefix hits come from the engine's own cache, and the work in
    front of a request is what the engine's own order puts there.

    Cheap requests first: under overload, serving a continuation turn whose context is cached (a few
    hundred uncached tokens) instead of a new session's first turn (thousands) turns the same compute into
    several good requests. A request with at most `cheap_prefill_tokens` uncached tokens is ranked ahead of
    the others of its priority level in the engine (`Request.rank`); within a rank the engine goes by
    earliest TTFT deadline (EDF). So the prefill work in front of a request is that of the pending requests
    the engine orders before it — (priority, rank, deadline) not after its own — plus what remains of the
    prefills the engine already started (at most one step's budget of the others' pending work): its
    snapshot counts just those. A request that was held is dispatched with an earlier deadline than the
    newcomers admitted meanwhile, and goes before them: counting them in front of it (as the router's
    FIFO view does) made held requests look hopeless and refused them late.

    Cheap requests that arrive later still pass a non-cheap one while it waits: their share of the engine's
    time (`passing_share`, the cheap prefill admitted over the last `PASSING_WINDOW_S`, in predicted
    seconds per second) stretches its wait for the work in front (snapshot.py).
    """

    PASSING_WINDOW_S = 5.0
    MAX_PASSING_SHARE = 0.8

    def __init__(self, cfg: RouterConfig, engine, clock, cheap_prefill_tokens: int = 0):
        super().__init__(cfg, clock, metrics_prefix="tokenmill_admission_")
        self.engine = engine
        self.cheap_prefill_tokens = cheap_prefill_tokens
        self.worker = self.add_worker(WorkerSpec(LOCAL_WORKER, "tokenmill"))
        self.worker.healthy = True
        self.pending: dict[str, tuple[tuple[int, int, float], InFlight]] = {}  # engine order key, attempt
        self.cheap_admitted: deque[tuple[float, float]] = deque()  # (time, predicted own prefill s) of cheap ones

    def cached_prefix(self, ctx: RequestCtx, w: WorkerState, now: float) -> tuple[int, int]:
        lookup = getattr(self.engine, "cached_prefix_tokens", None)
        if not isinstance(ctx, ServerCtx):
            return 0, 0
        hit = max(0, min(lookup(ctx.token_ids, ctx.block_hashes), ctx.prompt_tokens - 1)) if lookup else 0
        ctx.cheap = 0 < ctx.prompt_tokens - hit <= self.cheap_prefill_tokens
        return hit, 0

    @staticmethod
    def order_key(ctx: RequestCtx) -> tuple[int, int, float]:
        """The engine's waiting order (Request.waiting_key): priority, rank (cheap 0), TTFT deadline."""
        return ctx.cls.priority, 0 if getattr(ctx, "cheap", False) else 1, ctx.arrival_s + ctx.cls.ttft_slo_s

    def passing_share(self, now: float) -> float:
        """Share of the engine's time the cheap prompts admitted lately took (they pass non-cheap waiting ones)."""
        q = self.cheap_admitted
        while q and q[0][0] < now - self.PASSING_WINDOW_S:
            q.popleft()
        return min(self.MAX_PASSING_SHARE, sum(s for _, s in q) / self.PASSING_WINDOW_S)

    def snapshot(self, ctx: RequestCtx):
        snap, chunks = super().snapshot(ctx)
        if not isinstance(ctx, ServerCtx):
            return snap, chunks
        for rid, (_, f) in list(self.pending.items()):
            if f.prefill_done:
                del self.pending[rid]
        key = self.order_key(ctx)
        before = [f for k, f in self.pending.values() if k <= key]
        tokens = sum(f.uncached_tokens for f in before)
        # the engine finishes the prefills it already started (running requests) before it admits anyone:
        # up to one step's budget of the other requests' pending work is in front of it too
        step = getattr(getattr(self.engine, "config", None), "max_num_batched_tokens", 0)
        passing = 0.0 if ctx.cheap else self.passing_share(snap.request.now)
        views = tuple(dataclasses.replace(
            v, prefill_tokens=tokens + min(max(0, v.prefill_tokens - tokens), step),
            prefill_requests=len(before), passing_share=passing) for v in snap.workers)
        return dataclasses.replace(snap, workers=views), chunks

    def _dispatch(self, ctx, adm, snap, chunks) -> InFlight:
        f = super()._dispatch(ctx, adm, snap, chunks)
        self.pending[ctx.request_id] = (self.order_key(ctx), f)
        if getattr(ctx, "cheap", False):
            view = snap.workers[0]
            self.cheap_admitted.append((snap.request.now, prefill_time_s(view, 1, f.uncached_tokens)))
        return f

    def remember(self, url: str, ctx: RequestCtx, now: float) -> None:
        pass  # the engine's cache is the index

    def goes_before(self, ctx: RequestCtx, other: RequestCtx) -> bool:
        """The engine's order: priority, then cheap before the rest within one level (a held cheap request
        waits only for the cheap ones held before it; every other request waits for all of them)."""
        if other.cls.priority != ctx.cls.priority:
            return other.cls.priority < ctx.cls.priority
        return other.cls.name == ctx.cls.name and (not getattr(ctx, "cheap", False) or getattr(other, "cheap", False))


class ServerAdmission:
    def __init__(self, engine, cfg: ServerAdmissionConfig | None = None, clock=time.perf_counter):
        self.cfg = cfg or ServerAdmissionConfig()
        self.clock = clock
        self.router = _EngineRouter(self.cfg.router_config(), engine, clock, self.cfg.cheap_prefill_tokens)
        self.classes = self.router.classes
        self._tickets: dict[str, Ticket] = {}
        self._seq = 0

    @property
    def metrics(self):
        return self.router.metrics

    async def start(self) -> None:
        await self.router.start()

    async def close(self) -> None:
        await self.router.close()

    def workload_class(self, header: str | None, body_value=None) -> WorkloadClass:
        """The request's class: the x-tokenmill-class header, else the body's `workload_class`, else the default."""
        name = header if header is not None else body_value
        if name is None:
            name = self.cfg.default_class
        if not isinstance(name, str) or name not in self.classes:
            raise InvalidRequestError(f"unknown workload class {name!r:.60}; choose from {', '.join(self.classes)}",
                                      param=CLASS_HEADER if header is not None else CLASS_FIELD)
        return self.classes[name]

    async def acquire(self, request_id: str, cls: WorkloadClass, token_ids: list[int], max_tokens: int) -> Ticket:
        """Admit now, or hold in the class queue until admitted; raises router.Refused (429/503)."""
        r = self.router
        if len(self._tickets) + sum(r.queues.depths().values()) >= self.cfg.max_in_flight:
            r.metrics.rejections.labels(cls.name, "overloaded").inc()
            raise Refused("overloaded", 1.0, f"the server has {self.cfg.max_in_flight} requests in flight")
        self._seq += 1
        ctx = ServerCtx(request_id, cls, PromptKey((), True, len(token_ids), 1), len(token_ids), self.clock(),
                        self._seq, max_tokens, token_ids=token_ids)
        flight = await r.acquire(ctx)
        ticket = self._tickets[request_id] = Ticket(ctx, flight, ctx.arrival_s + cls.ttft_slo_s, 0 if ctx.cheap else 1)
        return ticket

    def progress(self, first_token_ids, finished) -> None:
        """Once per engine step: requests that got their first token, and those that finished (id, tokens)."""
        for rid in first_token_ids:
            t = self._tickets.get(rid)
            if t is not None and t.flight.first_token_s is None:
                self.router.first_token(t.ctx, t.flight)
        for rid, n in finished:
            self.release(rid, n)

    def release(self, request_id: str, output_tokens: int = 0) -> None:
        """The request ended (finished, failed, aborted, refused by the engine): its work leaves the books."""
        t = self._tickets.pop(request_id, None)
        self.router.pending.pop(request_id, None)
        if t is not None:
            self.router.finish(t.ctx, t.flight, output_tokens, None)
