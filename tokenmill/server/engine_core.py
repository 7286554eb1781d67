"""EngineCore: the loop that owns an LLMEngine (scheduler + runner + KV) and runs its steps.

    one iteration:  apply the commands that arrived (adds, aborts, in order) -> step() if a request is
                    unfinished -> one StepResult (add results, outputs, stats, KV events, timing)

Under `tokenmill serve` it runs in its own process (`main()` below: `python -m tokenmill.server.engine_core
--fd N`, N a socket to the server's front-end), so the model's steps never contend for the front-end's GIL;
with `--engine-process off` (and in tests over the fake engine) the same loop runs in a thread of the
server. The front-end is server/async_engine.py either way.

Wire (process mode): length-prefixed pickle frames over a socketpair. Front-end -> core: a CoreSetup
first, then lists of commands (everything the front-end issued in one event-loop iteration is one frame;
the core drains every frame that has arrived before each step, so each step applies one batch). Core ->
front-end: a CoreHello (or CoreFailed) once the model is loaded, then exactly one StepResult per loop
iteration. Outputs of requests still running carry their deltas only (`text`, `output_token_ids` empty):
what crosses the boundary per step grows with the batch, not with the tokens generated so far.

The core process makes no text (LLMEngine(detokenize=False)): its outputs carry token ids (and logprobs),
and it finishes requests only for what needs no text (EOS, stop token ids, max_tokens, the context length).
The front-end detokenizes, applies stop strings (engine/output_processor.py) and sends an AbortCmd for each
request a stop string ended, in its next command frame.

The core stops on a StopCmd (after aborting what is left) or when the front-end's end of the socket
closes (the server died): no orphan engine. It ignores SIGINT/SIGTERM: the front-end owns the life cycle
(a Ctrl-C or a SIGTERM to the process group drains through the front-end, which then stops the core).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import socket
import struct
import time
from dataclasses import dataclass, field

from tokenmill.engine.outputs import EngineStats, RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.step_budget import StepBudget, StepBudgetConfig
from tokenmill.errors import EngineOverloadedError, InvalidRequestError

log = logging.getLogger("tokenmill.engine_core")

_HEADER = struct.Struct("!Q")


# -- messages ---------------------------------------------------------------------------------------
@dataclass
class AddCmd:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    ttft_deadline: float | None = None  # time.perf_counter() clock (CLOCK_MONOTONIC: the same in both processes)
    tpot_slo_s: float | None = None
    rank: int = 0
    sent_t: float | None = None  # time.perf_counter() when the front-end handed it over (the step trace's `enq`)


@dataclass
class AbortCmd:
    request_id: str


@dataclass
class StopCmd:
    pass


@dataclass
class CoreSetup:
    """The first frame to a core process: what to build."""

    engine_config: object  # EngineConfig
    step_budget: StepBudgetConfig = field(default_factory=StepBudgetConfig)
    kv_events: bool = True  # ship prefix-cache changes (the front-end's admission mirrors the cache)
    log_level: str = "WARNING"


@dataclass
class CoreHello:
    """The core's first frame: the model loaded; what the front-end needs to serve it."""

    pid: int
    model_name: str
    model_path: str
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    vocab_size: int
    description: str
    stats: EngineStats


@dataclass
class CoreFailed:
    message: str  # the engine could not be built (ModelLoadError...): shown to the user as is


@dataclass
class AddError:
    kind: str  # "invalid" | "overloaded" | "error"
    message: str
    param: str | None = None

    @classmethod
    def of(cls, e: BaseException) -> AddError:
        if isinstance(e, InvalidRequestError):
            return cls("invalid", str(e), e.param)
        if isinstance(e, EngineOverloadedError):
            return cls("overloaded", str(e))
        return cls("error", f"{type(e).__name__}: {e}")

    def exception(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.message, self.param)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message)
        return RuntimeError(self.message)


@dataclass
class StepResult:
    """One loop iteration of the core, for the front-end."""

    added: list[tuple[str, AddError | None]] = field(default_factory=list)  # every add applied, in order
    outputs: list[RequestOutput] = field(default_factory=list)
    stepped: bool = False
    t0: float = 0.0  # perf_counter at the step's start (the requests in first_scheduled left the queue then)
    t1: float = 0.0  # ... and at its end (the outputs' tokens exist from then)
    first_scheduled: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # step() raised: these requests were aborted
    fail_message: str | None = None
    stats: EngineStats | None = None
    busy: bool = False  # requests are unfinished: the core steps again without waiting for commands
    kv_events: list[int] = field(default_factory=list)  # stored hash (>= 0) or ~evicted hash, in order


