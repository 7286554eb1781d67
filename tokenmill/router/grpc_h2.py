"""A small gRPC server on `h2` (python-hyper's HTTP/2 state machine) and an asyncio Protocol: the EPP's
cheaper transport (`--epp-transport h2`). grpc.aio spends ~1.1 ms of CPU per ext_proc exchange in its own
C-core and poller wake-ups before the picker does any work; this does the same wire protocol with the
event loop's own socket I/O.

What it implements (gRPC over HTTP/2, cleartext, "h2c prior knowledge", as Envoy's ext_proc and health
clients speak it):
* HTTP/2 by `h2`: the preface, SETTINGS, HPACK (Huffman, dynamic table), flow control both ways
  (inbound: DATA acknowledged as it arrives while the handler keeps up, held back while whole messages
  wait unread, so a slow handler holds the client back by at most a window per stream; outbound: a message waits
  for the peer's WINDOW_UPDATE), PING, RST_STREAM, GOAWAY, CONTINUATION;
* gRPC framing: 5-byte length-prefixed messages (compressed ones refused: grpc-status UNIMPLEMENTED, as no
  `grpc-encoding` is advertised), response headers, trailers with `grpc-status` / `grpc-message`,
  trailers-only answers for unknown methods (UNIMPLEMENTED);
* methods: bidi streaming (`async handler(call)`: `await call.read()` -> message bytes or None at the end,
  `await call.write(bytes)`) and unary (`async handler(bytes) -> bytes`), both on raw serialized protobuf
  (the caller parses: the EPP with Envoy's maintained protos);
* a client cancel (RST_STREAM) cancels the handler's task; `stop(grace)`: GOAWAY to every connection,
  in-flight calls get `grace` seconds, then the connections close (and the calls' tasks are cancelled).
Not implemented (not used by the gateway): TLS, compression, grpc-timeout deadlines, server push.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

log = logging.getLogger("tokenmill.router.grpc_h2")

OK, CANCELLED, UNKNOWN, INTERNAL, UNIMPLEMENTED, UNAVAILABLE = 0, 1, 2, 13, 12, 14
MAX_CONCURRENT_STREAMS = 1 << 20  # gRPC's own servers set no limit; the router's max_in_flight is the real one
WINDOW = 1 << 24
GOAWAY_FRAME = 0x7  # per stream and per connection, inbound: a request body is never held back by us


@dataclass(frozen=True)
class Method:
    """A served method: `kind` "stream" (bidi: handler(call)), "unary" (handler(request bytes) -> bytes), or
    "sink" (bidi without a task: handler(call) -> a `Sink` whose methods the connection calls from its
    data_received callback as messages arrive; it answers with `call.send_now` / `call.finish`, and starts a
    task of its own only when it has to wait)."""

    kind: str
    handler: Callable[..., Any]

    def __post_init__(self):
        if self.kind not in ("stream", "unary", "sink"):
            raise ValueError(f"unknown gRPC method kind {self.kind!r} (stream, unary or sink)")


class Sink:
    """What a "sink" method's handler returns for one call (the methods run on the event loop's callback
    path: they must not block). An exception from `message` or `end` ends the call as a "stream" handler's
    would (_Refuse: its status; another: UNKNOWN)."""

    def message(self, data: bytes) -> None:
        """One whole request message."""

    def end(self) -> None:
        """The client finished sending (half-close). Nothing is finished by the connection: the sink calls
        `call.finish` when its answers are out."""

    def closed(self) -> None:
        """The call is over (finished, reset by the client, or the connection is gone): release what it holds.
        Called once."""


class CallClosed(Exception):
    """The call is over (the client reset it, or the connection went away) before a write."""


class Call:
    """One gRPC call on one HTTP/2 stream, as the handler sees it."""

    __slots__ = ("conn", "sid", "buf", "messages", "waiter", "ended", "headers_sent", "closed", "task",
                 "unacked", "path", "sink", "told_end")

    def __init__(self, conn: "GrpcH2Protocol", sid: int, path: str):
        self.conn, self.sid, self.path = conn, sid, path
        self.buf = bytearray()
        self.messages: deque[bytes] = deque()
        self.waiter: asyncio.Future | None = None
        self.ended = False  # the client half-closed (END_STREAM)
        self.headers_sent = False
        self.closed = False  # reset, finished, or the connection is gone
        self.task: asyncio.Task | None = None
        self.unacked = 0  # DATA bytes received, not yet handed to the handler (flow control)
        self.sink: Sink | None = None
        self.told_end = False  # the sink was told the client finished

    async def read(self) -> bytes | None:
        """The next request message, or None once the client has finished sending."""
        while not self.messages:
            if self.ended or self.closed:
                return None
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        msg = self.messages.popleft()
        if not self.messages:  # the handler has caught up: the window held back goes back to the client
            self.conn.consumed(self)
        return msg

    async def write(self, message: bytes) -> None:
        """Send one response message (waits while the client's flow-control window is too small)."""
        if self.closed:
            raise CallClosed(f"stream {self.sid} is closed")
        await self.conn.send_message(self, b"\x00" + struct.pack(">I", len(message)) + message)

    def send_now(self, message: bytes) -> bool:
        """Send one response message now if the flow-control windows take it whole (else nothing is sent:
        False, and the caller awaits `write`, in order, for this and the messages after it)."""
        if self.closed:
            raise CallClosed(f"stream {self.sid} is closed")
        return self.conn.send_now(self, message)

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call now (trailers with grpc-status): for "sink" methods, once their answers are sent."""
        self.conn._finish_now(self, status, message)

    def push(self) -> None:
        """Write what is queued on the connection now, not at the end of the socket read being handled: an
        answer someone waits for (the EPP's pick) does not wait behind the other streams' frames of that read."""
        self.conn.push()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _data(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 5:
            n = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + n:
                break
            if buf[0] != 0:
                raise _Refuse(UNIMPLEMENTED, "compressed messages are not supported (no grpc-encoding)")
            self.messages.append(bytes(buf[5:5 + n]))
            del buf[:5 + n]
        if not self.messages:  # only part of a message: take more (a message may be larger than the window)
            self.conn.consumed(self)
        self._wake()


class _Refuse(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _H2Connection(h2.connection.H2Connection):
    """h2's state machine, with the open inbound streams counted by the server (its live calls) instead of by
    h2: h2 walks every stream it holds on each new inbound stream (`_open_streams`, O(streams): ~7% of the
    EPP's CPU at 500 decisions/s with ~165 streams open). The server forgets each stream as soon as it is
    closed (`forget`), so `streams` holds only the live ones and the frames that still arrive on a closed
    one are judged from `_closed_streams`, as h2's own pruning would leave them."""

    def __init__(self, config, live: dict):
        super().__init__(config)
        self._live = live

    @property
    def open_inbound_streams(self) -> int:
        return len(self._live)

    def forget(self, sid: int) -> None:
        """Drop a closed stream (h2 keeps it until its next O(streams) walk otherwise)."""
        stream = self.streams.get(sid)
        if stream is not None and stream.closed:
            del self.streams[sid]
            self._closed_streams[sid] = stream.closed_by


class CallsProtocol(asyncio.Protocol):
    """What both HTTP/2 connections (GrpcH2Protocol here, on h2; grpc_frames.FramesProtocol, our own framing)
    do with a call once its frames are read: hand a "sink" its messages, run a "stream"/"unary" handler's task.
    A subclass has `calls`, `loop`, `server`, `_finish_now(call, status, message)` and `consumed(call)`."""

    def _start(self, sid: int, path: str, method_name: bytes, content_type: bytes, ended: bool) -> Call:
        """A new call on stream sid: refused at once unless it is a gRPC POST to a known method, else a
        "sink" handler gets its messages from the read path and any other kind runs as its own task."""
        call = self.calls[sid] = Call(self, sid, path)
        call.ended = ended
        method = self.server.methods.get(path)
        if method_name != b"POST" or not content_type.startswith(b"application/grpc"):
            self._finish_now(call, INTERNAL, "not a gRPC request (POST, content-type application/grpc)")
        elif method is None:
            self._finish_now(call, UNIMPLEMENTED, f"unknown method {path}")
        elif method.kind == "sink":
            try:
                call.sink = method.handler(call)
            except Exception as e:
                log.exception("gRPC handler %s failed", call.path)
                self._finish_now(call, UNKNOWN, f"{type(e).__name__}: {e}")
                return call
            if ended:
                self._deliver(call)
        else:
            call.task = self.loop.create_task(self._run(call, method))
        return call

    def _deliver(self, call: Call) -> None:
        """A "sink" call: hand it every whole message received, then the end of the client's side."""
        sink = call.sink
        try:
            while call.messages and not call.closed:
                sink.message(call.messages.popleft())
            if call.ended and not call.told_end and not call.closed:
                call.told_end = True
                sink.end()
        except CallClosed:
            pass
        except _Refuse as e:
            self._finish_now(call, e.status, str(e))
        except Exception as e:  # a handler bug: the call ends with UNKNOWN, the server goes on
            log.exception("gRPC handler %s failed", call.path)
            self._finish_now(call, UNKNOWN, f"{type(e).__name__}: {e}")
        if not call.messages:
            self.consumed(call)

    async def _run(self, call: Call, method: Method) -> None:
        status, message = OK, ""
        try:
            if method.kind == "unary":
                request = await call.read()
                if request is None:
                    raise _Refuse(INTERNAL, "a unary call without a request message")
                response = await method.handler(request)
                await call.write(response)
            else:
                await method.handler(call)
        except asyncio.CancelledError:  # the client reset the stream, or the server is stopping
            if call.closed:
                return
            status, message = CANCELLED, "cancelled"
        except CallClosed:
            return
        except _Refuse as e:
            status, message = e.status, str(e)
        except Exception as e:  # a handler bug: the call ends with UNKNOWN, the server goes on
            log.exception("gRPC handler %s failed", call.path)
            status, message = UNKNOWN, f"{type(e).__name__}: {e}"
        self._finish_now(call, status, message)

    @staticmethod
    def _sink_closed(call: Call) -> None:
        sink, call.sink = call.sink, None
        if sink is not None:
            try:
                sink.closed()
            except Exception:
                log.exception("gRPC handler %s failed while closing", call.path)


class GrpcH2Protocol(CallsProtocol):
    """One HTTP/2 connection from a gRPC client."""

    def __init__(self, server: "GrpcH2Server"):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.calls: dict[int, Call] = {}
        # outbound headers are this module's own constants (lower-case, valid): h2 need not re-validate and
        # normalize them on every send
        self.h2 = _H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True, validate_outbound_headers=False,
            normalize_outbound_headers=False), self.calls)
        self.transport: asyncio.Transport | None = None
        self.flush_scheduled = False
        self.window_waiters: dict[int, asyncio.Future] = {}  # stream id (0: the connection) -> a waiting writer
        self.closing = False
        self.receiving = False  # inside data_received: it writes what h2 has to send at its end

    # -- I/O
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.server.window,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16})
        self.h2.initiate_connection()
        if self.server.window > 65535:
            self.h2.increment_flow_control_window(self.server.window - 65535)
        self.flush()

    def flush(self) -> None:
        """Everything the state machine has to send, in one write at the end of this loop iteration."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
        if self.closing and not self.calls and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._abort(call)
        for fut in self.window_waiters.values():
            if not fut.done():
                fut.set_result(None)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.debug("HTTP/2 protocol error from the client: %s", e)
            self.flush()  # h2 queued its GOAWAY
            self.loop.call_soon(self._close_transport)
            return
        self.receiving = True
        try:
            for ev in events:
                self._event(ev)
        finally:
            self.receiving = False
        # what the events produced (answers sent from the sinks, window updates) goes out now, in this
        # callback, not after the other callbacks ready in this loop turn (a flush they scheduled finds
        # nothing left to write)
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def push(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- events
    def _event(self, ev) -> None:
        if isinstance(ev, h2.events.DataReceived):
            call = self.calls.get(ev.stream_id)
            if call is None:  # a stream we already answered or reset: give the window back at once
                if ev.flow_controlled_length:
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                return
            # padding is acknowledged now, the message bytes when the handler reads them
            pad = ev.flow_controlled_length - len(ev.data)
            if pad:
                self.h2.acknowledge_received_data(pad, ev.stream_id)
            call.unacked += len(ev.data)
            try:
                call._data(ev.data)
            except _Refuse as e:
                self._finish_now(call, e.status, str(e))
            if ev.stream_ended:
                call.ended = True
                call._wake()
            if call.sink is not None:
                self._deliver(call)
        elif isinstance(ev, h2.events.RequestReceived):
            self._request(ev.stream_id, dict(ev.headers), ev.stream_ended)
        elif isinstance(ev, h2.events.StreamEnded):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.ended = True
                call._wake()
                if call.sink is not None:
                    self._deliver(call)
        elif isinstance(ev, h2.events.StreamReset):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                self._abort(call)
            self._window_open(ev.stream_id)
        elif isinstance(ev, h2.events.WindowUpdated):
            self._window_open(ev.stream_id)
            if ev.stream_id == 0:
                for sid in list(self.window_waiters):
                    self._window_open(sid)
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            for sid in list(self.window_waiters):  # a larger initial window opens every stream's
                self._window_open(sid)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.closing = True
            for call in list(self.calls.values()):
                if call.sid > (ev.last_stream_id or 0):
                    self._abort(call)
        elif isinstance(ev, h2.events.TrailersReceived):  # request trailers: the end of the client's side
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.ended = True
                call._wake()
                if call.sink is not None:
                    self._deliver(call)

    def _request(self, sid: int, headers: dict[bytes, bytes], ended: bool) -> None:
        path = headers.get(b":path", b"").decode("latin-1")
        if self.closing:  # after our GOAWAY: refused, the client may retry elsewhere
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            self.h2.forget(sid)
            return
        self._start(sid, path, headers.get(b":method", b""), headers.get(b"content-type", b""), ended)

    # -- sending
    def send_now(self, call: Call, message: bytes) -> bool:
        n = len(message) + 5
        if n > self.h2.local_flow_control_window(call.sid) or n > self.h2.max_outbound_frame_size:
            return False
        if not call.headers_sent:
            call.headers_sent = True
            self.h2.send_headers(call.sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        self.h2.send_data(call.sid, b"\x00" + len(message).to_bytes(4, "big") + message)
        if not self.receiving:  # (inside data_received the write at its end takes it)
            self.flush()
        return True

    async def send_message(self, call: Call, payload: bytes) -> None:
        if not call.headers_sent:
            call.headers_sent = True
            self.h2.send_headers(call.sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        view = memoryview(payload)
        while view:
            if call.closed:
                raise CallClosed(f"stream {call.sid} is closed")
            window = min(self.h2.local_flow_control_window(call.sid), self.h2.max_outbound_frame_size)
            if window <= 0:
                fut = self.window_waiters[call.sid] = self.loop.create_future()
                self.flush()
                await fut
                continue
            chunk, view = view[:window], view[window:]
            self.h2.send_data(call.sid, bytes(chunk))
        self.flush()

    def _window_open(self, sid: int) -> None:
        fut = self.window_waiters.pop(sid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def consumed(self, call: Call) -> None:
        """Give the client back the window of every byte received on this call so far. Called when no whole
        message waits unread: while the handler lags behind (messages queued), the window stays spent and
        the client is held back (at most one window per stream is buffered here)."""
        n, call.unacked = call.unacked, 0
        if n and not call.closed:
            try:
                self.h2.acknowledge_received_data(n, call.sid)
            except h2.exceptions.StreamClosedError:
                return
            self.flush()

    def _finish_now(self, call: Call, status: int, message: str) -> None:
        """End the call: trailers with grpc-status (trailers-only when nothing was sent) and END_STREAM."""
        if call.closed:
            return
        call.closed = True
        self.calls.pop(call.sid, None)
        if call.unacked:  # what the handler never read: the connection's window back (h2 skips a closed stream)
            self.h2.acknowledge_received_data(call.unacked, call.sid)
            call.unacked = 0
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", _percent_encode(message)))
        try:
            if not call.headers_sent:  # trailers-only
                self.h2.send_headers(call.sid, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                                *trailers], end_stream=True)
            else:
                self.h2.send_headers(call.sid, trailers, end_stream=True)
            if not call.ended:  # the client may still be sending: we will not read it
                self.h2.reset_stream(call.sid, h2.errors.ErrorCodes.NO_ERROR)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self.h2.forget(call.sid)
        call._wake()
        self.flush()
        self._sink_closed(call)

    def _abort(self, call: Call) -> None:
        """The client reset the stream (or the connection is gone): the handler's task is cancelled."""
        if call.closed:
            return
        call.closed = True
        self.calls.pop(call.sid, None)
        self.h2.forget(call.sid)
        call._wake()
        self._window_open(call.sid)
        if call.task is not None and not call.task.done():
            call.task.cancel()
        self._sink_closed(call)
        if self.closing and not self.calls:
            self.flush()

    def goaway(self) -> None:
        """Graceful shutdown of this connection: GOAWAY naming the last stream we accepted; the calls in
        flight go on; the connection closes when they are done."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        # written beside h2, not through close_connection(): h2's state machine takes a GOAWAY sent as the
        # end of the connection and would refuse the frames of the streams still in flight
        self._flush()
        last = self.h2.highest_inbound_stream_id
        self.transport.write(struct.pack(">I", 8)[1:] + bytes((GOAWAY_FRAME, 0)) + struct.pack(">III", 0, last, 0))
        if not self.calls:
            self.transport.close()


def _percent_encode(message: str) -> bytes:
    """grpc-message: percent-encoded UTF-8 outside printable ASCII (gRPC's HTTP/2 protocol)."""
    return "".join(c if 0x20 <= ord(c) < 0x7F and c != "%" else "".join(f"%{b:02X}" for b in c.encode())
                   for c in message).encode()


class GrpcH2Server:
    """Serves `methods` ({"/pkg.Service/Method": Method}) on host:port with the running loop."""

    def __init__(self, methods: dict[str, Method], window: int = WINDOW, protocol: type | None = None):
        if not 1 <= window < 2**31:
            raise ValueError(f"the HTTP/2 window must be in 1..2^31-1, got {window}")
        self.methods = methods
        self.window = window  # inbound, per stream and per connection
        self.connections: set[GrpcH2Protocol] = set()
        self.server: asyncio.base_events.Server | None = None
        self.protocol = protocol or GrpcH2Protocol  # one connection: h2's state machine, or grpc_frames'
        self.trace: list[tuple] | None = None  # grpc_frames: per answered call, its hop time stamps (epp_h2 --epp-trace)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: self.protocol(self), host, port, reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def start_on(self, sock) -> None:
        """Serve on a socket already bound and listening."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: self.protocol(self), sock=sock)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, GOAWAY every connection, wait up to grace_s for the calls in flight, then close."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.goaway()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.calls for c in self.connections) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            for call in list(conn.calls.values()):
                conn._finish_now(call, UNAVAILABLE, "the server is shutting down")
                if call.task is not None and not call.task.done():
                    call.task.cancel()
            conn._flush()
            if conn.transport is not None:
                conn.transport.close()
        if self.server is not None:
            await self.server.wait_closed()
