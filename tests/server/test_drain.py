"""Graceful drain (the fake engine, in-thread): the stop event (what SIGTERM sets) refuses new work with
503 + Retry-After, turns /health unready, lets in-flight requests finish, and serve() returns 0; past the
drain timeout the requests still in flight end with an error."""

from __future__ import annotations

import json
import threading
import time

from .fake_engine import FakeEngine
from .harness import ServerThread, read_sse

C = "/v1/completions"


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    read_sse(url + C, body, out, started)


def _start_drain(s: ServerThread) -> None:
    s._loop.call_soon_threadsafe(s._stop.set)


def test_drain_refuses_new_work_and_finishes_in_flight():
    s = ServerThread(FakeEngine(step_s=0.05), drain_timeout=30).__enter__()
    out, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(s.url, {"prompt": "x", "max_tokens": 30, "ignore_eos": True}, out, started))
    t.start()
    assert started.wait(10)
    _start_drain(s)
    deadline = time.time() + 5
    while not s.server.draining and time.time() < deadline:
        time.sleep(0.01)
    status, headers, body = s.post(C, {"prompt": "y", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "draining" and int(headers["Retry-After"]) >= 1
    h_status, _, h_body = s.get("/health")
    assert h_status == 503 and h_body["status"] == "draining"
    assert len(out) < 31, "the stream was already over: the drain was not observed in flight"
    t.join(30)
    s._thread.join(30)
    assert out[-1] == "[DONE]"
    last = json.loads(out[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert sum(1 for o in out[:-1] if json.loads(o)["choices"][0]["text"]) == 30  # every token arrived
    assert s.exit_code == 0


def test_drain_timeout_ends_in_flight_requests_with_an_error():
    s = ServerThread(FakeEngine(step_s=0.05), drain_timeout=0.3).__enter__()
    out, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(s.url, {"prompt": "x", "max_tokens": 200, "ignore_eos": True}, out, started))
    t.start()
    assert started.wait(10)
    t0 = time.time()
    _start_drain(s)
    t.join(30)
    s._thread.join(30)
    assert time.time() - t0 < 8  # 200 tokens x 50 ms = 10 s had the drain waited for them
    assert out[-1] == "[DONE]"
    err = json.loads(out[-2])
    assert "drain timeout" in err["error"]["message"]
    assert s.exit_code == 0
