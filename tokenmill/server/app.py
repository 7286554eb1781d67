"""HTTP routes (aiohttp.web): the OpenAI-compatible API plus health, metrics and engine state.

    POST /v1/completions        POST /v1/chat/completions     (SSE when "stream": true)
    GET  /v1/models             GET  /health    GET /metrics   GET /tokenmill/state   GET /openapi.json

`create_app(engine)` wraps an engine core in an AsyncEngine that starts with the app: an EngineProcess (the
core in its own process, `tokenmill serve`'s default) or a synchronous engine (run in a thread).
Every error leaves as an OpenAI-style `{"error": {...}}` body; `--api-key` guards `/v1/*` only.

Life cycle (`serve`): SIGTERM/SIGINT (or the `stop` event) starts a drain: new generation requests get 503 +
Retry-After (code "draining"), /health answers 503, the requests in flight run to their end for up to
`drain_timeout` seconds (then they end with an error), and `serve` returns 0. A second signal stops at
once. If the engine core dies, the requests in flight end with an error, /health answers 503 and `serve`
returns 1 (a supervisor restarts the server).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict

from aiohttp import web

from tokenmill.engine.outputs import RequestOutput, TokenLogprob
from tokenmill.errors import EngineOverloadedError, InvalidRequestError
from tokenmill.router.classes import CLASS_HEADER
from tokenmill.router.health import DRAINING_HEADER  # on 503s while draining (or engine-less): routers drop us at once
from tokenmill.router.router import Refused
from tokenmill.server.admission import ServerAdmission, ServerAdmissionConfig
from tokenmill.server.async_engine import AsyncEngine, EngineError, RequestStream
from tokenmill.server.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.server.protocol import (
    APIError, GenerateRequest, bad_request, from_invalid, parse_chat, parse_completion, parse_priority_header,
)

log = logging.getLogger("tokenmill.server")

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 64 << 20


class OpenAIServer:
    """The handlers, over one AsyncEngine. `served_model_names[0]` is the name responses carry."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str],
                 api_key: str | None = None, kv_capacity_tokens: int | None = None,
                 admission: ServerAdmission | None = None):
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        self.model_names = served_model_names
        self.api_key = api_key
        self.kv_capacity_tokens = kv_capacity_tokens
        self.started = int(time.time())
        self._token_text: dict[int, str] = {}
        # request ids: a random prefix per server and a counter (os.urandom per request releases the GIL, and
        # getting it back from a busy engine thread can take a switch interval)
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self.draining = False  # SIGTERM: refuse new work, finish what is in flight
        self.fatal: str | None = None  # the engine core died: serve() exits non-zero
        self.on_fatal: Callable[[], None] | None = None  # set by serve(): wakes it up
        self.num_active = 0  # generation requests inside a handler (held by admission, queued or running)
        self.idle = asyncio.Event()  # set while num_active == 0 (the drain waits on it)
        self.idle.set()

    def core_died(self, message: str) -> None:
        self.fatal = message
        if self.on_fatal is not None:
            self.on_fatal()

    # -- generation -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion(await _json_body(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat(await _json_body(request)))

    async def _generate(self, request: web.Request, req: GenerateRequest) -> web.StreamResponse:
        if self.draining or self.fatal is not None:
            why = "is shutting down (draining)" if self.fatal is None else "lost its engine and is restarting"
            raise APIError(503, f"the server {why}; retry (on another replica)", "overloaded_error", None,
                           "draining" if self.fatal is None else "engine_dead",
                           headers={"Retry-After": str(RETRY_AFTER_S), DRAINING_HEADER: "1"})
        self.num_active += 1
        self.idle.clear()
        try:
            return await self._generate_active(request, req)
        finally:
            self.num_active -= 1
            if self.num_active == 0:
                self.idle.set()

    async def _generate_active(self, request: web.Request, req: GenerateRequest) -> web.StreamResponse:
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_names}",
                           "invalid_request_error", "model", "model_not_found")
        ids = self._prompt_ids(req)
        max_len = self.engine.max_model_len
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = 16 if req.kind == "completion" else max(1, max_len - len(ids))
        params = req.sampling_params(max_tokens)
        if len(ids) + max_tokens > max_len:
            raise bad_request(
                f"this model's maximum context length is {max_len} tokens, but {len(ids) + max_tokens} were "
                f"requested ({len(ids)} in the prompt, {max_tokens} for the completion); shorten the prompt or "
                f"lower max_tokens", param="prompt" if len(ids) >= max_len else "max_tokens",
                code="context_length_exceeded")
        priority = req.priority
        if priority is None:
            priority = parse_priority_header(request.headers.get("x-tokenmill-priority"))
        rid = f"{'cmpl' if req.kind == 'completion' else 'chatcmpl'}-{self._id_prefix}{next(self._ids):x}"
        deadline = tpot_slo = None
        rank = 0
        if self.admission is not None:
            try:
                cls = self.admission.workload_class(request.headers.get(CLASS_HEADER), req.workload_class)
            except InvalidRequestError as e:
                raise from_invalid(e) from None
            priority = cls.priority if priority is None else priority
            try:
                ticket = await self.admission.acquire(rid, cls, ids, max_tokens)
            except Refused as e:
                raise APIError(e.status, _refusal_message(e, cls), "rate_limit_error" if e.status == 429
                               else "overloaded_error", None, e.reason,
                               headers={"Retry-After": _retry_after(e.retry_after_s)}) from None
            deadline, tpot_slo, rank = ticket.ttft_deadline, cls.tpot_slo_s, ticket.rank
        try:
            try:
                stream = await self.engine.add(rid, ids, params, priority or 0, collect=not req.stream,
                                               ttft_deadline=deadline, tpot_slo_s=tpot_slo, rank=rank)
            except InvalidRequestError as e:
                raise from_invalid(e) from None
            except EngineOverloadedError as e:
                raise APIError(429, f"the server is overloaded: {e}", "server_overloaded", None, "engine_overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            except EngineError as e:  # the core died or the server is stopping
                raise APIError(503, str(e), "overloaded_error", None, "engine_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            try:
                if req.stream:
                    return await self._stream(request, req, rid, stream)
                return await self._collect(req, rid, stream)
            finally:
                if not stream.finished:  # the client went away (handler cancelled or write failed)
                    self.engine.abort(rid)
        finally:
            if self.admission is not None:  # a no-op when the engine's finish already released it
                self.admission.release(rid)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        tok = self.engine.tokenizer
        if req.kind == "chat":
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
            except InvalidRequestError as e:
                raise from_invalid(e) from None
            except Exception as e:  # noqa: BLE001 - jinja2 errors from the model's own template
                raise bad_request(f"messages cannot be rendered by the chat template: {e}", "messages") from None
            return tok.encode(text)
        if isinstance(req.prompt, str):
            ids = tok.encode(req.prompt)
            if not ids:
                raise bad_request("prompt encodes to zero tokens", param="prompt")
            return ids
        vocab = self.engine.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in req.prompt):
            raise bad_request(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return list(req.prompt)

    async def _collect(self, req: GenerateRequest, rid: str, stream: RequestStream) -> web.Response:
        final: RequestOutput | None = None
        logprobs: list[TokenLogprob] = []
        try:
            while batch := await stream.next_batch():
                for out in batch:
                    logprobs.extend(out.new_logprobs or [])
                final = batch[-1]
        except EngineError as e:
            raise APIError(500, str(e), "internal_server_error", None, "engine_error") from None
        if final.finish_reason == "error":
            raise APIError(500, f"engine error: {final.error or 'unknown'}", "internal_server_error", None,
                           "engine_error")
        lp = self._logprobs(req, logprobs, 0) if req.logprobs is not None else None
        if req.kind == "completion":
            choice = {"index": 0, "text": final.text, "logprobs": lp}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": lp}
            obj = "chat.completion"
        choice.update(finish_reason=final.finish_reason, stop_reason=final.stop_reason)
        body = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_names[0],
                "choices": [choice], "usage": _usage(final)}
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: GenerateRequest, rid: str,
                      stream: RequestStream) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chat = req.kind == "chat"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_names[0]}
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(choice: dict | None, **extra) -> bytes:
            body = {**head, "choices": [choice] if choice else [], **usage_field, **extra}
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        # The delta chunk goes out once per token per stream: formatted around a pre-encoded head and tail.
        dumps = json.dumps
        pre = chunk({"index": 0})[:-len(b'}]}\n\n') - (len(',"usage":null') if req.include_usage else 0)] + b","
        post = b'}]' + (b',"usage":null' if req.include_usage else b"") + b"}\n\n"

        def delta_chunk(text: str, lp: dict | None, out: RequestOutput) -> bytes:
            if chat:
                body = '"delta":{"content":' + dumps(text) + "}" if text else '"delta":{}'
            else:
                body = '"text":' + dumps(text)
            body += ',"logprobs":' + ("null" if lp is None else dumps(lp))
            body += ',"finish_reason":' + ("null" if out.finish_reason is None else dumps(out.finish_reason))
            if out.finished:
                body += ',"stop_reason":' + dumps(out.stop_reason)
            return pre + body.encode() + post

        try:
            if chat:
                await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
            offset, final = 0, None
            try:
                while batch := await stream.next_batch():
                    final = batch[-1]
                    if final.finish_reason == "error":
                        raise EngineError(f"engine error: {final.error or 'unknown'}")
                    text = "".join(o.new_text for o in batch) if len(batch) > 1 else final.new_text
                    lps = [lp for o in batch for lp in (o.new_logprobs or [])]
                    if not (text or lps or final.finished):
                        continue
                    lp = self._logprobs(req, lps, offset) if req.logprobs is not None and lps else None
                    offset += len(text)
                    await resp.write(delta_chunk(text, lp, final))
            except EngineError as e:
                err = APIError(500, str(e), "internal_server_error", None, "engine_error")
                await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                final = None
            if final is not None and req.include_usage:
                usage_field = {}
                await resp.write(chunk(None, usage=_usage(final)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client went away; the caller aborts the request
            pass
        return resp

    # -- logprobs ---------------------------------------------------------------------------------
    def _tok(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def _logprobs(self, req: GenerateRequest, lps: list[TokenLogprob], text_offset: int) -> dict:
        if req.kind == "chat":
            def entry(tid: int, lp: float) -> dict:
                s = self._tok(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**entry(t.token_id, t.logprob),
                                 "top_logprobs": [entry(i, v) for i, v in t.top.items()]} for t in lps]}
        tokens = [self._tok(t.token_id) for t in lps]
        offsets = []
        for s in tokens:
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{self._tok(i): v for i, v in t.top.items()} for t in lps], "text_offset": offsets}

    # -- the rest ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "tokenmill",
                "root": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    async def health(self, request: web.Request) -> web.Response:
        """200 while the server takes work; 503 when draining or when the engine core is gone."""
        if self.fatal is not None or not self.engine.alive:
            why = self.fatal or self.engine.dead_reason or "the engine core is not running"
            return web.json_response({"status": "engine_dead", "detail": why}, status=503,
                                     headers={DRAINING_HEADER: "1"})
        if self.draining:
            return web.json_response({"status": "draining"}, status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S), DRAINING_HEADER: "1"})
        return web.json_response({"status": "ok"})

    async def openapi(self, request: web.Request) -> web.Response:
        from tokenmill.server.openapi import openapi_spec

        return web.json_response(openapi_spec(self.model_names, self.api_key is not None))

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        if self.admission is not None:
            body += self.admission.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def state(self, request: web.Request) -> web.Response:
        """The engine's latest EngineStats plus what the server holds (for routers and admission)."""
        s = self.engine.stats()
        stats = {**asdict(s), "kv_usage": s.kv_usage} if s is not None else None
        return web.json_response({
            "model": self.model_names[0], "max_model_len": self.engine.max_model_len,
            "kv_capacity_tokens": self.kv_capacity_tokens, "num_pending": self.engine.num_pending(),
            "num_in_flight": self.engine.num_in_flight(), "engine_errors": self.engine.error_count,
            "engine_step_seconds": self.engine.step_seconds, "stats": stats,
            "engine_core_pid": getattr(self.engine.engine, "pid", None), "draining": self.draining,
            "core_results": self.engine.num_results, "core_frames_sent": self.engine.frames_sent,
            "stop_string_aborts": self.engine.stop_aborts,
        })

    # -- middlewares ------------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = APIError(e.status, f"{e.reason}: {request.method} {request.path}",
                           "invalid_request_error" if e.status < 500 else "internal_server_error")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # noqa: BLE001 - a bug in a handler: a 500 for this request, the server lives
            log.exception("unhandled error in %s %s", request.method, request.path)
            err = APIError(500, "internal server error", "internal_server_error")
        if request.path.startswith("/v1/"):
            reason = {401: "unauthorized", 429: "overloaded"}.get(err.status, "invalid" if err.status < 500 else None)
            if reason:
                self.metrics.rejected[reason].inc()
        return web.json_response(err.body(), status=err.status, headers=err.headers)

    @web.middleware
    async def auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key is not None and (request.path == "/v1" or request.path.startswith("/v1/")):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.api_key}".encode()):
                raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                               "authentication_error", None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)


