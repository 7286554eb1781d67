"""Drives load: open-loop arrivals at a rate, trace timestamps, or a closed loop of C concurrent sessions.

A session's turns run one after another: the next turn is due when the reply has arrived plus the turn's
think time. A failed or rejected turn ends its session (an agent cannot go on without its reply).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from tokenmill.bench.arrivals import ARRIVALS, arrival_times
from tokenmill.bench.client import Client, Clock
from tokenmill.bench.progress import Progress
from tokenmill.bench.record import RequestRecord
from tokenmill.bench.session import Message, Session
from tokenmill.bench.workloads import Workload
from tokenmill.cli import CLIError


@dataclass(frozen=True)
class LoadConfig:
    mode: str  # "rate" (open loop) | "concurrency" (closed loop) | "trace" (the trace's own timestamps)
    rate: float | None = None  # requests/s; sessions start at rate / mean turns per session
    concurrency: int | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape
    duration_s: float | None = None  # no request is sent after this
    num_requests: int | None = None  # at most this many requests (sessions are cut to fit); None: all

    def __post_init__(self):
        if self.mode not in ("rate", "concurrency", "trace"):
            raise CLIError(f"unknown load mode {self.mode!r}")
        if self.mode == "rate" and not (self.rate and self.rate > 0):
            raise CLIError("--rate must be > 0 requests/s")
        if self.mode == "concurrency" and not (self.concurrency and self.concurrency >= 1):
            raise CLIError("--concurrency must be >= 1")
        if self.arrival not in ARRIVALS:
            raise CLIError(f"--arrival {self.arrival!r}: choose from {', '.join(ARRIVALS)}")
        if not self.burstiness > 0:
            raise CLIError("--burstiness must be > 0")
        if self.duration_s is not None and not self.duration_s > 0:
            raise CLIError("--duration must be > 0 seconds")
        if self.num_requests is not None and self.num_requests < 1:
            raise CLIError("--num-requests must be >= 1")


    @property
    def label(self) -> str:
        if self.mode == "rate":
            return f"rate={self.rate:.4g}"
        return f"concurrency={self.concurrency}" if self.mode == "concurrency" else "trace"


def schedule(workload: Workload, load: LoadConfig, seed: int) -> Iterator[tuple[float, Session]]:
    """(start time s, session) in start order, cut to num_requests; closed loop: times are 0."""
    sessions: Iterator[Session] = (s for s in workload.sessions() if s.turns)
    if load.num_requests is not None:
        sessions = _first_requests(sessions, load.num_requests)
    if load.mode == "concurrency":
        yield from zip(itertools.repeat(0.0), sessions)
        return
    if workload.finite:  # a trace: its own timestamps, rescaled to --rate when given
        scale = 1.0 if load.mode == "trace" else workload.native_rate / load.rate
        timed = ((s.start_s * scale, s) for s in sessions)
    else:
        timed = zip(arrival_times(load.arrival, load.rate / workload.mean_turns, load.burstiness, seed), sessions)
    for start_s, session in timed:
        if load.duration_s is not None and start_s >= load.duration_s:
            return
        yield start_s, session


def _first_requests(sessions: Iterator[Session], n: int) -> Iterator[Session]:
    for session in sessions:
        if n <= 0:
            return
        yield session.truncated(n)
        n -= len(session.turns)


async def run_load(client: Client, plan: Iterator[tuple[float, Session]], load: LoadConfig,
                   progress: Progress) -> list[RequestRecord]:
    """Send the planned sessions and return one record per request sent, in completion order."""
    clock: Clock = client.clock
    records: list[RequestRecord] = []
    deadline = load.duration_s

    async def run_session(session: Session, start_s: float) -> None:
        texts: dict[Message, str] = {}  # decoded messages, reused by the session's later turns
        due = start_s
        for k, turn in enumerate(session.turns):
            if k:
                due = clock() + turn.think_s
                await _sleep_until(clock, due)
            if deadline is not None and due >= deadline:
                return
            progress.on_sent()
            rec = await client.send(session, k, due, texts)
            records.append(rec)
            progress.on_done(rec)
            if not rec.ok:
                return

    progress.start(clock)
    try:
        if load.mode == "concurrency":
            shared = iter(plan)  # each worker takes the next session when its previous one ends

            async def worker() -> None:
                for _, session in shared:
                    if deadline is not None and clock() >= deadline:
                        return
                    await run_session(session, clock())

            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
        else:
            tasks = []
            for start_s, session in plan:
                await _sleep_until(clock, start_s)
                tasks.append(asyncio.create_task(run_session(session, start_s)))
            await asyncio.gather(*tasks)
    finally:
        progress.stop(clock)
    return records


async def _sleep_until(clock: Clock, t: float) -> None:
    delay = t - clock()
    if delay > 0:
        await asyncio.sleep(delay)
