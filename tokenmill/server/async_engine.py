"""AsyncEngine: the synchronous LLMEngine in its own thread, driven from an asyncio event loop.

    engine thread:  wait for work -> apply commands (add / abort) -> step() -> post outputs to the loop
    event loop:     add() queues a command and awaits its result; outputs arrive in per-request queues

The engine is touched by the engine thread only. Commands go in through a deque guarded by a condition
(the thread sleeps on it when idle: no busy spin); outputs come back through `loop.call_soon_threadsafe`,
at most one call per step, and only when a streaming request progressed or a request finished: a
non-streaming request costs the event loop nothing until it is done (every thread hand-off of the GIL
costs the engine time on a loaded machine).

Latencies (TTFT, inter-token, end-to-end) are measured in the engine thread right after each step, from
the request's arrival at the server; the engine itself has no clock. The thread passes `now`
(time.perf_counter, the clock of the TTFT deadlines given to `add`) to each step, and a token budget sized
by the step-time model (engine/step_budget.py) to the tightest TPOT SLO among the requests decoding.

`on_progress(first_token_ids, finished)` (optional) is called in the event loop once per step that had a
first token or a finish (with the outputs of that step): how the server's admission control learns
without a call per token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from tokenmill.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.step_budget import StepBudget
from tokenmill.errors import EngineOverloadedError

log = logging.getLogger("tokenmill.server")


def _share_malloc_arena() -> None:
    """glibc gives each new thread its own malloc arena, whose heaps are unmapped when empty: the engine
    thread's per-step activations would page-fault back in on every step (the runner's mallopt settings
    keep freed memory only in the main arena). One arena for the whole process keeps them mapped."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX = 1
    except (OSError, AttributeError):  # not glibc
        pass


class EngineError(Exception):
    """The engine failed this request (step() raised, or the server is shutting down)."""


class RequestStream:
    """The outputs of one request, in order. Raises EngineError on failure."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def next_batch(self) -> list[RequestOutput]:
        """Await the next output, then take those already queued too (one HTTP chunk for several deltas when
        the reader fell behind). [] once finished; raises EngineError if the request failed."""
        if self.finished:
            return []
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outs = []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            outs.append(item)
            if item.finished:
                self.finished = True
                break
        return outs

    def _put(self, item) -> None:
        self._queue.put_nowait(item)


@dataclass
class _Track:
    """Engine-thread state of one request: timing for the metrics, logprobs of a collected request."""

    arrival: float  # perf_counter seconds, when the server received it
    max_tokens: int
    num_prompt_tokens: int
    collect: bool  # deliver only the final output, carrying every token's logprobs
    scheduled_at: float | None = None  # when a step first scheduled it (the end of its waiting phase)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    held: list[RequestOutput] = field(default_factory=list)  # streaming outputs not yet sent (stream_interval)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    track: _Track
    future: asyncio.Future
    ttft_deadline: float | None = None  # time.perf_counter() clock
    tpot_slo_s: float | None = None
    rank: int = 0


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Shared:
    """State both threads touch, guarded by `cond`."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    commands: deque = field(default_factory=deque)
    stopping: bool = False


