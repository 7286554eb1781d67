"""AsyncEngine: the synchronous LLMEngine in its own thread, driven from an asyncio event loop.

    engine thread:  wait for work -> apply commands (add / abort) -> step() -> post outputs to the loop
    event loop:     add() queues a command and awaits its result; outputs arrive in per-request queues

The engine is touched by the engine thread only. Commands go in through a deque guarded by a condition
(the thread sleeps on it when idle: no busy spin); outputs come back through `loop.call_soon_threadsafe`,
one call per step. Latencies (TTFT, inter-token, end-to-end) are measured here, on the loop, as the
client would see them; the engine itself has no clock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.outputs import EngineStats, RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import EngineOverloadedError

log = logging.getLogger("tokenmill.server")


class EngineError(Exception):
    """The engine failed this request (step() raised, or the request finished with reason "error")."""


@dataclass
class _Track:
    """Loop-side state of one request."""

    stream: "RequestStream"
    arrival: float  # perf_counter seconds
    max_tokens: int
    num_prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0


class RequestStream:
    """The outputs of one request, in order: `async for out in stream`. Raises EngineError on failure."""

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
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    future: asyncio.Future


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

    def __init__(self, engine, metrics=None, max_pending: int = 4096):
        self.engine = engine
        self.metrics = metrics  # ServerMetrics or None
        self.max_pending = max_pending  # adds queued for the engine thread at most (beyond: overloaded)
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._shared = _Shared()
        self._tracks: dict[str, _Track] = {}  # loop side: requests in flight
        self._pending_adds = 0  # loop side: adds not yet applied by the engine thread
        self._stats: EngineStats | None = None  # written by the engine thread, read anywhere (atomic swap)
        self._live: set[str] = set()  # engine thread side: requests added and not finished
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error_count = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
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
        for rid in list(self._tracks):
            self._finish_track(rid, "abort", EngineError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- loop side --------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  priority: int = 0) -> RequestStream:
        """Hand a request to the engine. Raises InvalidRequestError / EngineOverloadedError from add_request;
        cancelling the caller while it waits aborts the request."""
        if self._pending_adds >= self.max_pending:
            raise EngineOverloadedError(f"{self._pending_adds} requests are already queued; retry later")
        stream = RequestStream(request_id)
        self._tracks[request_id] = _Track(stream, time.perf_counter(), params.max_tokens, len(prompt_token_ids))
        future = self._loop.create_future()
        self._pending_adds += 1
        self._send(_Add(request_id, prompt_token_ids, params, priority, future))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._tracks.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (client gone): its KV blocks are freed before the next step."""
        if request_id in self._tracks:
            self._finish_track(request_id, "abort", None)
            self._send(_Abort(request_id))

    def num_pending(self) -> int:
        return self._pending_adds

    def num_in_flight(self) -> int:
        return len(self._tracks)

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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:  # aborted by the client meanwhile
                continue
            n = len(out.new_token_ids)
            if n:
                if track.first_token_at is None:
                    track.first_token_at = now
                    if self.metrics:
                        self.metrics.observe_first_token(now - track.arrival)
                elif self.metrics:
                    self.metrics.observe_token_gap((now - track.last_token_at) / n)
                track.last_token_at = now
                track.num_generated += n
            track.stream._put(out)
            if out.finished:
                self._finish_track(out.request_id, out.finish_reason or "stop", None, now)

    def _fail(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self._finish_track(rid, "error", EngineError(message))

    def _finish_track(self, request_id: str, reason: str, error: BaseException | None,
                      now: float | None = None) -> None:
        track = self._tracks.pop(request_id, None)
        if track is None:
            return
        if error is not None:
            track.stream._put(error)
        if self.metrics:
            now = now or time.perf_counter()
            decode_s = now - track.first_token_at if track.first_token_at is not None else None
            self.metrics.observe_finished(reason, now - track.arrival, track.num_prompt_tokens,
                                          track.num_generated, track.max_tokens, decode_s)

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
                self._stats = self.engine.stats()
            except Exception:  # noqa: BLE001 - keep the thread alive; _step handles step() itself
                log.exception("engine thread: unexpected error")
                busy = False
        self._abort_all()

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            if cmd.request_id in self._live:
                self._live.discard(cmd.request_id)
                self.engine.abort_request(cmd.request_id)
            return
        error = None
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority)
            self._live.add(cmd.request_id)
        except Exception as e:  # noqa: BLE001 - InvalidRequestError / EngineOverloadedError / anything: to caller
            error = e
        self._loop.call_soon_threadsafe(self._add_done, cmd.future, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine.step() failed; failing %d request(s) in flight", len(self._live))
            self.error_count += 1
            failed = list(self._live)
            self._abort_all()
            self._loop.call_soon_threadsafe(self._fail, failed, f"engine error: {type(e).__name__}: {e}")
            if self.metrics:
                self.metrics.engine_errors.inc()
            return
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _abort_all(self) -> None:
        for rid in list(self._live):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort after a failure
                log.exception("abort_request(%s) failed", rid)
        self._live.clear()