async def _json_body(request: web.Request):
    try:
        raw = await request.read()
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _refusal_message(e: Refused, cls) -> str:
    slo = f"the {cls.name!r} class's SLO (TTFT {cls.ttft_slo_s:g} s, TPOT {cls.tpot_slo_s:g} s)"
    why = {"slo": f"the server is too busy to meet {slo} now",
           "deadline": f"the server could not start this request in time to meet {slo}",
           "queue-full": f"the {cls.name!r} class's queue of held requests is full"}.get(e.reason, str(e))
    return (f"{why}; retry after {_retry_after(e.retry_after_s)} s (admission control: --admission, --slo; "
            f"the x-tokenmill-class header picks a class with a looser SLO)")


def _retry_after(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110); at least 1."""
    return str(max(1, int(-(-seconds // 1))))


def _usage(out: RequestOutput) -> dict:
    n = len(out.output_token_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": n,
            "total_tokens": out.num_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def create_app(engine, *, api_key: str | None = None, served_model_names: list[str] | None = None,
               max_pending: int = 4096, enable_prefix_caching: bool = True,
               stream_interval: int = 1, admission: ServerAdmissionConfig | None = None,
               step_budget=None) -> web.Application:
    """An aiohttp app serving `engine`: a started EngineProcess (the core in its own process), or an LLMEngine
    or anything with its interface (run in a thread). The engine core's loop starts with the app and stops
    at its cleanup. `admission`: the SLO classes and admission policy
    (default: the router's default classes, leading-indicator admission)."""
    names = list(served_model_names or [engine.model_name])
    holder: dict = {}
    metrics = ServerMetrics(names[0], engine.max_model_len,
                            lambda: (holder["engine"].stats(), holder["engine"].num_pending()),
                            enable_prefix_caching=enable_prefix_caching)
    gate = ServerAdmission(engine, admission or ServerAdmissionConfig())
    async_engine = holder["engine"] = AsyncEngine(engine, metrics, max_pending=max_pending,
                                                  stream_interval=stream_interval, step_budget=step_budget,
                                                  on_progress=gate.progress,
                                                  on_core_exit=lambda msg: server.core_died(msg))
    server = OpenAIServer(async_engine, metrics, names, api_key, getattr(engine, "kv_capacity_tokens", None), gate)
    app = web.Application(middlewares=[server.errors, server.auth], client_max_size=MAX_BODY_BYTES)
    app[SERVER_KEY] = server

    async def start(_app):
        await async_engine.start()
        await gate.start()

    async def stop(_app):
        await gate.close()
        await async_engine.shutdown()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.prometheus)
    app.router.add_get("/tokenmill/state", server.state)
    app.router.add_get("/openapi.json", server.openapi)
    return app


