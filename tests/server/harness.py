"""ServerThread: an in-process server on a free port, run by its own event loop in a background thread."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

from tokenmill.server.app import SERVER_KEY, create_app, serve


class ServerThread:
    def __init__(self, engine, drain_timeout: float = 5.0, **app_kwargs):
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.exit_code = None
        self.app = create_app(engine, **app_kwargs)
        self.server = self.app[SERVER_KEY]
        self.url = None
        self._ready = threading.Event()
        self._loop = None
        self._stop = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(url):
                self.url = url
                self._ready.set()

            self.exit_code = await serve(self.app, "127.0.0.1", 0, ready, self._stop, self.drain_timeout)

        asyncio.run(main())

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30), "server did not start"
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    # -- small stdlib client --------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        """(status, headers, parsed JSON or text)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, hdrs, text = r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            status, hdrs, text = e.code, dict(e.headers), e.read().decode()
        try:
            return status, hdrs, json.loads(text)
        except ValueError:
            return status, hdrs, text

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def state(self) -> dict:
        return self.get("/tokenmill/state")[2]


def read_sse(url: str, body: dict, out: list, started: threading.Event | None = None, timeout: float = 60) -> None:
    """POST `body` with stream=True to `url` and append every SSE `data:` payload to `out` (sets `started` at the
    first one). Meant to run in a thread beside the test."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                out.append(line[6:])
                if started is not None:
                    started.set()


def offline_greedy_text(engine, prompt: str, max_tokens: int) -> str:
    """The reference a server's answer is compared with: `prompt` through the offline LLMEngine, greedy,
    ignore_eos, `max_tokens` tokens; returns the detokenized text."""
    from tokenmill.engine.sampling_params import SamplingParams

    engine.add_request("r", engine.tokenizer.encode(prompt),
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.text
    return text