# -- the loop ---------------------------------------------------------------------------------------
class EngineCore:
    """Applies commands and steps an engine (LLMEngine or anything with its interface); no I/O here."""

    def __init__(self, engine, step_budget: StepBudget | None = None, slim_outputs: bool = False,
                 kv_events: bool = False):
        self.engine = engine
        self.step_budget = step_budget or StepBudget()
        self.slim_outputs = slim_outputs
        self.live: set[str] = set()  # added and not finished
        pool = getattr(getattr(engine, "kv", None), "pool", None)
        self._pool = pool if kv_events and hasattr(pool, "events") else None
        if self._pool is not None:
            self._pool.events = []
        # diagnostics: TOKENMILL_STEP_TRACE=FILE ({pid}: the process id) appends one JSON line per step: its
        # start and end (perf_counter), the process CPU seconds it used (2 busy torch threads: ~2x the wall),
        # the token budget and the step's shape as the simulator's cost model reads it (sim/cost_model.StepShape)
        path = os.environ.get("TOKENMILL_STEP_TRACE")
        self._trace = open(path.replace("{pid}", str(os.getpid())), "a", buffering=1) if path else None
        # traced: request id -> when the front-end handed it over (AddCmd.sent_t), until its first step; the trace's
        # `enq` lists those of the requests the step scheduled first (the calibration's per-request path under load)
        self._enq: dict[str, float] = {}

    def run_once(self, commands) -> StepResult:
        res = StepResult()
        eng = self.engine
        for cmd in commands:
            if isinstance(cmd, AbortCmd):
                self._enq.pop(cmd.request_id, None)
                if cmd.request_id in self.live:
                    self.live.discard(cmd.request_id)
                    eng.abort_request(cmd.request_id)
                continue
            try:
                eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority,
                                ttft_deadline=cmd.ttft_deadline, tpot_slo_s=cmd.tpot_slo_s, rank=cmd.rank)
                self.live.add(cmd.request_id)
                res.added.append((cmd.request_id, None))
                if self._trace is not None and cmd.sent_t is not None:
                    self._enq[cmd.request_id] = cmd.sent_t
            except Exception as e:  # noqa: BLE001 - InvalidRequestError / EngineOverloadedError / anything
                res.added.append((cmd.request_id, AddError.of(e)))
        if eng.has_unfinished_requests():
            self._step(res)
        res.stats = eng.stats()
        res.busy = eng.has_unfinished_requests()
        if self._pool is not None and self._pool.events:
            res.kv_events, self._pool.events = self._pool.events, []
        return res

    def _step(self, res: StepResult) -> None:
        eng = self.engine
        budget = self.step_budget.budget_for(eng, eng.config.max_num_batched_tokens)
        res.stepped = True
        cpu0 = time.process_time() if self._trace is not None else 0.0
        res.t0 = t0 = time.perf_counter()
        try:
            outputs = eng.step(now=t0, token_budget=budget)
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine.step() failed; failing %d request(s) in flight", len(self.live))
            res.t1 = time.perf_counter()
            res.failed = self.abort_all()
            res.fail_message = f"engine error: {type(e).__name__}: {e}"
            return
        res.t1 = now = time.perf_counter()
        self.step_budget.observe(eng.last_step_decodes, eng.last_step_prefill_tokens, now - t0)
        if self._trace is not None:
            self._trace_step(t0, now, time.process_time() - cpu0, budget)
        res.first_scheduled = list(eng.last_first_scheduled)
        slim = self.slim_outputs
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
                if slim:
                    out.output_token_ids = list(out.output_token_ids)  # the engine's list, frozen now
            elif slim:
                out = RequestOutput(out.request_id, out.new_token_ids, out.new_text, "", [], out.num_prompt_tokens,
                                    out.num_cached_tokens, new_logprobs=out.new_logprobs)
            res.outputs.append(out)

    def _trace_step(self, t0: float, t1: float, cpu_s: float, budget: int | None) -> None:
        from tokenmill.sim.cost_model import StepShape

        sched = getattr(self.engine, "last_sched", None)
        shape = StepShape.of(sched) if sched is not None and not sched.empty else StepShape()
        self._trace.write(json.dumps({
            "t0": t0, "t1": t1, "cpu_s": cpu_s, "budget": budget, "tokens": shape.tokens,
            "prefill_tokens": shape.prefill_tokens, "decode_seqs": shape.decode_seqs, "attn_pairs": shape.attn_pairs,
            "decode_ctx": shape.decode_ctx, "prefill_ctx": shape.prefill_ctx, "logits": shape.logits,
            "new_requests": shape.new_requests,
            "enq": [self._enq.pop(r) for r in getattr(self.engine, "last_first_scheduled", ()) if r in self._enq]})
            + "\n")

    def abort_all(self) -> list[str]:
        rids = list(self.live)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort after a failure
                log.exception("abort_request(%s) failed", rid)
        self.live.clear()
        return rids