SERVER_KEY = web.AppKey("tokenmill_server", OpenAIServer)


async def serve(app: web.Application, host: str, port: int, on_ready: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None, drain_timeout: float = 30.0) -> int:
    """Run `app` until SIGINT/SIGTERM (or `stop` is set), then drain (module docstring). Client disconnects
    cancel their handlers. Returns the exit code: 0 after a drain, 1 if the engine core died."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    server = app.get(SERVER_KEY)
    stop = stop or asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            force.set()  # a second signal: stop now
        stop.set()

    if server is not None:
        server.on_fatal = force.set
        if server.fatal is not None:
            force.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    if on_ready:
        on_ready(f"http://{bound_host}:{bound_port}")
    try:
        await _first(stop.wait(), force.wait())
        if server is not None and server.fatal is None and not force.is_set():
            server.draining = True
            log.warning("draining: %d request(s) in flight, up to %.0f s", server.num_active, drain_timeout)
            try:
                await asyncio.wait_for(_first(server.idle.wait(), force.wait()), drain_timeout)
            except asyncio.TimeoutError:
                log.warning("drain timeout: %d request(s) still in flight end with an error", server.num_active)
            if server.num_active:
                server.engine.fail_all("the server is shutting down (drain timeout)")
                await asyncio.wait_for(server.idle.wait(), 5.0)
    except asyncio.TimeoutError:
        pass
    finally:
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    return 1 if server is not None and server.fatal is not None else 0


async def _first(*aws) -> None:
    """Wait until the first of `aws` completes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