class AsyncEngine:
    """Wraps an LLMEngine (or anything with its interface). Start with `start()` from inside the loop."""

    def __init__(self, engine, metrics=None, max_pending: int = 4096, stream_interval: int = 1,
                 step_budget: StepBudget | None = None, on_progress=None):
        self.engine = engine
        self.step_budget = step_budget or StepBudget()
        self.on_progress = on_progress  # (first_token_ids, [(request_id, tokens generated)]) in the loop
        self.metrics = metrics  # ServerMetrics or None; thread-safe (prometheus_client)
        self.max_pending = max_pending  # adds queued for the engine thread at most (beyond: overloaded)
        self.stream_interval = max(1, stream_interval)  # streaming: send every N tokens (first and last at once)
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._shared = _Shared()
        self._streams: dict[str, RequestStream] = {}  # loop side: requests in flight
        self._pending_adds = 0  # loop side: adds not yet applied by the engine thread
        self._live: dict[str, _Track] = {}  # engine thread side: requests added and not finished
        self._stats: EngineStats | None = None  # written by the engine thread, read anywhere (atomic swap)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error_count = 0
        self.step_seconds = 0.0  # engine thread: wall time inside engine.step(), cumulative

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        _share_malloc_arena()
        self._loop = asyncio.get_running_loop()
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._shared.cond:
            self._shared.stopping = True
            self._shared.cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._fail(list(self._streams), "the server is shutting down")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- loop side --------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  priority: int = 0, collect: bool = False, ttft_deadline: float | None = None,
                  tpot_slo_s: float | None = None, rank: int = 0) -> RequestStream:
        """Hand a request to the engine. Raises InvalidRequestError / EngineOverloadedError from add_request;
        cancelling the caller while it waits aborts the request. With `collect`, the stream yields only the
        final output (new_text: the whole text; new_logprobs: every token's). `ttft_deadline` is on the
        time.perf_counter() clock."""
        if self._pending_adds >= self.max_pending:
            raise EngineOverloadedError(f"{self._pending_adds} requests are already queued; retry later")
        stream = self._streams[request_id] = RequestStream(request_id)
        track = _Track(time.perf_counter(), params.max_tokens, len(prompt_token_ids), collect)
        future = self._loop.create_future()
        self._pending_adds += 1
        self._send(_Add(request_id, prompt_token_ids, params, priority, track, future, ttft_deadline, tpot_slo_s, rank))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (client gone): its KV blocks are freed before the next step."""
        if self._streams.pop(request_id, None) is not None:
            self._send(_Abort(request_id))

    def num_pending(self) -> int:
        return self._pending_adds

    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats | None:
        return self._stats

    def _send(self, cmd) -> None:
        with self._shared.cond:
            self._shared.commands.append(cmd)
            self._shared.cond.notify()

    def _add_done(self, future: asyncio.Future, error: BaseException | None) -> None:
        self._pending_adds -= 1
        if future.done():  # the caller was cancelled; its abort follows the add in the command queue
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput], firsts: list[str] = (),
                 finished: list[tuple[str, int]] = ()) -> None:
        if (firsts or finished) and self.on_progress is not None:
            try:
                self.on_progress(firsts, finished)
            except Exception:  # noqa: BLE001 - bookkeeping must not stop the outputs
                log.exception("on_progress failed")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by the client meanwhile
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(EngineError(message))

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        busy = False
        while True:
            with self._shared.cond:
                while not busy and not self._shared.commands and not self._shared.stopping:
                    self._shared.cond.wait()
                if self._shared.stopping:
                    break
                commands, self._shared.commands = self._shared.commands, deque()
            try:
                for cmd in commands:
                    self._apply(cmd)
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._step()
                    busy = self.engine.has_unfinished_requests()
                else:
                    self._stats = self.engine.stats()
            except Exception:  # noqa: BLE001 - keep the thread alive; _step handles step() itself
                log.exception("engine thread: unexpected error")
                busy = False
        self._abort_all("abort")

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            if cmd.request_id in self._live:
                self.engine.abort_request(cmd.request_id)
                self._finished(cmd.request_id, "abort", time.perf_counter())
            return
        error = None
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority,
                                    ttft_deadline=cmd.ttft_deadline, tpot_slo_s=cmd.tpot_slo_s, rank=cmd.rank)
            self._live[cmd.request_id] = cmd.track
        except Exception as e:  # noqa: BLE001 - InvalidRequestError / EngineOverloadedError / anything: to caller
            error = e
        self._loop.call_soon_threadsafe(self._add_done, cmd.future, error)

    def _step(self) -> None:
        eng = self.engine
        budget = self.step_budget.token_budget(eng.num_decoding(), eng.tightest_tpot_slo_s(),
                                               eng.config.max_num_batched_tokens)
        t0 = time.perf_counter()
        try:
            outputs = eng.step(now=t0, token_budget=budget)
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine.step() failed; failing %d request(s) in flight", len(self._live))
            self.error_count += 1
            failed = self._abort_all("error")
            self._loop.call_soon_threadsafe(self._fail, failed, f"engine error: {type(e).__name__}: {e}")
            if self.metrics:
                self.metrics.engine_errors.inc()
            return
        finally:
            now = time.perf_counter()
            self.step_seconds += now - t0
        self.step_budget.observe(eng.last_step_decodes, eng.last_step_prefill_tokens, now - t0)
        for rid in self.engine.last_first_scheduled:  # scheduled at the start of the step
            track = self._live.get(rid)
            if track is not None and track.scheduled_at is None:
                track.scheduled_at = t0
        self._stats = self.engine.stats()  # before the outputs reach clients: their counters include this step
        deliver, firsts, finished = [], [], []
        for out in outputs:
            track = self._live.get(out.request_id)
            if track is None:
                continue
            if track.first_token_at is None and out.new_token_ids:
                firsts.append(out.request_id)
            self._observe_tokens(track, len(out.new_token_ids), now)
            if not track.collect:
                track.held.append(out)
                if (out.finished or track.num_generated == len(out.new_token_ids)
                        or sum(len(o.new_token_ids) for o in track.held) >= self.stream_interval):
                    deliver.extend(track.held)
                    track.held = []
            elif out.new_logprobs:
                track.logprobs.extend(out.new_logprobs)
            if out.finished:
                if track.collect:
                    deliver.append(replace(out, new_text=out.text, new_logprobs=track.logprobs or None))
                finished.append((out.request_id, track.num_generated))
                self._finished(out.request_id, out.finish_reason or "stop", now)
        if deliver or (self.on_progress is not None and (firsts or finished)):
            self._loop.call_soon_threadsafe(self._deliver, deliver, firsts, finished)

    def _observe_tokens(self, track: _Track, n: int, now: float) -> None:
        if not n:
            return
        if track.first_token_at is None:
            track.first_token_at = now
            if self.metrics:
                self.metrics.observe_first_token(now - track.arrival)
        elif self.metrics:
            self.metrics.observe_token_gap((now - track.last_token_at) / n)
        track.last_token_at = now
        track.num_generated += n

    def _finished(self, request_id: str, reason: str, now: float) -> None:
        track = self._live.pop(request_id)
        if self.metrics:
            decode_s = now - track.first_token_at if track.first_token_at is not None else None
            self.metrics.observe_finished(reason, now - track.arrival, track.num_prompt_tokens,
                                          track.num_generated, track.max_tokens, decode_s)
            self.metrics.observe_phases(track.arrival, track.scheduled_at, track.first_token_at, now)

    def _abort_all(self, reason: str) -> list[str]:
        rids = list(self._live)
        now = time.perf_counter()
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort after a failure
                log.exception("abort_request(%s) failed", rid)
            self._finished(rid, reason, now)
        return rids