# -- the wire -------------------------------------------------------------------------------------------
def frame(obj) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket):
    """The next object from a blocking socket; None at EOF."""
    head = _recv_exactly(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exactly(sock, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


class _EOF(Exception):
    pass


IDLE_STATS_S = 0.25  # an idle core sends its stats again after this long, when they changed


def _read_commands(sock: socket.socket, timeout: float | None) -> list:
    """Every command frame that has arrived (waiting up to `timeout` s for the first; None: forever);
    raises _EOF."""
    cmds: list = []
    while True:
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            return cmds
        batch = recv_frame(sock)
        if batch is None:
            raise _EOF
        cmds.extend(batch)
        timeout = 0.0


def serve_core(sock: socket.socket) -> int:
    """The core process's life: setup frame -> load -> hello -> loop. Returns the exit code."""
    from tokenmill.errors import TokenmillError

    setup = recv_frame(sock)
    if not isinstance(setup, CoreSetup):
        return 2
    logging.basicConfig(level=setup.log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    try:
        from tokenmill.engine.llm_engine import LLMEngine

        engine = LLMEngine(setup.engine_config, detokenize=False)  # text and stop strings: the front-end's
    except TokenmillError as e:
        sock.sendall(frame(CoreFailed(str(e))))
        return 1
    except Exception as e:  # noqa: BLE001 - told to the front-end, which prints one line
        log.exception("engine start-up failed")
        sock.sendall(frame(CoreFailed(f"the engine failed to start: {type(e).__name__}: {e}")))
        return 1
    import os

    c = engine.config
    sock.sendall(frame(CoreHello(os.getpid(), engine.model_name, str(engine.model_path), engine.max_model_len,
                                 engine.kv_capacity_tokens, c.block_size, c.enable_prefix_caching,
                                 c.max_num_batched_tokens, engine.model_config.vocab_size, engine.describe(),
                                 engine.stats())))
    core = EngineCore(engine, StepBudget(setup.step_budget), slim_outputs=True, kv_events=setup.kv_events)
    busy = False
    sent_stats = None
    try:
        while True:
            cmds = _read_commands(sock, 0.0 if busy else IDLE_STATS_S)
            if any(isinstance(c, StopCmd) for c in cmds):
                core.abort_all()
                return 0
            if not cmds and not busy:  # idle: work beside the steps (KV tier writes) still moves the stats
                stats = engine.stats()
                if stats != sent_stats:
                    sock.sendall(frame(StepResult(stats=stats)))
                    sent_stats = stats
                continue
            res = core.run_once(cmds)
            busy = res.busy
            sock.sendall(frame(res))
            sent_stats = res.stats
    except (_EOF, BrokenPipeError, ConnectionResetError):
        log.warning("the server front-end went away; the engine core stops")
        return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m tokenmill.server.engine_core",
                                description="tokenmill's engine core process (started by `tokenmill serve`)")
    p.add_argument("--fd", type=int, required=True, help="a connected socket to the server front-end")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    try:
        return serve_core(sock)
    finally:
        sock.close()


if __name__ == "__main__":  # run as a module: use the importable module's classes (pickle names them so)
    from tokenmill.server.engine_core import main as _main

    raise SystemExit(_main())
