"""The Endpoint Picker on tokenmill's own HTTP/2 gRPC server (grpc_h2.py): `--epp-transport frames` (the
default: HTTP/2 framed by grpc_frames.py) or `--epp-transport h2` (framed by the `h2` library, the reference).

The same ext_proc exchange as the grpc.aio picker (epp.py: `_Exchange`, the same pure policy code, the same
metrics), the same messages (Envoy's maintained protos from xds-protos, parsed and serialized by protobuf),
and the gRPC health service (grpc.health.v1: Check and Watch, health_pb2 from grpcio-health-checking's
protos) with the same names and states. What differs is only the transport: h2's state machine and the
event loop's own sockets instead of gRPC's C-core and its poller (benchmarks: docs/benchmarks/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2

from tokenmill.router.epp import (BODY_ACK, EXT_PROC_SERVICE, HEADERS_ACK, RESPONSE_BODY_ACK, RESPONSE_HEADERS_ACK,
                                  EppMetrics, StreamedBody, _destination, _Exchange)
from tokenmill.router.grpc_h2 import UNKNOWN, Call, CallClosed, GrpcH2Server, Method, Sink, _Refuse
from tokenmill.router.router import Router

log = logging.getLogger("tokenmill.router.epp_h2")

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

    def __call__(self, m: pb.ProcessingResponse | StreamedBody) -> bytes:
        if type(m) is StreamedBody:  # a body passed on: written directly, not through protobuf
            return m.SerializeToString()
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

    def __init__(self, router: Router, host: str, port: int, framing: str = "frames", trace: str | None = None):
        if framing == "frames":
            from tokenmill.router.grpc_frames import FramesProtocol as protocol
        elif framing == "h2":
            from tokenmill.router.grpc_h2 import GrpcH2Protocol as protocol
        else:
            raise ValueError(f"unknown HTTP/2 framing {framing!r}; choose from frames, h2")
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
        self.server = GrpcH2Server({PROCESS: Method("sink", self.process), HEALTH_CHECK: Method("unary", self.check),
                                    HEALTH_WATCH: Method("stream", self.watch)}, protocol=protocol)
        self.trace_path = trace
        if trace is not None:
            if framing != "frames":
                raise ValueError("an EPP trace needs the frames transport")
            self.server.trace = []

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
        if self.trace_path is not None:
            self.write_trace(self.trace_path)

    def write_trace(self, path: str) -> None:
        """The hop time stamps of every answered stream, CLOCK_MONOTONIC ns (time.perf_counter's clock):
        peer_port,sid,read_ns (the socket read that carried the request's last message), arrived_ns (its first
        message handed to the picker), decision_start_ns, decision_end_ns (0: refused), written_ns (the
        transport.write that carried the answer)."""
        with open(path, "w") as f:
            f.write("peer_port,sid,read_ns,arrived_ns,decision_start_ns,decision_end_ns,written_ns\n")
            for port, sid, *ts in self.server.trace:
                f.write(f"{port},{sid}," + ",".join(str(int(t * 1e9)) for t in ts) + "\n")

    # -- ext_proc
    def process(self, call: Call) -> "_EppCall":
        return _EppCall(self, call)

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


class _EppCall(Sink):
    """One ext_proc stream, answered from the connection's data_received callback: each message is parsed and
    stepped through the exchange (epp._Exchange.step: the same decisions as the grpc.aio picker) and its
    answers go to h2 at once, with no task, no future and no loop turn in between. A task is started only
    when the exchange must wait — admission holds the request, or the client's flow-control window does
    not take an answer — and the messages that arrive meanwhile are stepped by it, in order."""

    __slots__ = ("server", "call", "ex", "arrived", "timed", "task", "backlog", "ending")

    def __init__(self, server: H2EppServer, call: Call):
        self.server, self.call = server, call
        self.ex = _Exchange(server.router, server.metrics)
        self.arrived: float | None = None  # the stream's first message handed over (the e2e clock starts)
        self.timed = False
        self.task: asyncio.Task | None = None
        self.backlog: deque[bytes] = deque()
        self.ending = False

    @staticmethod
    def _parse(data: bytes) -> pb.ProcessingRequest:
        try:
            return pb.ProcessingRequest.FromString(data)
        except Exception:  # protobuf's DecodeError
            raise _Refuse(13, "a ProcessingRequest that does not parse") from None

    def message(self, data: bytes) -> None:
        if self.arrived is None:
            self.arrived = time.perf_counter()
        if self.task is not None:
            self.backlog.append(data)
            return
        out = self.ex.step(self._parse(data))
        if not isinstance(out, list):
            self.task = asyncio.get_running_loop().create_task(self._slow(out, ()))
            return
        wire, call = self.server.wire, self.call
        for i, resp in enumerate(out):
            if not call.send_now(wire(resp)):
                self.task = asyncio.get_running_loop().create_task(self._slow(None, [wire(r) for r in out[i:]]))
                return
        if self.ex.answered and not self.timed:
            # the pick (or refusal) the gateway waits on goes out now, before the rest of this socket read (other
            # streams' requests, each a decision) is handled: one write per pick instead of one per read
            self._answered()
            call.push()

    def _answered(self) -> None:
        if self.ex.answered and not self.timed:
            self.timed = True
            self.server.metrics.e2e.observe(time.perf_counter() - self.arrived)
            conn = self.call.conn
            if conn.server.trace is not None:  # (--epp-trace) stamped with the write that carries the answer
                conn.traced.append((conn.peer_port, self.call.sid, conn.recv_t, self.arrived, *self.ex.picked_at))

    async def _slow(self, pending, payloads) -> None:
        call, wire = self.call, self.server.wire
        try:
            if pending is not None:
                payloads = [wire(r) for r in await pending]
                pending = None
            for p in payloads:
                await call.write(p)
            self._answered()
            while self.backlog:
                out = self.ex.step(self._parse(self.backlog.popleft()))
                for r in out if isinstance(out, list) else await out:
                    await call.write(wire(r))
                self._answered()
        except CallClosed:
            return
        except asyncio.CancelledError:
            if pending is not None:  # cancelled before the held pick was awaited: it will never be
                pending.close()
            raise
        except _Refuse as e:
            call.finish(e.status, str(e))
            return
        except Exception as e:  # a handler bug: the call ends with UNKNOWN, the server goes on
            log.exception("ext_proc stream failed")
            call.finish(UNKNOWN, f"{type(e).__name__}: {e}")
            return
        self.task = None
        if self.ending:
            self.end()

    def end(self) -> None:
        if self.task is not None:  # answers still to send: the call ends after them
            self.ending = True
            return
        self.ex.close()
        self.call.finish()

    def closed(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self.ex.close()  # (a pick still held is taken out of its queue here, even if the task never ran)
