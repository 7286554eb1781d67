"""A scripted OpenAI-compatible server for the bench tests: known TTFT and TPOT, scripted failures.

In-process: `with FakeServer(Script(ttft_s=0.05)) as server: server.url` (its own thread and event loop).
As a process: `python tests/bench/fake_server.py [--ttft S] [--tpot S]` prints `PORT <n>` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    ttft_s: float = 0.0  # before the first chunk
    tpot_s: float = 0.0  # between chunks
    ttft_per_inflight_s: float = 0.0  # extra TTFT per request already in flight (a saturating server)
    tokens_per_chunk: int = 1
    send_usage: bool = True  # honour stream_options.include_usage
    cached_tokens: int | None = None  # reported as usage.prompt_tokens_details.cached_tokens
    reject_every: int = 0  # every n-th request gets 429
    fail_every: int = 0  # every n-th request gets 500
    role_chunk: bool = True  # chat: a role-only chunk first, at once (it is not output)
    model: str = "fake-model"
    max_model_len: int | None = None  # listed in GET /v1/models (as vLLM and tokenmill do)


@dataclass
class Seen:
    path: str
    body: dict
    headers: dict[str, str]


@dataclass
class State:
    script: Script
    seen: list[Seen] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0


STATE = web.AppKey("state", State)


def make_app(script: Script) -> web.Application:
    state = State(script)
    app = web.Application()
    app[STATE] = state

    async def models(request: web.Request) -> web.Response:
        entry = {"id": script.model, "object": "model"}
        if script.max_model_len is not None:
            entry["max_model_len"] = script.max_model_len
        return web.json_response({"object": "list", "data": [entry]})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.seen.append(Seen(request.path, body, dict(request.headers)))
        n = len(state.seen)
        if script.reject_every and n % script.reject_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=429, headers={"Retry-After": "1"})
        if script.fail_every and n % script.fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt = body.get("prompt") if not chat else " ".join(m["content"] for m in body["messages"])
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event: dict) -> None:
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())

        if chat and script.role_chunk:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        ttft = script.ttft_s + script.ttft_per_inflight_s * state.inflight
        state.inflight += 1
        state.max_inflight = max(state.max_inflight, state.inflight)
        try:
            await asyncio.sleep(ttft)
            total = body["max_tokens"]
            for i in range(0, total, script.tokens_per_chunk):
                if i:
                    await asyncio.sleep(script.tpot_s)
                text = " tok" * min(script.tokens_per_chunk, total - i)
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await send({"choices": [choice]})
            done = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            await send({"choices": [{**done, "finish_reason": "length"}]})
            if script.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": total,
                         "total_tokens": prompt_tokens + total}
                if script.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": script.cached_tokens}
                await send({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state.inflight -= 1
        return resp

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


class FakeServer:
    """Serves `make_app(script)` on 127.0.0.1 (port 0) from a background thread."""

    def __init__(self, script: Script):
        self.app = make_app(script)
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def seen(self) -> list[Seen]:
        return self.app[STATE].seen

    @property
    def state(self) -> State:
        return self.app[STATE]

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> FakeServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _main(script: Script) -> None:
    runner = web.AppRunner(make_app(script), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft", type=float, default=0.0)
    ap.add_argument("--tpot", type=float, default=0.0)
    a = ap.parse_args()
    asyncio.run(_main(Script(ttft_s=a.ttft, tpot_s=a.tpot)))
