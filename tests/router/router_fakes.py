"""A scripted OpenAI worker for router tests: one FIFO prefill lane, timed decode, a prefix cache, /metrics.

    prompt tokens = ceil(chars / 4); cached tokens = longest 64-char-aligned prefix seen before, / 4
    TTFT = wait for the prefill lane + uncached_tokens / prefill_tps;  then one token every tpot_s
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeWorker:
    prefill_tps: float = 20000.0
    tpot_s: float = 0.002
    fail_before_first_token: bool = False  # close the connection after reading the request
    cut_after_tokens: int | None = None  # streams: close the connection after this many tokens
    status: int = 200  # answer every completion request with this status (error body) when not 200
    unhealthy: bool = False
    requests: list[dict] = field(default_factory=list)  # (body, headers) of each completion request
    running: int = 0
    waiting: int = 0
    queued_prefill: int = 0  # reported as tokenmill_waiting_uncached_prompt_tokens (traffic from elsewhere)
    _seen: set[str] = field(default_factory=set)
    _lane: asyncio.Lock = field(default_factory=asyncio.Lock)
    url: str = ""

    def cached_chars(self, prompt: str) -> int:
        n = 0
        for end in range(64, len(prompt) + 1, 64):
            if prompt[:end] not in self._seen:
                break
            n = end
        return n

    def remember(self, prompt: str) -> None:
        self._seen.update(prompt[:end] for end in range(64, len(prompt) + 1, 64))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", functools.partial(self._complete, chat=False))
        app.router.add_post("/v1/chat/completions", functools.partial(self._complete, chat=True))
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request):
        return web.json_response({}, status=503 if self.unhealthy else 200)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _metrics(self, request):
        text = (
            "# TYPE tokenmill_engine_steps counter\ntokenmill_engine_steps_total 1\n"
            f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="tiny"}} {self.running}\n'
            f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="tiny"} 0.25\n'
            f"# TYPE tokenmill_waiting_uncached_prompt_tokens gauge\n"
            f'tokenmill_waiting_uncached_prompt_tokens{{model_name="tiny"}} {self.queued_prefill}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _complete(self, request: web.Request, chat: bool):
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        if self.fail_before_first_token:
            request.transport.close()
            return web.Response(status=500)
        if self.status != 200:
            return web.json_response({"error": {"message": "scripted", "type": "x", "param": None, "code": None}},
                                     status=self.status, headers={"Retry-After": "3"})
        if chat:
            prompt = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in body["messages"])
        else:
            prompt = body["prompt"] if isinstance(body["prompt"], str) else " ".join(map(str, body["prompt"]))
        prompt_tokens = math.ceil(len(prompt) / 4)
        self.waiting += 1
        async with self._lane:
            cached = self.cached_chars(prompt) // 4
            await asyncio.sleep(max(0, prompt_tokens - cached) / self.prefill_tps)
            self.remember(prompt)
        self.waiting -= 1
        self.running += 1
        try:
            return await self._generate(request, body, chat, prompt_tokens, cached)
        finally:
            self.running -= 1

    async def _generate(self, request, body, chat, prompt_tokens, cached):
        n = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            await asyncio.sleep(self.tpot_s * n)
            choice = ({"index": 0, "message": {"role": "assistant", "content": " tok" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": " tok" * n, "finish_reason": "length"})
            return web.json_response({"id": "x", "object": obj, "created": int(time.time()), "model": "tiny",
                                      "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj += ".chunk" if chat else ""
        if chat:  # a role-only chunk first, as vLLM sends
            await _send(resp, {"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            if i:
                await asyncio.sleep(self.tpot_s)
            if i == self.cut_after_tokens:
                request.transport.close()
                return resp
            last = "length" if i == n - 1 else None
            choice = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": last} if chat
                      else {"index": 0, "text": " tok", "finish_reason": last})
            await _send(resp, {"object": obj, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, {"object": obj, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _send(resp, event):
    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")


@asynccontextmanager
async def serving(app: web.Application, port: int = 0):
    """Serve `app` on 127.0.0.1; yields its base URL."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def routed(fakes: list[FakeWorker], **overrides):
    """Fake workers plus a router in front of them; yields (router URL, Router)."""
    from contextlib import AsyncExitStack

    from tokenmill.router.app import create_app
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.router import Router
    from tokenmill.router.worker_state import WorkerSpec

    async with AsyncExitStack() as stack:
        for fake in fakes:
            fake.url = await stack.enter_async_context(serving(fake.app()))
        cfg = RouterConfig(workers=tuple(WorkerSpec(f.url) for f in fakes), health_interval_s=0.2,
                           **overrides)
        router = Router(cfg)
        url = await stack.enter_async_context(serving(create_app(router)))
        yield url, router


