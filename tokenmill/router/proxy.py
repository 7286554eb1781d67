"""Forward one OpenAI request to workers: retried elsewhere until its first token, passed through after.

An attempt that fails before its first token (refused connection, 5xx/429/503, stream cut, error event,
first-token timeout) is retried on a worker not yet tried, up to `max_attempts`; nothing has reached the
client yet, so this is invisible to it. Streams are buffered only until the first token event (a role-only
chunk is not a token); after it, a failure ends the stream with an OpenAI-style `data: {"error": ...}`
event. Worker 4xx answers (the client's fault) are passed through unchanged. Every request ends in an
answer: a response, an error body, or an error event — none is dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tokenmill.router.classes import PRIORITY_HEADER
from tokenmill.router.health import DRAINING_HEADER
from tokenmill.router.router import Refused, RequestCtx, Router
from tokenmill.router.worker_state import InFlight

log = logging.getLogger("tokenmill.router")
PASS_THROUGH_STATUSES = range(400, 500)
RETRY_STATUSES = {408, 429}  # and every 5xx


class Retryable(Exception):
    """This attempt failed before the first token; another worker may serve the request."""

    def __init__(self, reason: str, status: int = 502, body: bytes = b"", retry_after: str | None = None):
        super().__init__(reason)
        self.reason, self.status, self.body, self.retry_after = reason, status, body, retry_after


@dataclass
class Result:
    response: web.StreamResponse
    outcome: str  # "ok" | "failed" | "client_error" | "cancelled"
    output_tokens: int = 0
    usage: dict | None = None


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, int(-(-retry_after_s // 1))))} if retry_after_s is not None else None
    return web.json_response(error_body(message, type_, code, param), status=status, headers=headers)


async def serve(router: Router, session: aiohttp.ClientSession, ctx: RequestCtx, body: dict, path: str,
                request: web.Request) -> web.StreamResponse:
    """Answer one request (raises Refused when admission refuses it before any attempt)."""
    last: Retryable | None = None
    for attempt in range(router.cfg.max_attempts):
        try:
            f = await router.acquire(ctx)
        except Refused:
            if last is None:
                raise
            break  # no worker left to retry on: report the last failure below
        result = None
        try:
            result = await _attempt(router, session, ctx, f, body, path, request)
        except Retryable as e:
            log.warning("request %s: attempt %d on %s failed before its first token (%s)", ctx.request_id,
                        attempt + 1, f.worker, e.reason)
            router.metrics.retries.labels(f.worker, e.reason).inc()
            last = e
        finally:
            router.finish(ctx, f, result.output_tokens if result else 0, result.usage if result else None)
        if result is not None:
            _record(router, ctx, result)
            return result.response
    router.metrics.requests.labels(ctx.cls.name, "failed").inc()
    if last.status in (429, 503) and last.body:
        headers = {"Retry-After": last.retry_after} if last.retry_after else None
        return web.Response(status=last.status, body=last.body, content_type="application/json", headers=headers)
    return error_response(502, f"no worker served the request: {len(ctx.tried)} worker(s) tried, last error: "
                          f"{last.reason}", "upstream_error", "upstream_failed")


def _record(router: Router, ctx: RequestCtx, result: Result) -> None:
    """Outcome per class, and whether the request met its class's SLOs (non-streaming: end to end)."""
    router.metrics.requests.labels(ctx.cls.name, result.outcome).inc()
    if result.outcome != "ok":
        return
    now, n = router.clock(), result.output_tokens
    if ctx.first_token_s is None:
        met = now - ctx.arrival_s <= ctx.cls.ttft_slo_s + ctx.cls.tpot_slo_s * max(0, n - 1)
    else:
        tpot_s = (now - ctx.first_token_s) / (n - 1) if n > 1 else 0.0
        met = ctx.first_token_s - ctx.arrival_s <= ctx.cls.ttft_slo_s and tpot_s <= ctx.cls.tpot_slo_s
    if met:
        router.metrics.slo_met.labels(ctx.cls.name).inc()


def _upstream_request(router: Router, ctx: RequestCtx, f: InFlight, body: dict, request: web.Request):
    w = router.pool.get(f.worker)
    body = dict(body)
    if w is not None and w.sends_priority_field:
        body["priority"] = ctx.cls.priority
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    headers = {"Content-Type": "application/json", PRIORITY_HEADER: str(ctx.cls.priority),
               "x-request-id": ctx.request_id}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return json.dumps(body).encode(), headers


