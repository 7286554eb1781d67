"""Drain across the router: a `tokenmill serve` worker that is draining is taken out of rotation at once
(its 503 carries x-tokenmill-draining; the request is retried on another worker), and `tokenmill route`
itself drains on SIGTERM (503 to new requests, in-flight ones finish, exit 0)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from .fake_engine import FakeEngine
from .harness import ServerThread

C = "/v1/completions"


@contextlib.asynccontextmanager
async def serving(app):
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _long_stream(url: str, out: list, started: threading.Event, max_tokens: int = 40) -> None:
    import urllib.request

    req = urllib.request.Request(url + C, data=json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True,
                                                           "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                out.append(line[6:].strip().decode())
                started.set()


def test_router_stops_routing_to_a_draining_worker_at_once():
    from tokenmill.router.app import create_app
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.router import Router
    from tokenmill.router.worker_state import WorkerSpec

    a = ServerThread(FakeEngine(step_s=0.05), drain_timeout=30, admission=None).__enter__()
    b = ServerThread(FakeEngine(step_s=0.002), admission=None).__enter__()
    out, started = [], threading.Event()  # keeps worker a draining (an in-flight request of its own)
    t = threading.Thread(target=_long_stream, args=(a.url, out, started))
    try:
        async def main():
            cfg = RouterConfig(workers=(WorkerSpec(a.url), WorkerSpec(b.url)), health_interval_s=60.0,
                               policy="round-robin")
            router = Router(cfg)
            async with serving(create_app(router)) as url, aiohttp.ClientSession() as http:
                assert router.pool.get(a.url).healthy and router.pool.get(b.url).healthy
                t.start()
                assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
                a._loop.call_soon_threadsafe(a._stop.set)
                while not a.server.draining:
                    await asyncio.sleep(0.01)
                codes = []
                for i in range(8):  # round-robin: the first or second goes to a, gets 503 draining, is retried
                    async with http.post(url + C, json={"prompt": f"p{i}", "max_tokens": 2}) as r:
                        codes.append(r.status)
                        await r.read()
                a_healthy = router.pool.get(a.url).healthy
            # a router that starts while a drains: its first health check leaves a out
            router2 = Router(cfg)
            async with serving(create_app(router2)):
                a_healthy2 = router2.pool.get(a.url).healthy
            return codes, a_healthy, a_healthy2

        codes, a_healthy, a_healthy2 = asyncio.run(main())
        assert codes == [200] * 8
        assert not a_healthy and not a_healthy2
        assert b.engine.c["gen"] == 8 * 2  # b generated every token
        t.join(30)
        assert out[-1] == "[DONE]"  # a's own in-flight request still finished
    finally:
        b.__exit__(None, None, None)
        a._thread.join(30)


@pytest.mark.slow
def test_route_sigterm_drains_then_exits_zero():
    w = ServerThread(FakeEngine(step_s=0.05), admission=None).__enter__()
    p = subprocess.Popen([sys.executable, "-m", "tokenmill", "route", "--worker", w.url, "--port", "0",
                          "--drain-timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = p.stdout.readline()
        assert "tokenmill route" in line, line
        port = None
        import urllib.request

        # --port 0: find the port the router bound from /proc (the banner prints the configured one)
        deadline = time.time() + 30
        while port is None and time.time() < deadline:
            out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
            m = re.search(r"127\.0\.0\.1:(\d+)\s.*pid=%d," % p.pid, out)
            port = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert port, "the router did not listen"
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        out, started = [], threading.Event()
        t = threading.Thread(target=_long_stream, args=(url, out, started))
        t.start()
        assert started.wait(20)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        req = urllib.request.Request(url + C, data=json.dumps({"prompt": "y", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
            assert json.loads(e.read())["error"]["code"] == "draining" and e.headers["Retry-After"]
        assert status == 503
        t.join(30)
        assert out[-1] == "[DONE]"
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        w.__exit__(None, None, None)
