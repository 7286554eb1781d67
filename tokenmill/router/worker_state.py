"""What the router knows about each worker: work it has sent there, learned speeds, reported gauges.

Leading indicators are counted here, at the moment the router sends work, not when the worker reports:

    outstanding     requests sent and not finished
    prefill_tokens  uncached prompt tokens sent whose first token has not come back
    prefill_requests  requests sent whose first token has not come back
    decode_streams  requests past their first token and not finished

The TTFT calibration is an EWMA of observed / modelled TTFT (clipped to [0.5, 4]; predictions under 50 ms
are skipped): what the queue model misses (step granularity, CPU contention, traffic from other clients).

    decode_tokens   output tokens still to come for them (sum of max_tokens - tokens seen)

Each change of pending prefill advances the worker's busy clock; each first token adds one request and
its uncached tokens to the prefill work done, and tells the fit what is still pending (rates.PrefillFit:
per-request overhead + tokens / rate, windows closed when the pending prefill drains);
streamed tokens feed the decode rate (rates.ServiceRate). At each finish the TPOT fit learns (decode streams ->
observed TPOT). All methods take `now`; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.router.rates import Ewma, RatePriors, WorkerRates
from tokenmill.router.snapshot import WorkerView, new_view

WORKER_KINDS = ("auto", "tokenmill", "vllm", "sglang", "openai")
MIN_CALIBRATION, MAX_CALIBRATION = 0.5, 4.0
CALIBRATE_ABOVE_S = 0.05  # shorter predictions are mostly noise
CALIBRATE_AFTER_SAMPLES = 0  # predictions made on the prior rate calibrate too: under sustained load the
# prefill fit may never leave its prior (no busy period ends), and then the calibration is the only correction
CALIBRATION_ALPHA = 0.2  # per calibrating first token: a new bias is half-corrected after ~3 of them
ERROR_STEP = 0.05  # quantile trackers of observed / predicted TTFT: step per first token (ratio units)
ERROR_HI = (0.9, 1.5, 1.0, 4.0)  # (quantile, prior, min, max): how short a prediction usually falls
ERROR_LO = (0.1, 0.5, 0.25, 1.0)  # how long a prediction usually overshoots
ERROR_FLOOR_S = 0.1  # ratios of max(observed, 0.1 s) / max(predicted, 0.1 s): 20 vs 40 ms is no error for an SLO
SLO_MISS_TARGET = 0.03  # the share of admitted requests allowed to miss their TTFT deadline (the margin steers to it)
SLO_MARGIN_STEP = 0.1  # log-step per first token: a miss widens the margin ~10%, ~33 met deadlines undo one miss
SLO_MARGIN = (1.0, 1.0, 3.0)  # (prior, min, max) of the multiplier on the band's upper end


@dataclass(frozen=True)
class WorkerSpec:
    url: str  # base URL, e.g. http://127.0.0.1:8001 (no trailing /v1)
    kind: str = "auto"  # auto: detected from the worker's /metrics names

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {self.url!r} must start with http:// or https://")
        if self.url.rstrip("/").endswith("/v1"):
            raise ValueError(f"worker URL {self.url!r}: give the base URL, without /v1")
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"worker kind {self.kind!r} unknown; choose from {', '.join(WORKER_KINDS)}")

    @classmethod
    def parse(cls, text: str) -> "WorkerSpec":
        """`URL` or `KIND=URL` (e.g. `vllm=http://10.0.0.2:8000`)."""
        kind, sep, url = text.partition("=")
        if not sep or kind.startswith("http"):
            kind, url = "auto", text
        return cls(url.rstrip("/"), kind)


@dataclass
class InFlight:
    """One attempt of one request on one worker."""

    request_id: str
    worker: str
    uncached_tokens: int
    work_ahead_tokens: int  # prefill tokens queued there at send time, own included
    predicted_ttft_s: float
    sent_s: float
    first_token_s: float | None = None
    prefill_done: bool = False
    decode_streams_at_first: int = 0
    ttft_deadline_s: float = float("inf")  # arrival + the class's TTFT SLO
    calibration_at_send: float = 1.0
    rate_samples_at_send: int = 0
    decode_left: int = 0  # output tokens still expected (max_tokens - seen)
    hit_chunks: int = 0  # prefix chunks the index expected cached there (for the correction)
    hit_tokens: int = 0
    prompt_tokens: int = 0  # the whole prompt, cached part included (what a waiting request weighs in the gauge)


class WorkerState:
    # The pool's set of changed workers (WorkerPool.changed), attached once the worker joins a pool: every
    # attribute write adds the URL (each mutating method below writes one of its own attributes, also when it
    # updates its rates, calibration or error trackers), so a routing table re-reads only the workers that
    # changed (router/worker_table.py). None: not watched.
    _changed: set | None = None
    _draining: set | None = None  # the pool's WorkerPool.draining: URLs whose `draining` was set (reap looks there)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        changed = self._changed
        if changed is not None:
            changed.add(self.url)
            if name == "draining" and value:
                self._draining.add(self.url)

    def __init__(self, spec: WorkerSpec, priors: RatePriors):
        self.url = spec.url
        self.kind = spec.kind
        self.healthy = False  # until the first health check passes
        self.draining = False
        self.failures = 0  # consecutive failed health checks
        self.rates = WorkerRates(priors)
        self.observed_ttft = Ewma(0.2)
        self.calibration = Ewma(CALIBRATION_ALPHA)  # observed / modelled TTFT
        self.ttft_error_hi = QuantileTracker(*ERROR_HI, step=ERROR_STEP)  # ~p90 of observed / predicted TTFT
        self.ttft_error_lo = QuantileTracker(*ERROR_LO, step=ERROR_STEP)  # ~p10
        self.slo_margin = MissRateMargin(SLO_MISS_TARGET, *SLO_MARGIN, step=SLO_MARGIN_STEP)
        self.outstanding = 0
        self.prefill_tokens = 0
        self.prefill_prompt_tokens = 0  # whole prompts (cached part included) of the pending attempts
        self._pending: dict[int, InFlight] = {}  # attempts whose prefill is pending, by id()
        self._min_deadline: float | None = None  # least ttft_deadline_s in _pending (None: to be recomputed)
        self.decode_streams = 0
        self.decode_tokens = 0
        self.reported_running: int | None = None
        self.reported_waiting: int | None = None
        self.kv_usage: float | None = None
        self.external_prefill_tokens = 0  # queued prefill the worker reported beyond this router's (last scrape)
        self.models: list[str] = []

    @property
    def ttft_calibration(self) -> float:
        return self.calibration.value or 1.0

    @property
    def sends_priority_field(self) -> bool:
        return self.kind == "tokenmill"  # vLLM rejects `priority` unless priority scheduling is on

    def start(self, request_id: str, uncached_tokens: int, predicted_ttft_s: float, now: float,
              ttft_deadline_s: float = float("inf"), max_tokens: int = 16, prompt_tokens: int | None = None) -> InFlight:
        self.rates.prefill.advance(now, busy=bool(self._pending))
        prompt_tokens = max(uncached_tokens, prompt_tokens if prompt_tokens is not None else uncached_tokens)
        self.outstanding += 1
        self.prefill_tokens += uncached_tokens
        self.prefill_prompt_tokens += prompt_tokens
        self.decode_tokens += max_tokens
        f = InFlight(request_id, self.url, uncached_tokens, self.prefill_tokens, predicted_ttft_s, now,
                     ttft_deadline_s=ttft_deadline_s, calibration_at_send=self.ttft_calibration,
                     rate_samples_at_send=self.rates.prefill.samples,
                     decode_left=max_tokens, prompt_tokens=prompt_tokens)
        if self._min_deadline is not None or not self._pending:
            self._min_deadline = ttft_deadline_s if not self._pending else min(self._min_deadline, ttft_deadline_s)
        self._pending[id(f)] = f
        return f

    def end_prefill(self, f: InFlight, now: float, served: bool = True) -> None:
        """The prompt of `f` is no longer pending: prefilled (`served`), or its attempt failed."""
        if not f.prefill_done:
            f.prefill_done = True
            busy = bool(self._pending)
            self.prefill_tokens -= f.uncached_tokens
            self.prefill_prompt_tokens -= f.prompt_tokens
            if self._pending.pop(id(f), None) is not None and self._min_deadline is not None \
                    and f.ttft_deadline_s <= self._min_deadline:
                self._min_deadline = None  # the least one left: recomputed when a view needs it
            self.rates.prefill.done(f.uncached_tokens if served else 0, now, busy=busy,
                                    requests=1 if served else 0, pending_requests=len(self._pending),
                                    pending_tokens=max(0, self.prefill_tokens))

    def first_token(self, f: InFlight, now: float) -> float:
        """Record an observed first token; returns the observed TTFT (s)."""
        self.end_prefill(f, now)
        f.first_token_s = now
        self._take_decode(f, 1)  # the prefill step made the first token
        self.rates.decode.advance(now, busy=self.decode_streams > 0)
        self.decode_streams += 1
        f.decode_streams_at_first = self.decode_streams
        ttft_s = now - f.sent_s
        self.observed_ttft.update(ttft_s)
        ratio = max(ttft_s, ERROR_FLOOR_S) / max(f.predicted_ttft_s, ERROR_FLOOR_S)
        self.ttft_error_hi.update(ratio)
        self.ttft_error_lo.update(ratio)
        if f.ttft_deadline_s != float("inf"):
            self.slo_margin.update(missed=now > f.ttft_deadline_s)
        modelled_s = f.predicted_ttft_s / f.calibration_at_send
        if modelled_s >= CALIBRATE_ABOVE_S and f.rate_samples_at_send >= CALIBRATE_AFTER_SAMPLES:
            self.calibration.update(min(MAX_CALIBRATION, max(MIN_CALIBRATION, ttft_s / modelled_s)))
        return ttft_s

    def tokens(self, f: InFlight, n: int, now: float) -> None:
        """`n` more output tokens of `f` streamed back (after its first)."""
        self._take_decode(f, n)
        self.rates.decode.done(n, now, busy=self.decode_streams > 0)

    def _take_decode(self, f: InFlight, n: int) -> None:
        n = min(n, f.decode_left)
        f.decode_left -= n
        self.decode_tokens -= n

    def finish(self, f: InFlight, now: float, output_tokens: int) -> float | None:
        """The attempt ended (either way); returns the observed TPOT (s) when there is one."""
        self.end_prefill(f, now, served=False)
        self._take_decode(f, f.decode_left)
        self.outstanding -= 1
        if f.first_token_s is None:
            return None
        streams = (f.decode_streams_at_first + self.decode_streams) / 2
        self.rates.decode.advance(now, busy=True)
        self.decode_streams -= 1
        if output_tokens < 2:
            return None
        tpot_s = (now - f.first_token_s) / (output_tokens - 1)
        self.rates.tpot.update(streams, tpot_s)
        return tpot_s

    def report_queued_prefill(self, reported_tokens: int | None) -> None:
        """The worker's own gauge of prompt tokens queued there for prefill (tokenmill workers). What exceeds
        the prompts this router has pending there came from elsewhere (other routers, direct clients): it is
        counted as queued work until the next scrape.

        The gauge counts a *waiting* request's whole prompt: its prefix-cache hit is only looked up when the
        scheduler admits it. So the router subtracts its pending requests' whole prompts, not their uncached
        tokens: subtracting the uncached estimate counted the cached part of each of its own waiting
        requests as someone else's work (on shared system prompts ~1000 tokens per request, held for a whole
        scrape interval). The router's whole-prompt count is ≥ what the gauge can hold of its requests
        (running ones count only their unprefilled rest there), so its own work is never counted twice; the
        price is that others' work can be under-counted while the router has prompts pending there."""
        mine = max(0, self.prefill_prompt_tokens)
        self.external_prefill_tokens = max(0, reported_tokens - mine) if reported_tokens else 0

    def view(self, cached_prefix_tokens: int = 0, now: float | None = None) -> WorkerView:
        r = self.rates
        prefill, tpot = r.prefill, r.tpot  # (the fields WorkerRates' properties read: a view per worker per decision)
        pending = self._pending
        deadline = None
        if pending:  # (kept up to date by start / end_prefill: one scan per change of the least, not per view)
            if self._min_deadline is None:
                self._min_deadline = min([f.ttft_deadline_s for f in pending.values()])
            deadline = self._min_deadline
        slack = None if deadline is None or now is None or deadline == math.inf else deadline - now
        return new_view(
            self.url, healthy=self.healthy, outstanding=self.outstanding,
            prefill_tokens=max(0, self.prefill_tokens), prefill_requests=len(pending), decode_streams=self.decode_streams,
            decode_tokens=max(0, self.decode_tokens), decode_rate_tps=r.decode.tps,
            cached_prefix_tokens=cached_prefix_tokens, ttft_base_s=prefill.overhead_s, prefill_rate_tps=prefill.rate_tps,
            ttft_calibration=self.ttft_calibration, tpot_base_s=tpot.a, tpot_per_stream_s=tpot.b,
            rate_samples=prefill.samples,
            reported_running=self.reported_running, reported_waiting=self.reported_waiting, kv_usage=self.kv_usage,
            observed_ttft_s=self.observed_ttft.value, draining=self.draining, pending_slack_s=slack,
            external_prefill_tokens=self.external_prefill_tokens, ttft_error_hi=self.ttft_error_hi.value, ttft_error_lo=self.ttft_error_lo.value,
            ttft_slo_margin=self.slo_margin.value,
        )


