"""AsyncEngine: the server's front-end to the engine core, driven from an asyncio event loop.

    core (process or thread):  wait for work -> apply commands (adds / aborts) -> step() -> one StepResult
    event loop:                add() sends a command and awaits its result; each StepResult is turned into
                               per-request outputs (queues), latency metrics and admission progress

The core is server/engine_core.py's EngineCore. Two transports, one front-end:
- process (`tokenmill serve`'s default; `engine` is an EngineProcess): commands leave as one frame per
  event-loop iteration over a socketpair, StepResults come back one frame per step and are read by the
  event loop itself (asyncio streams: no thread, no GIL hand-off). The core sends token ids only: this side
  detokenizes and applies stop strings (engine/output_processor.py) and aborts in the core each request a
  stop string ended (in its next command frame). If the core process dies, every request in flight ends
  with EngineError, `alive` turns False and `on_core_exit` is called (the server exits non-zero).
- thread (`--engine-process off`, and tests over a fake engine; `engine` is an LLMEngine or anything with
  its interface): the core runs in a thread; commands go in through a deque guarded by a condition (the
  thread sleeps on it when idle), each StepResult comes back through `loop.call_soon_threadsafe`. The
  engine there makes its own text (LLMEngine's step() runs the same OutputProcessor class).

Latencies (TTFT, inter-token, end-to-end) are measured from the request's arrival at the server to the
step's end time the core reports (time.perf_counter: CLOCK_MONOTONIC, one clock for both processes; the
engine itself has no clock). The core sizes each step's token budget with the step-time model
(engine/step_budget.py) to the tightest TPOT SLO among the requests decoding.

`on_progress(first_token_ids, finished)` (optional) is called in the event loop once per step that had a
first token or a finish: how the server's admission control learns without a call per token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.step_budget import StepBudget
from tokenmill.errors import EngineOverloadedError
from tokenmill.server.engine_core import (
    _HEADER, AbortCmd, AddCmd, EngineCore, StepResult, StopCmd, frame,
)

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
    """Front-end state of one request: timing for the metrics, logprobs of a collected request."""

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
class _Shared:
    """Thread transport: state both threads touch, guarded by `cond`."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    commands: deque = field(default_factory=deque)
    stopping: bool = False
    adds_taken: int = 0  # adds the thread took off `commands` (the loop counts those it put there)


