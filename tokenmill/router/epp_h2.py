"""The Endpoint Picker on tokenmill's own HTTP/2 gRPC server (grpc_h2.py): `--epp-transport h2`.

The same ext_proc exchange as the grpc.aio picker (epp.py: `_Exchange`, the same pure policy code, the same
metrics), the same messages (Envoy's maintained protos from xds-protos, parsed and serialized by protobuf),
and the gRPC health service (grpc.health.v1: Check and Watch, health_pb2 from grpcio-health-checking's
protos) with the same names and states. What differs is only the transport: h2's state machine and the
event loop's own sockets instead of gRPC's C-core and its poller (benchmarks: docs/benchmarks/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import socket
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2

from tokenmill.router.epp import (BODY_ACK, EXT_PROC_SERVICE, HEADERS_ACK, RESPONSE_BODY_ACK, RESPONSE_HEADERS_ACK,
                                  EppMetrics, _destination, _Exchange)
from tokenmill.router.grpc_h2 import Call, GrpcH2Server, Method, _Refuse
from tokenmill.router.router import Router

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
NOT_FOUND = 5
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
MAX_WIRE_CACHE = 8192


class _Wire:
    """Serialized forms of the answers that are built once (the acks, and the per-endpoint picks of
    epp._destination): kept with the message itself, so an entry is only ever hit by that very object."""

    def __init__(self):
        self.cache: dict[int, tuple[pb.ProcessingResponse, bytes]] = {}
        for m in (HEADERS_ACK, BODY_ACK, RESPONSE_HEADERS_ACK, RESPONSE_BODY_ACK):
            self.remember(m)

    def remember(self, m: pb.ProcessingResponse) -> None:
        if len(self.cache) >= MAX_WIRE_CACHE:
            self.cache.clear()
            for c in (HEADERS_ACK, BODY_ACK, RESPONSE_HEADERS_ACK, RESPONSE_BODY_ACK):
                self.cache[id(c)] = (c, c.SerializeToString())
        self.cache[id(m)] = (m, m.SerializeToString())

    def __call__(self, m: pb.ProcessingResponse) -> bytes:
        hit = self.cache.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        if m.HasField("dynamic_metadata") and any(m is d for d in _destination(_endpoint_named(m))):
            # a pick, as epp._destination builds it once per endpoint: worth keeping
            self.remember(m)
            return self.cache[id(m)][1]
        return m.SerializeToString()


def _endpoint_named(m: pb.ProcessingResponse) -> str:
    f = m.dynamic_metadata.fields
    if "envoy.lb" not in f:
        return ""
    return f["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value


class H2EppServer:
    """ext_proc + health over grpc_h2, on the router's event loop. The listening socket is bound here (so
    `port` is known, and a port in use fails at once, as grpc.aio's add_insecure_port does)."""

    def __init__(self, router: Router, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port} for the EPP: {e.strerror or e}") from None
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.router = router
        self.metrics = EppMetrics(router.metrics.registry)
        self.wire = _Wire()
        self.status: dict[str, int] = {}
        self.watchers: set[asyncio.Event] = set()
        self.server = GrpcH2Server({PROCESS: Method("stream", self.process), HEALTH_CHECK: Method("unary", self.check),
                                    HEALTH_WATCH: Method("stream", self.watch)})

    async def start(self, ready: bool) -> None:
        await self.set_health("liveness", SERVING)
        await self.set_ready(ready)
        await self.server.start_on(self.sock)

    async def set_ready(self, ready: bool) -> None:
        for name in ("", "readiness", EXT_PROC_SERVICE):
            await self.set_health(name, SERVING if ready else NOT_SERVING)

    async def set_health(self, name: str, status: int) -> None:
        self.status[name] = status
        for ev in self.watchers:
            ev.set()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)

    # -- ext_proc
    async def process(self, call: Call) -> None:
        ex = _Exchange(self.router, self.metrics)
        arrived, timed = None, False
        wire = self.wire
        try:
            while (data := await call.read()) is not None:
                if arrived is None:
                    arrived = time.perf_counter()
                try:
                    req = pb.ProcessingRequest.FromString(data)
                except Exception:  # protobuf's DecodeError
                    raise _Refuse(13, "a ProcessingRequest that does not parse") from None
                for resp in await ex.handle(req):
                    await call.write(wire(resp))  # handed to h2; on the socket at the end of this loop turn
                if ex.answered and not timed:
                    timed = True
                    self.metrics.e2e.observe(time.perf_counter() - arrived)
        finally:
            ex.close()

    # -- grpc.health.v1
    def _parse(self, data: bytes | None) -> str:
        if data is None:
            raise _Refuse(13, "a health call without a request message")
        try:
            return health_pb2.HealthCheckRequest.FromString(data).service
        except Exception:
            raise _Refuse(13, "a HealthCheckRequest that does not parse") from None

    async def check(self, data: bytes) -> bytes:
        name = self._parse(data)
        if name not in self.status:
            raise _Refuse(NOT_FOUND, f"unknown service {name!r}")
        return health_pb2.HealthCheckResponse(status=self.status[name]).SerializeToString()

    async def watch(self, call: Call) -> None:
        """The status now, then every change, until the client cancels (SERVICE_UNKNOWN while unknown)."""
        name = self._parse(await call.read())
        changed = asyncio.Event()
        self.watchers.add(changed)
        try:
            last = None
            while True:
                now = self.status.get(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if now != last:
                    await call.write(health_pb2.HealthCheckResponse(status=now).SerializeToString())
                    last = now
                changed.clear()
                await changed.wait()
        finally:
            self.watchers.discard(changed)