class QuantileTracker:
    """Online quantile (stochastic approximation) with a prior and a clip: each sample above the estimate moves
    it up by step·q, each one below down by step·(1 − q), so it settles where a share q of recent samples
    lies below (memory ~1 / step samples)."""

    def __init__(self, q: float, prior: float, lo: float, hi: float, step: float):
        self.q, self.lo, self.hi, self.step = q, lo, hi, step
        self.value = prior
        self.samples = 0

    def update(self, x: float) -> None:
        move = self.step * (self.q if x > self.value else self.q - 1.0)
        self.value = min(self.hi, max(self.lo, self.value + move))
        self.samples += 1


class MissRateMargin:
    """A multiplier k on the error band's upper end, steered by outcomes rather than by ratios: each admitted
    request that misses its TTFT deadline (arrival + SLO, router hold included) multiplies k by
    exp(step·(1 − target)), each one that meets it by exp(−step·target), so k settles where a share `target`
    of admitted requests miss. With the band's ~p90 alone 6–11% of accepted requests missed their SLO
    past saturation (single large errors; a fixed quantile does not know how many admitted requests sit
    near their budget). Below saturation nothing misses and k stays at its floor (1: the band alone decides)."""

    def __init__(self, target: float, prior: float, lo: float, hi: float, step: float):
        self.target, self.lo, self.hi, self.step = target, lo, hi, step
        self.value = prior
        self.samples = 0

    def update(self, missed: bool) -> None:
        self.value = min(self.hi, max(self.lo, self.value * math.exp(self.step * (float(missed) - self.target))))
        self.samples += 1