async def _attempt(router: Router, session: aiohttp.ClientSession, ctx: RequestCtx, f: InFlight, body: dict,
                   path: str, request: web.Request) -> Result:
    cfg = router.cfg
    data, headers = _upstream_request(router, ctx, f, body, request)
    stream = bool(body.get("stream"))
    timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s,
                                    sock_read=None if stream else cfg.first_token_timeout_s + cfg.read_timeout_s)
    prefill_timer = None
    if not stream:  # no first token to observe: assume the prefill is done when predicted
        prefill_timer = asyncio.get_running_loop().call_later(max(0.0, f.predicted_ttft_s), router.end_prefill, f)
    try:
        async with session.post(f.worker + path, data=data, headers=headers, timeout=timeout) as up:
            if up.status != 200:
                if up.status == 503 and up.headers.get(DRAINING_HEADER):  # draining: route elsewhere from now on
                    router.mark_down(f.worker)
                return await _non_200(up)
            if stream:
                return await _relay_stream(router, ctx, f, up, request, bool(
                    (body.get("stream_options") or {}).get("include_usage")))
            payload = await up.read()
            return _non_stream_result(payload, up)
    except aiohttp.ClientConnectorError as e:
        router.mark_down(f.worker)
        raise Retryable("connect") from e
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        raise Retryable(type(e).__name__) from e
    finally:
        if prefill_timer is not None:
            prefill_timer.cancel()


async def _non_200(up: aiohttp.ClientResponse) -> Result:
    payload = await up.read()
    if up.status in PASS_THROUGH_STATUSES and up.status not in RETRY_STATUSES:
        ctype = up.headers.get("Content-Type", "application/json").split(";")[0]
        return Result(web.Response(status=up.status, body=payload, content_type=ctype), "client_error")
    raise Retryable(f"http_{up.status}", up.status, payload, up.headers.get("Retry-After"))


def _non_stream_result(payload: bytes, up: aiohttp.ClientResponse) -> Result:
    usage, tokens = None, 0
    try:
        doc = json.loads(payload)
        usage = doc.get("usage") if isinstance(doc, dict) else None
        tokens = int((usage or {}).get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        raise Retryable("bad_json") from None
    ctype = up.headers.get("Content-Type", "application/json").split(";")[0]
    return Result(web.Response(status=200, body=payload, content_type=ctype), "ok", tokens,
                  usage if isinstance(usage, dict) else None)


def _has_token(event: dict) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("finish_reason") is not None:
            return True
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")
                                        or delta.get("reasoning_content")):
            return True
    return False


def _parse_event(data: bytes) -> dict | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _usage_of(event: dict, data: bytes, usage: dict | None, want_usage: bool) -> tuple[bytes | None, dict | None]:
    """(the event's bytes to forward, or None to drop it; the usage seen so far). The router always asks
    the worker for usage; a client that did not gets the chunk without it (dropped when it has no choices)."""
    if event.get("usage"):
        usage = event["usage"]
        if not want_usage:
            if not event.get("choices"):
                return None, usage
            event.pop("usage")
            data = json.dumps(event).encode()
    return data, usage


def _must_parse(data: bytes) -> bool:
    """After the first token: does this event need json.loads? Only an error or a non-null usage does
    (a JSON string cannot hold the bytes `"usage"` or `"error"`: its quotes are escaped; a false positive,
    e.g. a logprobs key, only costs a parse)."""
    if b'"error"' in data:
        return True
    i = data.find(b'"usage"')
    while i >= 0:
        rest = data[i + 7:i + 14].lstrip()
        if not (rest.startswith(b":") and rest[1:].lstrip().startswith(b"null")):
            return True
        i = data.find(b'"usage"', i + 7)
    return False


