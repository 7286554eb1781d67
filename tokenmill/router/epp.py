"""Endpoint Picker (EPP) mode: Envoy's ext_proc gRPC service, so a Gateway API Inference Extension gateway
(an `InferencePool` whose `endpointPickerRef` is `tokenmill route --epp-port 9002`) routes with tokenmill's
policies. The protocol (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):

    request headers   read (`:path`, class header, API key); answered at once (BUFFERED) or held until the
                      body ends (FULL_DUPLEX_STREAMED, what the inference gateways configure)
    request body      buffered to its end, read by the HTTP proxy's own reader (request_fields.read_request);
                      then the *same* decision the proxy makes: `Router.acquire` (routing policy + admission
                      on a RouteSnapshot; the request may be held in its class queue)
        admitted      header `x-gateway-destination-endpoint: ip:port` and dynamic metadata
                      `envoy.lb` / `x-gateway-destination-endpoint` (the same value)
        refused       ImmediateResponse 429 (admission: shed) with Retry-After and an OpenAI error body
        no endpoint   ImmediateResponse 503 (nothing healthy, or nothing in the subset hint)
    subset hint       metadata_context `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`:
                      only those endpoints are candidates (RequestCtx.only)
    response headers  `x-gateway-destination-endpoint-served` in metadata_context (`envoy.lb`): when the
                      gateway fell back to another endpoint, the load is moved there
    response body     streaming requests: the first chunk is the first token (the TTFT the router learns
                      from); the end of the body (or of the gRPC stream) finishes the request's load.
                      Non-streaming requests, and streams when the gateway sends no response body
                      (response_body_mode NONE), count their prefill done at the predicted TTFT, as the
                      proxy does for non-streaming requests

The router's load view is thus fed by the gateway's traffic exactly as by its own proxy (router.py), and an
EPP and an HTTP proxy on one Router share it. gRPC health (grpc.health.v1) answers for "", "liveness",
"readiness" and "envoy.service.ext_proc.v3.ExternalProcessor"; readiness turns SERVING after the first
worker discovery round (the EPP's datastore is synced).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Histogram

from tokenmill.errors import InvalidRequestError
from tokenmill.router.metrics import Labelled
from tokenmill.router.request_fields import read_request
from tokenmill.router.router import Refused, RequestCtx, Router
from tokenmill.router.queues import Held
from tokenmill.router.worker_state import InFlight

log = logging.getLogger("tokenmill.router.epp")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
COMPLETION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0)
E2E_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25,
               1.0, 2.5)


def endpoint_of(url: str) -> str:
    """http://10.0.0.7:8000 -> 10.0.0.7:8000 (the EPP protocol's `ip:port`)."""
    return urlsplit(url).netloc


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _metadata_value(md: base_pb2.Metadata, namespace: str, key: str):
    if namespace not in md.filter_metadata:
        return None
    fields = md.filter_metadata[namespace].fields
    if key not in fields:
        return None
    v = fields[key]
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [x.string_value for x in v.list_value.values if x.WhichOneof("kind") == "string_value"]
    return None


def _split_endpoints(value) -> list[str]:
    items = value if isinstance(value, list) else [value]
    return [e.strip() for item in items for e in item.split(",") if e.strip()]