async def sse_events(resp) -> list:
    """The data payloads of an SSE response: parsed JSON, or the string '[DONE]'."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


@dataclass
class ScriptedStream:
    """A tokenmill-looking worker whose streaming completions are a fixed script of raw byte writes
    `(delay_s, bytes)`, then EOF: to test the router's SSE pass-through byte for byte."""

    script: list[tuple[float, bytes]] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request):
        return web.json_response({})

    async def _metrics(self, request):
        return web.Response(text="tokenmill_engine_steps_total 1\n")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _complete(self, request: web.Request):
        self.requests.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delay_s, data in self.script:
            await asyncio.sleep(delay_s)
            await resp.write(data)
        await resp.write_eof()
        return resp


def simulate_worker(hit_share: float, arrivals_per_s: float, seed: int, overhead_s: float = 0.12,
                    rate_tps: float = 4000.0, n: int = 400, url: str = "http://w:1"):
    """A FIFO worker serving 64-token cache hits and 832-token misses, each in overhead + tokens / rate
    (±10%), observed the way the router observes it: sent at arrival, first token at completion."""
    from tokenmill.router.rates import RatePriors
    from tokenmill.router.worker_state import WorkerSpec, WorkerState

    rng = random.Random(seed)
    w = WorkerState(WorkerSpec(url), RatePriors())
    w.healthy = True
    t, free_at, events = 0.0, 0.0, []
    for i in range(n):
        t += rng.expovariate(arrivals_per_s)
        uncached = 64 if rng.random() < hit_share else 832
        free_at = max(t, free_at) + (overhead_s + uncached / rate_tps) * rng.uniform(0.9, 1.1)
        events += [(t, 0, i, uncached), (free_at, 1, i, uncached)]
    sent = {}
    for now, kind, i, uncached in sorted(events):
        if kind == 0:
            sent[i] = w.start(str(i), uncached, 0.1, now)
        else:
            w.first_token(sent[i], now)
            w.finish(sent[i], now, output_tokens=1)
    return w


def simulate_batching_worker(arrivals_per_s, seed: int, overhead_s: float = 0.03, rate_tps: float = 4000.0,
                             n: int = 1500, hit_share: float = 0.7, max_batch: int = 64):
    """A continuous-batching worker as a processor-sharing server: up to `max_batch` prompts prefill
    together (the rest wait, FIFO), each needs overhead + uncached tokens / rate (±10%) of its busy time,
    shared equally among those running, so first tokens come while other prompts are part-done.
    64-token hits (`hit_share`) and 832-token misses, Poisson arrivals: `arrivals_per_s`, or a list of
    (rate, requests) phases. Returns the router's WorkerState and the most prefills ever pending."""
    from tokenmill.router.rates import RatePriors
    from tokenmill.router.worker_state import WorkerSpec, WorkerState

    rng = random.Random(seed)
    w = WorkerState(WorkerSpec("http://w:1"), RatePriors())
    w.healthy = True
    phases = [(arrivals_per_s, n)] if isinstance(arrivals_per_s, (int, float)) else arrivals_per_s
    arrivals, t = [], 0.0
    for rate, count in phases:
        for _ in range(count):
            t += rng.expovariate(rate)
            arrivals.append((t, 64 if rng.random() < hit_share else 832))
    waiting, running, now, i, most = [], [], 0.0, 0, 0  # [work left, InFlight]
    while i < len(arrivals) or running or waiting:
        next_arrival = arrivals[i][0] if i < len(arrivals) else math.inf
        next_done = now + min(r[0] for r in running) * len(running) if running else math.inf
        t = min(next_arrival, next_done)
        for r in running:
            r[0] -= (t - now) / len(running)
        now = t
        if next_done <= next_arrival:
            for r in [r for r in running if r[0] <= 1e-12]:
                running.remove(r)
                w.first_token(r[1], now)
                w.finish(r[1], now, output_tokens=1)
        else:
            uncached = arrivals[i][1]
            i += 1
            waiting.append([(overhead_s + uncached / rate_tps) * rng.uniform(0.9, 1.1),
                            w.start(str(i), uncached, 0.1, now)])
        while waiting and len(running) < max_batch:
            running.append(waiting.pop(0))
        most = max(most, len(running) + len(waiting))
    return w, most
