"""The router's HTTP face (aiohttp): the OpenAI endpoints of `tokenmill serve`, plus worker admin.

    POST /v1/completions, /v1/chat/completions   routed, admitted, retried, streamed through (proxy.py)
    GET  /v1/models                              union of the workers' models
    GET  /health                                 200 when at least one worker is healthy, else 503
    GET  /metrics                                the router's Prometheus metrics (metrics.py)
    GET  /admin/workers                          each worker's state as the router sees it
    POST /admin/workers {"url": ..., "kind": ...}   add a worker (healthy after its first check)
    DELETE /admin/workers {"url": ...}           remove: it drains what it has and gets nothing new

`run(app, host, port, drain_timeout)`: SIGTERM/SIGINT drains the router itself: new requests get 503 +
Retry-After (code "draining"), /health answers 503, requests in flight run up to `drain_timeout` s, exit 0.
A worker that answers 503 with the x-tokenmill-draining header (`tokenmill serve` draining) is taken out
of rotation at once (proxy.py, health.py).

Bad input gets a 4xx OpenAI-style error body; no exception in a handler can stop the router.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import aiohttp
from aiohttp import web

from tokenmill.errors import InvalidRequestError
from tokenmill.router.gc_pauses import GcPauses, settle_heap, young_threshold
from tokenmill.router.health import HealthChecker
from tokenmill.router.proxy import error_response, serve
from tokenmill.router.request_fields import json_object, read_request
from tokenmill.router.router import Refused, Router
from tokenmill.router.worker_state import WorkerSpec

log = logging.getLogger("tokenmill.router")
ROUTER = web.AppKey("router", Router)
SESSION = web.AppKey("session", aiohttp.ClientSession)
HEALTH = web.AppKey("health", HealthChecker)
DRAINING = web.AppKey("draining", asyncio.Event)  # set: refuse new requests, finish those in flight


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return error_response(e.status, e.reason if e.status != 404 else f"no route {request.path}", kind)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return error_response(500, "internal router error (logged)", "server_error")


async def _openai(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[ROUTER]
    try:
        raw = await request.read()  # over client_max_size: 413 (errors_as_json)
        fields = read_request(raw, request.headers, chat, router.cfg)
        cls, body = router.classes[fields.class_name], fields.body
        ctx = router.new_request(fields.key, cls, fields.max_tokens)
    except InvalidRequestError as e:
        return error_response(400, str(e), "invalid_request_error", param=e.param)
    if request.app[DRAINING].is_set():
        return error_response(503, "the router is shutting down (draining); retry", "overloaded_error", "draining",
                              retry_after_s=1.0)
    if router.in_flight >= router.cfg.max_in_flight:
        router.metrics.rejections.labels(cls.name, "overloaded").inc()
        return error_response(503, f"the router has {router.in_flight} requests in flight (max_in_flight)",
                              "overloaded_error", "overloaded", retry_after_s=1.0)
    router.in_flight += 1
    try:
        return await serve(router, request.app[SESSION], ctx, body, request.path, request)
    except Refused as e:
        router.metrics.requests.labels(cls.name, "rejected").inc()
        kind = "rate_limit_error" if e.status == 429 else "overloaded_error"
        return error_response(e.status, str(e), kind, e.reason, retry_after_s=e.retry_after_s)
    finally:
        router.in_flight -= 1


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=True)


async def models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    ids = sorted({m for w in router.pool if w.healthy for m in w.models})
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "owned_by": "tokenmill"} for m in ids]})


async def health(request: web.Request) -> web.Response:
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "draining"}, status=503)
    healthy = sum(w.healthy for w in request.app[ROUTER].pool)
    return web.json_response({"status": "ok" if healthy else "no healthy worker", "healthy_workers": healthy},
                             status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER].metrics.render(), content_type="text/plain")


async def list_workers(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return web.json_response({"policy": router.cfg.policy, "workers": [
        {**dataclasses.asdict(w.view()), "kind": w.kind, "models": w.models,
         "prefix_index_entries": router.index.size(w.url)} for w in router.pool]})


async def add_worker(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    try:
        body = json_object(await request.read())
        spec = WorkerSpec(str(body.get("url", "")).rstrip("/"), body.get("kind", "auto"))
    except (InvalidRequestError, ValueError) as e:
        return error_response(400, str(e), "invalid_request_error", param="url")
    w = router.add_worker(spec)
    await request.app[HEALTH].check(w)
    return web.json_response({"url": w.url, "kind": w.kind, "healthy": w.healthy}, status=201)


async def remove_worker(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    try:
        url = str(json_object(await request.read()).get("url", "")).rstrip("/")
    except InvalidRequestError as e:
        return error_response(400, str(e), "invalid_request_error", param="url")
    if not router.remove_worker(url):
        return error_response(404, f"no worker {url!r}", "not_found_error", param="url")
    return web.json_response({"url": url, "removed": True})


def create_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=router.cfg.max_body_bytes, middlewares=[errors_as_json])
    app[ROUTER] = router
    app[DRAINING] = asyncio.Event()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/workers", list_workers)
    app.router.add_post("/admin/workers", add_worker)
    app.router.add_delete("/admin/workers", remove_worker)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def _startup(app: web.Application) -> None:
    router = app[ROUTER]
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
    app[HEALTH] = HealthChecker(router, app[SESSION])
    await app[HEALTH].check_all()  # route from the first request on, not after one interval
    app[HEALTH].start()
    await router.start()


async def _cleanup(app: web.Application) -> None:
    await app[HEALTH].stop()
    await app[ROUTER].close()
    await app[SESSION].close()


async def run(app: web.Application, host: str, port: int, drain_timeout: float = 30.0) -> int:
    """Serve until SIGTERM/SIGINT, then drain (module docstring); a second signal stops at once."""
    import signal

    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    gc_watch = GcPauses(app[ROUTER].metrics.registry)
    gc_watch.start()
    settle_heap()  # the startup heap is never garbage: keep later collections from rescanning it (gc_pauses.py)
    young_threshold()  # requests leave no cycles: collect young objects ~15x less often (gc_pauses.py)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        app[DRAINING].set()
        router = app[ROUTER]
        log.warning("draining: %d request(s) in flight, up to %.0f s", router.in_flight, drain_timeout)
        deadline = loop.time() + drain_timeout
        while router.in_flight and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
        gc_watch.stop()
    return 0