class _ReadWatchdog:
    """Fails `stream` (an aiohttp StreamReader) with TimeoutError after `timeout_s` without data: one timer,
    re-armed only when it fires, instead of a wait_for (a new Task) per read."""

    def __init__(self, stream, timeout_s: float):
        self.loop = asyncio.get_running_loop()
        self.stream, self.timeout_s = stream, timeout_s
        self.last = self.loop.time()
        self.handle: asyncio.TimerHandle | None = self.loop.call_later(timeout_s, self._check)

    def fed(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        idle_s = self.loop.time() - self.last
        if idle_s >= self.timeout_s:
            self.handle = None
            self.stream.set_exception(asyncio.TimeoutError())
        else:
            self.handle = self.loop.call_later(self.timeout_s - idle_s, self._check)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


async def _relay_stream(router: Router, ctx: RequestCtx, f: InFlight, up: aiohttp.ClientResponse,
                        request: web.Request, want_usage: bool) -> Result:
    """Until the first token: parse every event, buffer, retry elsewhere on failure. Then: pass through."""
    buffered: list[bytes] = []
    usage = None
    while True:
        try:
            line = await asyncio.wait_for(up.content.readline(), router.cfg.first_token_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            raise Retryable("first_token_timeout" if isinstance(e, asyncio.TimeoutError) else "stream_cut") from e
        if not line:  # EOF without [DONE]
            raise Retryable("stream_cut")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":  # finished without any token (e.g. max_tokens=0): still an answer
            router.first_token(ctx, f)
            resp = await _open_stream(request, buffered)
            return await _end_stream(resp, b"data: [DONE]\n\n", 0, usage)
        event = _parse_event(data)
        if event is None:
            continue
        if "error" in event:
            raise Retryable("error_event")
        data, usage = _usage_of(event, data, usage, want_usage)
        if data is None:
            continue
        buffered.append(b"data: " + data + b"\n\n")
        if _has_token(event):
            router.first_token(ctx, f)
            resp = await _open_stream(request, buffered)
            return await _pass_through(router, f, up, resp, usage, want_usage)


async def _pass_through(router: Router, f: InFlight, up: aiohttp.ClientResponse, resp: web.StreamResponse,
                        usage: dict | None, want_usage: bool) -> Result:
    """After the first token: forward what arrived, one write per read, without parsing token events.

    Each event is still re-framed as `data: ...\n\n` (other SSE lines dropped), exactly as the client got it
    when every event was parsed; only events that may carry an error or a usage (`_must_parse`) are parsed.
    Every other event counts as one streamed token (`_has_token` would also say so for all but an empty
    delta); the count is batched per read and replaced by `usage.completion_tokens` at the end."""
    tokens, tail = 1, b""
    watchdog = _ReadWatchdog(up.content, router.cfg.read_timeout_s)
    try:
        while True:
            try:
                chunk = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
                return await _fail_stream(resp, f"the worker stream broke: {type(e).__name__}", tokens, usage)
            eof = not chunk
            if eof:  # the worker closed the stream: the last line may lack its newline
                if not tail:
                    return await _fail_stream(resp, "the worker closed the stream before [DONE]", tokens, usage)
                chunk = b"\n"
            watchdog.fed()
            lines = (tail + chunk).split(b"\n") if tail else chunk.split(b"\n")
            tail = lines.pop()  # b"" when the chunk ended a line
            out: list[bytes] = []
            n, last, outcome = 0, None, "ok"
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    last = b"data: [DONE]\n\n"
                    break
                if not data.startswith(b"{"):
                    continue  # not a JSON object: dropped, as before
                if _must_parse(data):
                    event = _parse_event(data)
                    if event is None:
                        continue
                    if "error" in event:
                        last, outcome = b"data: " + data + b"\n\n", "failed"
                        break
                    data, usage = _usage_of(event, data, usage, want_usage)
                    if data is None:
                        continue
                    n += _has_token(event)
                else:
                    n += 1
                out.append(b"data: " + data + b"\n\n")
            if n:
                tokens += n
                router.output_tokens(f, n)
            if last is None and eof:
                last, outcome = _error_event("the worker closed the stream before [DONE]"), "failed"
            if last is not None:
                out.append(last)
                return await _end_stream(resp, b"".join(out), tokens, usage, outcome)
            if out:
                try:
                    await resp.write(b"".join(out))
                except (ConnectionError, RuntimeError):
                    return Result(resp, "cancelled", tokens, usage)
    finally:
        watchdog.cancel()


async def _open_stream(request: web.Request, buffered: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(b"".join(buffered))
    return resp


async def _end_stream(resp: web.StreamResponse, last: bytes, tokens: int, usage: dict | None,
                      outcome: str = "ok") -> Result:
    if usage and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    try:
        await resp.write(last)
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        return Result(resp, "cancelled", tokens, usage)
    return Result(resp, outcome, tokens, usage if isinstance(usage, dict) else None)


def _error_event(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, "upstream_error", "worker_failed")).encode() + b"\n\n"


async def _fail_stream(resp: web.StreamResponse, message: str, tokens: int, usage: dict | None) -> Result:
    return await _end_stream(resp, _error_event(message), tokens, usage, "failed")
