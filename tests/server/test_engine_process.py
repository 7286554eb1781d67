"""`tokenmill serve` with the engine core in its own process (the default), as a subprocess over a tiny
random model: the same tokens as the offline engine, outputs in one frame per step (not per token), the
core's death ends in-flight requests with an error and the server with exit code 1, SIGTERM drains to
exit 0, and a bounded schemathesis run from /openapi.json finds no 5xx."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("tokenmill.engine.llm_engine")

from tokenmill.engine.config import EngineConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402

from .harness import offline_greedy_text, read_sse  # noqa: E402

pytestmark = pytest.mark.slow
C = "/v1/completions"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


class Serve:
    """`tokenmill serve` in a subprocess on a free port."""

    def __init__(self, model: str, *args: str):
        self.p = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--model", model, "--port", "0",
                                   "--kv-cache-bytes", "16MiB", *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.p.stdout.readline()
        m = re.search(r"http://[\d.]+:\d+", line)
        assert m, line + self.p.stdout.read()
        self.url = m.group(0)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.p.stdout), daemon=True).start()

    def request(self, method: str, path: str, body=None, timeout=60):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def stream(self, body: dict, out: list, started: threading.Event | None = None) -> None:
        read_sse(self.url + C, body, out, started)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


@pytest.fixture
def serve(tiny_dir):
    started = []

    def make(*args):
        s = Serve(str(tiny_dir), *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.close()


def test_core_process_serves_the_offline_tokens_one_frame_per_step(serve, tiny_dir):
    s = serve("--max-model-len", "256")
    state = s.request("GET", "/tokenmill/state")[2]
    assert state["engine_core_pid"] not in (None, s.p.pid)
    text = offline_greedy_text(LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_bytes=16 << 20, max_model_len=256)),
                               PROMPT, 12)
    status, _, body = s.request("POST", C, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"] == text
    outs = [[] for _ in range(8)]
    threads = [threading.Thread(target=s.stream, args=({"prompt": PROMPT + str(i), "max_tokens": 24,
                                                        "ignore_eos": True}, outs[i])) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o[-1] == "[DONE]" and json.loads(o[-2])["choices"][0]["finish_reason"] == "length" for o in outs)
    state = s.request("GET", "/tokenmill/state")[2]
    steps, results, frames = state["stats"]["num_steps"], state["core_results"], state["core_frames_sent"]
    # one result frame per loop iteration of the core: a step, or commands that started none
    assert steps <= results <= steps + frames
    assert results < (8 * 24 + 12) / 2  # the 204 tokens came in far fewer frames than one per token
    assert s.request("GET", "/health")[0] == 200


def test_core_death_fails_in_flight_and_exits_nonzero(serve):
    s = serve("--max-model-len", "512")
    pid = s.request("GET", "/tokenmill/state")[2]["engine_core_pid"]
    out, started = [], threading.Event()
    t = threading.Thread(target=s.stream, args=({"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}, out, started))
    t.start()
    assert started.wait(30)
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the stream hung after the engine core died"
    assert out[-1] == "[DONE]" and "engine core process exited" in json.loads(out[-2])["error"]["message"]
    try:
        status = s.request("GET", "/health", timeout=5)[0]
        assert status == 503
    except (urllib.error.URLError, ConnectionError):
        pass  # already gone
    assert s.p.wait(30) == 1


def test_sigterm_drains_then_exits_zero(serve):
    s = serve("--max-model-len", "512", "--drain-timeout", "60")
    out, started = [], threading.Event()
    t = threading.Thread(target=s.stream, args=({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}, out, started))
    t.start()
    assert started.wait(30)
    s.p.send_signal(signal.SIGTERM)
    t.join(60)
    assert out[-1] == "[DONE]"
    assert json.loads(out[-2])["choices"][0]["finish_reason"] == "length"
    assert s.p.wait(30) == 0
    assert any("tokenmill serve: stopped" in line for line in s.log)


def test_schemathesis_finds_no_server_error(serve):
    """Property-based fuzzing from /openapi.json (positive and negative cases, fixed seed): no 5xx, and the
    server is healthy afterwards."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    s = serve("--max-model-len", "64")
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"}
    calls, errors = [], []
    t0 = time.time()
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=50 if op.method.upper() == "POST" else 20, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                r = case.call(base_url=s.url, timeout=60)
                calls.append((op.label, r.status_code))
                if r.status_code >= 500:
                    errors.append((op.label, r.status_code, r.text[:300], case.body))

            try:
                fuzz()
            except Unsatisfiable:  # no invalid input exists (an operation without parameters)
                assert mode == GenerationMode.NEGATIVE
    took = time.time() - t0
    assert not errors, errors[:3]
    assert len(calls) >= 200, len(calls)
    assert sum(1 for _, code in calls if code == 200) >= 20  # some generation requests got through
    assert sum(1 for _, code in calls if code == 400) >= 35  # and many invalid ones were refused cleanly
    assert s.request("GET", "/health")[0] == 200
    status, _, body = s.request("POST", C, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    print(f"schemathesis: {len(calls)} calls in {took:.1f} s:", sorted(collections.Counter(calls).items()))