class WorkerPool:
    """The workers, in the order they were added; removed ones drain (no new work) and then disappear."""

    def __init__(self, priors: RatePriors):
        self.priors = priors
        self._workers: dict[str, WorkerState] = {}
        self.changed: set[str] = set()  # URLs of workers whose state changed (WorkerState.__setattr__)
        self.draining: set[str] = set()  # URLs of workers set draining (reap checks only these, not every worker)
        self.version = 0  # bumped when a worker joins or leaves (the order of the pool changes)

    def __iter__(self):
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, url: str) -> WorkerState | None:
        return self._workers.get(url)

    def add(self, spec: WorkerSpec) -> WorkerState:
        w = self._workers.get(spec.url)
        if w is not None:
            w.draining = False
            return w
        w = self._workers[spec.url] = WorkerState(spec, self.priors)
        w._draining = self.draining
        w._changed = self.changed
        self.changed.add(w.url)
        self.version += 1
        return w

    def remove(self, url: str) -> bool:
        w = self._workers.get(url)
        if w is None:
            return False
        w.draining = True
        self.reap()
        return True

    def reap(self) -> list[str]:
        """Forget draining workers with nothing in flight; returns their URLs."""
        if not self.draining:
            return []
        gone = set()
        for u in list(self.draining):
            w = self._workers.get(u)
            if w is None or not w.draining:
                self.draining.discard(u)
            elif w.outstanding == 0:
                gone.add(u)
                self.draining.discard(u)
        if not gone:
            return []
        order = [u for u in self._workers if u in gone]  # in pool order
        for u in order:
            del self._workers[u]
        self.version += 1
        return order