def _immediate(status: int, message: str, code: str, retry_after_s: float | None = None) -> pb.ProcessingResponse:
    kind = {400: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "overloaded_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                      raw_value=b"application/json"))]
    if retry_after_s is not None:
        seconds = str(max(1, int(-(-retry_after_s // 1)))).encode()
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=seconds)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),
        body=body, details=f"tokenmill_epp_{code}"))


@functools.lru_cache(maxsize=4096)
def _destination(endpoint: str) -> tuple[pb.ProcessingResponse, pb.ProcessingResponse]:
    """The answers that name the picked endpoint (header mutation and dynamic metadata, always the same
    value), as a headers response and as a body response: built once per endpoint and sent as they are
    (never mutated)."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=endpoint.encode()))]), clear_route_cache=True)
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return (pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=md),
            pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=md))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_length = functools.lru_cache(maxsize=4096)(_varint)  # (lengths repeat: a C-level cache hit instead of the loop)


def _field_tag(descriptor, name: str) -> bytes:
    """The wire tag of a length-delimited field (a message or bytes), from the maintained proto's descriptor."""
    return _varint(descriptor.fields_by_name[name].number << 3 | 2)


class StreamedBody:
    """A FULL_DUPLEX_STREAMED body passed on unchanged: ProcessingResponse.<phase> (request_body or
    response_body) .response.body_mutation.streamed_response = {body, end_of_stream}.

    The frames and h2 transports send `SerializeToString()`: the serialized message written directly (the body
    spliced between the nested length prefixes), byte for byte what protobuf serializes for `message()` (a
    test checks it against protobuf on bodies of every length class); building the message instead copies the
    ~1.7 kB body into protobuf and back out on every request. grpc.aio needs the message itself: `message()`."""

    __slots__ = ("phase", "body", "eos")
    # the fixed part of the path, outermost first: ProcessingResponse.<phase> -> BodyResponse.response ->
    # CommonResponse.body_mutation -> BodyMutation.streamed_response
    _PATH = {phase: (_field_tag(pb.ProcessingResponse.DESCRIPTOR, phase), _field_tag(pb.BodyResponse.DESCRIPTOR, "response"),
                     _field_tag(pb.CommonResponse.DESCRIPTOR, "body_mutation"),
                     _field_tag(pb.BodyMutation.DESCRIPTOR, "streamed_response"))
             for phase in ("request_body", "response_body")}
    _BODY = _field_tag(pb.StreamedBodyResponse.DESCRIPTOR, "body")
    _EOS = _varint(pb.StreamedBodyResponse.DESCRIPTOR.fields_by_name["end_of_stream"].number << 3 | 0) + b"\x01"

    def __init__(self, phase: str, body: bytes, eos: bool):
        if phase not in self._PATH:
            raise ValueError(f"a streamed body answers request_body or response_body, not {phase!r}")
        self.phase, self.body, self.eos = phase, body, eos

    def message(self) -> pb.ProcessingResponse:
        r = pb.ProcessingResponse()
        sr = getattr(r, self.phase).response.body_mutation.streamed_response  # (field path: no nested copies)
        sr.body = self.body
        sr.end_of_stream = self.eos
        return r

    def SerializeToString(self) -> bytes:
        body = self.body
        t0, t1, t2, t3 = self._PATH[self.phase]
        # proto3: an empty body / a false eos are not written; the lengths inside out, the body copied once
        head = self._BODY + _length(len(body)) if body else b""
        eos = self._EOS if self.eos else b""
        n3 = len(head) + len(body) + len(eos)
        p3 = _length(n3)
        n2 = len(t3) + len(p3) + n3
        p2 = _length(n2)
        n1 = len(t2) + len(p2) + n2
        p1 = _length(n1)
        return b"".join((t0, _length(len(t1) + len(p1) + n1), t1, p1, t2, p2, t3, p3, head, body, eos))


HEADERS_ACK = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
BODY_ACK = pb.ProcessingResponse(request_body=pb.BodyResponse())
RESPONSE_HEADERS_ACK = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
RESPONSE_BODY_ACK = pb.ProcessingResponse(response_body=pb.BodyResponse())


class EppMetrics:
    def __init__(self, registry):
        self.requests = Counter("tokenmill_router_epp_requests", "ext_proc streams by outcome (picked, shed: 429, "
                                "unavailable: 503, bad_request, fallback: the gateway served another endpoint)",
                                ["outcome"], registry=registry)
        self.decision = Histogram("tokenmill_router_epp_decision_seconds", "Request body complete -> endpoint "
                                  "picked (admission holds included)", buckets=DECISION_BUCKETS, registry=registry)
        # the picker's side of the gateway's wait, as the extension's reference picker reports its scheduling
        # latency: the first message of the stream (the request headers) read by the servicer -> the answer (the
        # endpoint, or a 429/503/400) handed to gRPC and written. Queueing on the picker's event loop between
        # the two messages is in it; the network and the gateway's own gRPC client are not.
        self.e2e = Histogram("tokenmill_router_epp_e2e_seconds", "ext_proc request headers received -> the "
                             "answer (picked endpoint or ImmediateResponse) written to the stream",
                             buckets=E2E_BUCKETS, registry=registry)
        self.picked = self.requests.labels("picked")
        self.requests = Labelled(self.requests)


@dataclass(slots=True)
class _Exchange:
    """One HTTP request as the gateway streams it to the EPP."""

    router: Router
    metrics: EppMetrics
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    full_duplex_request: bool = False
    full_duplex_response: bool = False
    response_bodies: bool = True  # False: the gateway sends no response body (response_body_mode NONE)
    subset: list[str] | None = None
    ctx: RequestCtx | None = None
    flight: InFlight | None = None
    counted: bool = False  # holds one of router.in_flight
    streaming: bool = False
    output_events: int = 0
    outcome: str = "cancelled"  # the gateway closed the stream before any response (client gone, upstream failed)
    done: bool = False
    prefill_timer: asyncio.TimerHandle | None = None
    answered: bool = False  # the answer to the request (endpoint or refusal) was returned by handle()
    held: Held | None = None  # admission holds the request (its class queue entry) until it is picked or refused
    picked_at: tuple[float, float] = (0.0, 0.0)  # the decision's start and end (perf_counter; end 0: refused)

    async def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        out = self.step(req)
        return out if isinstance(out, list) else await out

    def step(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | Awaitable[list[pb.ProcessingResponse]]:
        """The answers to one message: a list when they are known now (every message but a request that
        admission holds), else an awaitable of them (the held request's pick, or its refusal). A body passed
        on is a `StreamedBody` (its `message()` is the ProcessingResponse)."""
        if req.HasField("protocol_config"):
            self.full_duplex_request = req.protocol_config.request_body_mode == FULL_DUPLEX
            self.full_duplex_response = req.protocol_config.response_body_mode == FULL_DUPLEX
            self.response_bodies = req.protocol_config.response_body_mode != processing_mode_pb2.ProcessingMode.NONE
        which = req.WhichOneof("request")
        if which == "request_headers":
            self.headers = headers = {}
            for h in req.request_headers.headers.headers:  # (_header_value, inline: once per header per request)
                raw = h.raw_value
                headers[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
            subset = _metadata_value(req.metadata_context, SUBSET_NAMESPACE, SUBSET_KEY)
            self.subset = None if subset is None else _split_endpoints(subset)
            if req.request_headers.end_of_stream:  # no body (GET): pick with an empty prompt
                return self._pick(b"", "request_headers")
            if self.full_duplex_request:
                return []  # answered with the body, once the endpoint is picked
            return [HEADERS_ACK]
        if which == "request_body":
            if self.ctx is not None:  # already decided (should not happen): pass it on
                return [self._body_passthrough(req.request_body.body, req.request_body.end_of_stream)]
            self.body += req.request_body.body
            if len(self.body) > self.router.cfg.max_body_bytes:
                self.answered = True
                self.metrics.requests.labels("bad_request").inc()
                return [_immediate(413, f"the request body exceeds {self.router.cfg.max_body_bytes} bytes",
                                   "body_too_large")]
            if not req.request_body.end_of_stream:
                if self.full_duplex_request:
                    return []
                return [BODY_ACK]
            return self._pick(bytes(self.body), "request_body")
        if which == "request_trailers":
            trailers = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            if self.full_duplex_request and not self.answered:
                # the body ended with trailers instead of end_of_stream (FULL_DUPLEX_STREAMED needs
                # request_trailer_mode SEND): the body is complete now, pick; its passthrough is not the end
                out = self._pick(bytes(self.body), "request_body", body_eos=False)
                if isinstance(out, list):
                    return out if self.ctx is None else [*out, trailers]
                return self._then_trailers(out, trailers)
            return [trailers]
        if which == "response_headers":
            self._served(req.metadata_context, req.response_headers)
            if req.response_headers.end_of_stream:
                self.close()
            return [RESPONSE_HEADERS_ACK]
        if which == "response_body":
            self._response_chunk(req.response_body.body, req.response_body.end_of_stream)
            if self.full_duplex_response:
                return [StreamedBody("response_body", req.response_body.body, req.response_body.end_of_stream)]
            return [RESPONSE_BODY_ACK]
        if which == "response_trailers":
            self.close()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _then_trailers(self, out: Awaitable[list[pb.ProcessingResponse]],
                             trailers: pb.ProcessingResponse) -> list[pb.ProcessingResponse]:
        answers = await out
        return answers if self.ctx is None else [*answers, trailers]

    def _body_passthrough(self, body: bytes, eos: bool) -> pb.ProcessingResponse | StreamedBody:
        if self.full_duplex_request:
            return StreamedBody("request_body", body, eos)
        return BODY_ACK

    def _new_request(self, body: bytes) -> RequestCtx:
        router = self.router
        path = self.headers.get(":path", "").split("?")[0]
        fields = read_request(body, self.headers, COMPLETION_PATHS.get(path), router.cfg)  # as the proxy reads it
        self.streaming = fields.stream
        ctx = router.new_request(fields.key, router.classes[fields.class_name], fields.max_tokens)
        if self.subset is not None:
            by_endpoint = {endpoint_of(w.url): w.url for w in router.pool}
            ctx.only = frozenset(by_endpoint[e] for e in self.subset if e in by_endpoint)
        return ctx

    def _pick(self, body: bytes, phase: str, body_eos: bool = True
              ) -> list[pb.ProcessingResponse] | Awaitable[list[pb.ProcessingResponse]]:
        router, m = self.router, self.metrics
        t0 = time.perf_counter()
        self.picked_at = (t0, 0.0)
        self.answered = True  # every return below is the answer
        try:
            ctx = self._new_request(body)
        except InvalidRequestError as e:
            m.requests.labels("bad_request").inc()
            return [_immediate(400, str(e), "invalid_request")]
        if router.in_flight >= router.cfg.max_in_flight:
            router.metrics.rejections.labels(ctx.cls.name, "overloaded").inc()
            m.requests.labels("unavailable").inc()
            return [_immediate(503, f"the router has {router.in_flight} requests in flight (max_in_flight)",
                               "overloaded", 1.0)]
        router.in_flight += 1
        self.counted = True
        try:
            got = router.acquire_now(ctx)
        except Refused as e:
            return self._refused(ctx, e)
        if isinstance(got, InFlight):
            return self._picked(ctx, got, t0, phase, body, body_eos)
        self.held = got
        return self._held(ctx, got, t0, phase, body, body_eos)

    async def _held(self, ctx: RequestCtx, held: Held, t0: float, phase: str, body: bytes,
                    body_eos: bool) -> list[pb.ProcessingResponse]:
        """Admission held the request in its class queue: the pick (or the refusal) when it leaves."""
        try:
            flight = await self.router.wait_held(held)
        except Refused as e:
            self.held = None
            return self._refused(ctx, e)
        self.held = None
        return self._picked(ctx, flight, t0, phase, body, body_eos)

    def _refused(self, ctx: RequestCtx, e: Refused) -> list[pb.ProcessingResponse]:
        self.picked_at = (self.picked_at[0], 0.0)
        self.router.metrics.requests.labels(ctx.cls.name, "rejected").inc()
        self.metrics.requests.labels("shed" if e.status == 429 else "unavailable").inc()
        self.close()
        return [_immediate(e.status, str(e), e.reason, e.retry_after_s)]

    def _picked(self, ctx: RequestCtx, flight: InFlight, t0: float, phase: str, body: bytes,
                body_eos: bool) -> list[pb.ProcessingResponse]:
        router, m = self.router, self.metrics
        self.flight = flight
        self.ctx = ctx
        if not (self.streaming and self.response_bodies):
            # no first token to observe (a non-streaming answer comes whole; or the gateway sends no response
            # body): the prefill is taken as done when predicted, as the proxy does for non-streaming requests
            self.prefill_timer = asyncio.get_running_loop().call_later(
                max(0.0, self.flight.predicted_ttft_s), router.end_prefill, self.flight)
        t1 = time.perf_counter()
        m.decision.observe(t1 - t0)
        self.picked_at = (t0, t1)
        m.picked.inc()
        as_headers, as_body = _destination(endpoint_of(self.flight.worker))
        if phase == "request_headers":
            return [as_headers]
        if self.full_duplex_request:  # the held headers, then the whole body
            return [as_headers, self._body_passthrough(body, body_eos)]
        return [as_body]

    def _served(self, md: base_pb2.Metadata, headers: pb.HttpHeaders) -> None:
        """The gateway answered: move the load to the endpoint that served it if that is another one."""
        if self.flight is None:
            return
        router = self.router
        served = _metadata_value(md, LB_NAMESPACE, SERVED_KEY)
        served = _split_endpoints(served)[0] if served else None
        if served and served != endpoint_of(self.flight.worker):
            url = next((w.url for w in router.pool if endpoint_of(w.url) == served and not w.draining), None)
            if url is not None:
                self.metrics.requests.labels("fallback").inc()
                router.finish(self.ctx, self.flight, 0, None)
                w = router.pool.get(url)
                self.flight = w.start(self.ctx.request_id, self.flight.uncached_tokens, self.flight.predicted_ttft_s,
                                      router.clock(), self.flight.ttft_deadline_s, self.ctx.max_tokens,
                                      prompt_tokens=self.ctx.prompt_tokens)
                self.ctx.tried.add(url)
                if self.prefill_timer is not None:
                    self.prefill_timer.cancel()
                    self.prefill_timer = asyncio.get_running_loop().call_later(
                        max(0.0, self.flight.predicted_ttft_s), router.end_prefill, self.flight)
        status = next((_header_value(h) for h in headers.headers.headers if h.key == ":status"), "200")
        self.outcome = "ok" if status.startswith("2") else "failed"
        if not status.startswith("2"):
            self.close()

    def _response_chunk(self, chunk: bytes, eos: bool) -> None:
        if self.flight is None:
            return
        if self.streaming and chunk:
            events = chunk.count(b"data:") - chunk.count(b"[DONE]")
            if self.flight.first_token_s is None and events > 0:
                self.router.first_token(self.ctx, self.flight)
                events -= 1
            if events > 0 and self.flight.first_token_s is not None:
                self.router.output_tokens(self.flight, events)
                self.output_events += events
        if eos:
            self.close()

    def close(self) -> None:
        """The request is over (answered, refused, or the gateway closed the stream)."""
        if self.done:
            return
        self.done = True
        held, self.held = self.held, None
        if held is not None:  # closed while held, or before the wait for it even started
            fut = held.future
            if not fut.done():
                fut.cancel()
                self.router.queues.drop_done()
            elif not fut.cancelled() and fut.exception() is None:  # picked, but the pick never reached us
                self.router.finish(held.ctx, fut.result(), 0, None)
        if self.prefill_timer is not None:
            self.prefill_timer.cancel()
        if self.flight is not None:
            tokens = self.output_events + (self.flight.first_token_s is not None)
            self.router.finish(self.ctx, self.flight, tokens, None)
            self.router.metrics.requests.labels(self.ctx.cls.name, self.outcome).inc()
        if self.counted:
            self.router.in_flight -= 1
            self.counted = False


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """ext_proc on grpc.aio (`--epp-transport grpcio`)."""

    def __init__(self, router: Router):
        self.router = router
        self.metrics = EppMetrics(router.metrics.registry)

    async def Process(self, request_iterator, context):
        ex = _Exchange(self.router, self.metrics)
        arrived, timed = None, False
        try:
            async for req in request_iterator:
                if arrived is None:
                    arrived = time.perf_counter()
                for resp in await ex.handle(req):
                    # (resumes once grpc.aio has written it; its serializer takes protobuf messages only)
                    yield resp.message() if type(resp) is StreamedBody else resp
                if ex.answered and not timed:
                    timed = True
                    self.metrics.e2e.observe(time.perf_counter() - arrived)
        finally:
            ex.close()


TRANSPORTS = ("frames", "h2", "grpcio")


def EppServer(router: Router, host: str, port: int, transport: str = "grpcio", trace: str | None = None):
    """The EPP's gRPC server (ext_proc + health) on the router's event loop, listening on host:port (0: any
    free port, then `.port`). `transport`: grpcio (grpc.aio, the reference), h2 (epp_h2.py: the same
    messages over tokenmill's own gRPC server on the `h2` library) or frames (the same server with its
    HTTP/2 framed by grpc_frames.py, the cheapest). All have start(ready), set_ready(ready), stop(grace_s).
    `trace` (frames only): a file for every stream's hop time stamps, written at stop."""
    if trace is not None and transport != "frames":
        raise ValueError(f"an EPP trace needs the frames transport, not {transport!r}")
    if transport == "grpcio":
        return GrpcioEppServer(router, host, port)
    if transport in ("h2", "frames"):
        from tokenmill.router.epp_h2 import H2EppServer

        return H2EppServer(router, host, port, transport, trace)
    raise ValueError(f"unknown EPP transport {transport!r}; choose from {', '.join(TRANSPORTS)}")


class GrpcioEppServer:
    """The gRPC server on grpc.aio: ext_proc + health, on the router's event loop."""

    def __init__(self, router: Router, host: str, port: int):
        self.router = router
        self.server = grpc.aio.server()
        self.picker = EndpointPicker(router)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port} for the EPP")

    async def start(self, ready: bool) -> None:
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(ready)
        await self.server.start()

    async def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "readiness", EXT_PROC_SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)