class AsyncEngine:
    """Wraps an EngineProcess (process transport) or an engine object (thread transport). Start with
    `await start()` from inside the loop."""

    def __init__(self, engine, metrics=None, max_pending: int = 4096, stream_interval: int = 1,
                 step_budget: StepBudget | None = None, on_progress=None, on_core_exit=None):
        self.engine = engine
        self.in_process = getattr(engine, "in_process", True)  # False: an EngineProcess
        self.step_budget = step_budget or StepBudget()  # thread transport (a core process has its own)
        self.on_progress = on_progress  # (first_token_ids, [(request_id, tokens generated)]) in the loop
        self.on_core_exit = on_core_exit  # (message) in the loop, once, if the core dies
        self.metrics = metrics  # ServerMetrics or None
        self.max_pending = max_pending  # adds sent to the core and not yet applied, at most (beyond: overloaded)
        self.stream_interval = max(1, stream_interval)  # streaming: send every N tokens (first and last at once)
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.vocab_size: int | None = getattr(getattr(engine, "model_config", None), "vocab_size", None) or getattr(
            engine, "vocab_size", None) or getattr(engine.tokenizer, "vocab_size", None)  # checked before hashing
        self._streams: dict[str, RequestStream] = {}  # requests in flight
        self._adding: dict[str, asyncio.Future] = {}  # adds sent, their result not back yet
        self._live: dict[str, _Track] = {}  # requests added and not finished (metrics)
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None  # why the core is gone
        self._stopping = False
        self.error_count = 0
        self.step_seconds = 0.0  # wall time inside engine.step(), cumulative
        self.num_results = 0  # StepResults received
        self._adds_sent = 0
        self.frames_sent = 0  # process transport: command frames written
        # thread transport
        self._shared = _Shared()
        self._thread: threading.Thread | None = None
        # process transport
        self._outbox: list = []
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        # the core process sends token ids: text and stop strings are made here (a local engine makes its own)
        self.output_processor = None if self.in_process else OutputProcessor(engine.tokenizer)
        self.stop_aborts = 0  # requests a stop string ended here, aborted in the core

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.in_process:
            _share_malloc_arena()
            self._stats = self.engine.stats()
            core = EngineCore(self.engine, self.step_budget)
            self._thread = threading.Thread(target=self._run_thread, args=(core,), name="tokenmill-engine",
                                            daemon=True)
            self._thread.start()
            return
        self._stats = self.engine.hello.stats
        reader, self._writer = await asyncio.open_connection(sock=self.engine.sock)
        self._reader_task = asyncio.create_task(self._read_results(reader))

    async def shutdown(self) -> None:
        """Stop the core (aborting what is left) and fail the requests still in flight."""
        self._stopping = True
        if self.in_process:
            with self._shared.cond:
                self._shared.stopping = True
                self._shared.cond.notify()
            if self._thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        else:
            if self._dead is None and self._writer is not None:
                try:
                    self._writer.write(frame([StopCmd()]))
                    await self._writer.drain()
                except (ConnectionError, OSError):
                    pass
            await asyncio.get_running_loop().run_in_executor(None, self.engine.wait, 30)
            if self._reader_task is not None:
                self._reader_task.cancel()
            if self._writer is not None:
                self._writer.close()
            self.engine.close()
        self.fail_all("the server is shutting down")

    @property
    def alive(self) -> bool:
        if self.in_process:
            return self._thread is not None and self._thread.is_alive()
        return self._dead is None and self._reader_task is not None and not self._reader_task.done()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # -- requests ---------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  priority: int = 0, collect: bool = False, ttft_deadline: float | None = None,
                  tpot_slo_s: float | None = None, rank: int = 0) -> RequestStream:
        """Hand a request to the engine. Raises InvalidRequestError / EngineOverloadedError from add_request,
        EngineError if the core is gone; cancelling the caller while it waits aborts the request. With
        `collect`, the stream yields only the final output (new_text: the whole text; new_logprobs: every
        token's). `ttft_deadline` is on the time.perf_counter() clock."""
        if self._dead is not None:
            raise EngineError(self._dead)
        if self.num_pending() >= self.max_pending:
            raise EngineOverloadedError(f"{self.num_pending()} requests are already queued; retry later")
        stream = self._streams[request_id] = RequestStream(request_id)
        self._live[request_id] = _Track(time.perf_counter(), params.max_tokens, len(prompt_token_ids), collect)
        future = self._adding[request_id] = self._loop.create_future()
        self._adds_sent += 1
        if self.output_processor is not None:
            self.output_processor.add(request_id, params)
        self._send(AddCmd(request_id, prompt_token_ids, params, priority, ttft_deadline, tpot_slo_s, rank,
                          time.perf_counter()))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            if self.output_processor is not None:
                self.output_processor.forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (client gone): its KV blocks are freed before the next step."""
        if self.output_processor is not None:
            self.output_processor.forget(request_id)
        if self._streams.pop(request_id, None) is not None:
            if request_id in self._live:
                self._finished(request_id, "abort", time.perf_counter())
            if self._dead is None:
                self._send(AbortCmd(request_id))

    def num_pending(self) -> int:
        """Adds not yet applied by the core (process transport: not yet reported applied, so those of the
        step running now count too)."""
        if self.in_process:
            return self._adds_sent - self._shared.adds_taken
        return len(self._adding)

    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats | None:
        return self._stats

    def fail_all(self, message: str) -> None:
        """End every request in flight with EngineError(message) (shutdown, drain timeout, core death)."""
        rids = set(self._streams) | set(self._adding)
        if self.output_processor is not None:
            for rid in rids:
                self.output_processor.forget(rid)
        for rid, fut in list(self._adding.items()):
            if not fut.done():
                fut.set_exception(EngineError(message))
        self._adding.clear()
        now = time.perf_counter()
        for rid in list(self._live):
            self._finished(rid, "abort" if self._dead is None else "error", now)
        self._fail(list(self._streams), message)
        if self._dead is None and not self._stopping:
            for rid in rids:
                self._send(AbortCmd(rid))

    def _send(self, cmd) -> None:
        if self.in_process:
            with self._shared.cond:
                self._shared.commands.append(cmd)
                self._shared.cond.notify()
            return
        if not self._outbox:
            self._loop.call_soon(self._flush)  # everything issued in this loop iteration: one frame
        self._outbox.append(cmd)

    def _flush(self) -> None:
        cmds, self._outbox = self._outbox, []
        if cmds and self._dead is None:
            self._writer.write(frame(cmds))
            self.frames_sent += 1

    # -- results ----------------------------------------------------------------------------------
    def _on_result(self, res: StepResult) -> None:
        """One StepResult, in the loop: add results, outputs to their streams, metrics, admission progress."""
        self.num_results += 1
        for rid, err in res.added:
            fut = self._adding.pop(rid, None)
            if fut is None or fut.done():  # the caller was cancelled; its abort followed the add
                continue
            if err is None:
                fut.set_result(None)
            else:
                self._live.pop(rid, None)
                fut.set_exception(err.exception())
        if res.stats is not None:
            self._stats = res.stats
        if not res.stepped:
            return
        now = res.t1
        self.step_seconds += res.t1 - res.t0
        if res.failed:
            self.error_count += 1
            if self.metrics:
                self.metrics.engine_errors.inc()
            for rid in res.failed:
                if self.output_processor is not None:
                    self.output_processor.forget(rid)
                if rid in self._live:
                    self._finished(rid, "error", now)
            self._fail(res.failed, res.fail_message or "engine error")
        for rid in res.first_scheduled:  # scheduled at the start of the step
            track = self._live.get(rid)
            if track is not None and track.scheduled_at is None:
                track.scheduled_at = res.t0
        outputs = res.outputs
        if self.output_processor is not None and outputs:
            outputs, stopped = self.output_processor.process_step(outputs)
            for rid in stopped:  # a stop string ended it here: the core frees its KV before its next step
                self.stop_aborts += 1
                self._send(AbortCmd(rid))
        deliver, firsts, finished = [], [], []
        for out in outputs:
            track = self._live.get(out.request_id)
            if track is None:  # aborted meanwhile
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
        if (firsts or finished) and self.on_progress is not None:
            try:
                self.on_progress(firsts, finished)
            except Exception:  # noqa: BLE001 - bookkeeping must not stop the outputs
                log.exception("on_progress failed")
        for out in deliver:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(EngineError(message))

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

    # -- process transport ------------------------------------------------------------------------
    async def _read_results(self, reader: asyncio.StreamReader) -> None:
        import pickle

        why = None
        try:
            while True:
                head = await reader.readexactly(_HEADER.size)
                res = pickle.loads(await reader.readexactly(_HEADER.unpack(head)[0]))
                if res.kv_events:
                    self.engine.mirror.apply(res.kv_events)
                self._on_result(res)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            why = type(e).__name__
        except Exception as e:  # noqa: BLE001 - a frame we cannot read: the core is unusable
            log.exception("bad frame from the engine core")
            why = f"{type(e).__name__}: {e}"
        if self._stopping:
            return
        code = await asyncio.get_running_loop().run_in_executor(None, self.engine.wait, 5)
        self._core_died(f"the engine core process exited (code {code}, {why})")

    def _core_died(self, message: str) -> None:
        log.error("%s; failing %d request(s) in flight", message, len(self._streams) + len(self._adding))
        self._dead = message
        self.fail_all(message)
        if self.metrics:
            self.metrics.engine_errors.inc()
        if self.on_core_exit is not None:
            self.on_core_exit(message)

    # -- thread transport -------------------------------------------------------------------------
    def _run_thread(self, core: EngineCore) -> None:
        busy = False
        while True:
            with self._shared.cond:
                while not busy and not self._shared.commands and not self._shared.stopping:
                    self._shared.cond.wait()
                if self._shared.stopping:
                    break
                commands, self._shared.commands = self._shared.commands, deque()
                self._shared.adds_taken += sum(1 for c in commands if isinstance(c, AddCmd))
            try:
                res = core.run_once(commands)
            except Exception:  # noqa: BLE001 - keep the thread alive; run_once handles step() itself
                log.exception("engine thread: unexpected error")
                busy = False
                continue
            busy = res.busy
            self._loop.call_soon_threadsafe(self._on_result, res)
        core.abort_all()
