"""A cheap gRPC client for load generation: raw HTTP/2 frames over one asyncio connection, so that a benchmark
measures the server, not its Python gRPC client (grpc.aio costs ~1.2 ms of CPU per ext_proc exchange here).

What it does, and no more (it only talks to servers it benchmarks, over cleartext HTTP/2, "h2c prior knowledge"):

* the connection preface and a SETTINGS frame (a 2^31-1 stream window, so the server is never flow-blocked
  by us), the connection window opened once and topped up as data arrives; SETTINGS and PING acknowledged;
* per call one stream: a HEADERS block pre-encoded once per connection (HPACK literals without indexing, no
  Huffman: the server's decoder table never changes), the stream id patched in the 9-byte frame header;
  each message one DATA frame with the gRPC 5-byte prefix; the end of the request stream an empty DATA frame
  with END_STREAM;
* the server's frames parsed only as far as needed: DATA split into gRPC messages (handed to the caller as
  bytes: the caller parses the protobuf it cares about), HEADERS decoded with `hpack` (the dynamic table
  must be followed) for grpc-status in the trailers, WINDOW_UPDATE / SETTINGS for our send window (a frame
  waits while the server's window is too small), RST_STREAM and GOAWAY end calls with an error;
* writes corked: every frame written in one event-loop iteration goes out in one `transport.write`.

Needs `h2`'s `hpack` (benchmark only: `pip install h2`).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque

from hpack import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIO_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
MAX_WINDOW = 2**31 - 1
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x4, 0x5


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_headers(headers: list[tuple[str, str]]) -> bytes:
    """An HPACK block of literals without indexing, new names, no Huffman (RFC 7541 6.2.2)."""
    out = bytearray()
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return bytes(out)


class CallError(Exception):
    """The call ended without OK: grpc-status (with grpc-message), RST_STREAM, GOAWAY or a lost connection."""


class Call:
    """One gRPC bidi call (one HTTP/2 stream)."""

    __slots__ = ("conn", "sid", "buf", "messages", "waiter", "status", "error", "closed_local", "sent_at",
                 "first_at")

    def __init__(self, conn: "RawGrpcConnection", sid: int):
        self.conn, self.sid = conn, sid
        self.buf = bytearray()
        self.messages: deque[bytes] = deque()
        self.waiter: asyncio.Future | None = None
        self.status: str | None = None  # grpc-status once the trailers came
        self.error: str | None = None
        self.closed_local = False
        self.sent_at: float | None = None  # perf_counter when its HEADERS frame was handed to the socket
        self.first_at: float | None = None  # perf_counter when its first answer message was parsed off the socket

    def write(self, message: bytes) -> None:
        """Send one serialized protobuf message (a gRPC length-prefixed message in one DATA frame)."""
        self.conn._send_data(self.sid, b"\x00" + struct.pack(">I", len(message)) + message, 0)

    def done_writing(self) -> None:
        if not self.closed_local:
            self.closed_local = True
            self.conn._send_data(self.sid, b"", END_STREAM)

    def cancel(self) -> None:
        """RST_STREAM CANCEL (0x8), as a gRPC client cancels a call."""
        if self.status is None and self.error is None:
            self.error = "cancelled"
            self.conn._write(frame(RST_STREAM, 0, self.sid, struct.pack(">I", 8)))
            self.conn.calls.pop(self.sid, None)

    async def read(self) -> bytes | None:
        """The next message from the server; None at the end of a call that ended OK."""
        while not self.messages:
            if self.error is not None:
                raise CallError(self.error)
            if self.status is not None:
                if self.status != "0":
                    raise CallError(f"grpc-status {self.status}")
                return None
            self.waiter = self.conn.loop.create_future()
            await self.waiter
        return self.messages.popleft()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _data(self, chunk: bytes) -> None:
        buf = self.buf
        buf += chunk
        while len(buf) >= 5:
            n = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + n:
                break
            self.messages.append(bytes(buf[5:5 + n]))
            del buf[:5 + n]
            if self.first_at is None:
                self.first_at = time.perf_counter()
        self._wake()


class RawGrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection carrying gRPC calls to `path` (e.g. "/pkg.Service/Method")."""

    def __init__(self, authority: str, path: str):
        self.loop = asyncio.get_running_loop()
        self.block = literal_headers([(":method", "POST"), (":scheme", "http"), (":path", path),
                                      (":authority", authority), ("content-type", "application/grpc"),
                                      ("te", "trailers")])
        self.head = frame(HEADERS, END_HEADERS, 0, self.block)
        self.decoder = Decoder()
        self.calls: dict[int, Call] = {}
        self.next_sid = 1
        self.out: list[bytes] = []
        self.opened: list[Call] = []  # calls whose HEADERS wait in `out` (their send time is stamped at the write)
        self.flush_scheduled = False
        self.inbuf = bytearray()
        self.send_window = 65535  # the connection's, as the server grants it
        self.stream_initial = 65535  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.stream_windows: dict[int, int] = {}
        self.blocked: deque[tuple[int, bytes, int]] = deque()
        self.unacked_in = 0
        self.header_block: tuple[int, int, bytearray] | None = None  # (sid, flags, block) across CONTINUATIONs
        self.transport: asyncio.Transport | None = None
        self.lost: str | None = None
        self.ready = self.loop.create_future()

    @classmethod
    async def connect(cls, host: str, port: int, path: str) -> "RawGrpcConnection":
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: cls(f"{host}:{port}", path), host, port)
        await conn.ready
        return conn

    # -- sending
    def _write(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
            if self.opened:
                t = time.perf_counter()
                for call in self.opened:
                    call.sent_at = t
        self.out.clear()
        self.opened.clear()

    def open(self) -> Call:
        if self.lost is not None:
            raise CallError(self.lost)
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        call = self.calls[sid] = Call(self, sid)
        self.opened.append(call)
        self.stream_windows[sid] = self.stream_initial
        h = self.head
        self._write(h[:5] + struct.pack(">I", sid) + h[9:])
        return call

    def _send_data(self, sid: int, payload: bytes, flags: int) -> None:
        if self.blocked or not self._fits(sid, len(payload)):
            self.blocked.append((sid, payload, flags))
            return
        self._emit(sid, payload, flags)

    def _fits(self, sid: int, n: int) -> bool:
        return n <= self.send_window and n <= self.stream_windows.get(sid, 0)

    def _emit(self, sid: int, payload: bytes, flags: int) -> None:
        self.send_window -= len(payload)
        if sid in self.stream_windows:
            self.stream_windows[sid] -= len(payload)
            if flags & END_STREAM:
                del self.stream_windows[sid]
        self._write(frame(DATA, flags, sid, payload))

    def _unblock(self) -> None:
        while self.blocked:
            sid, payload, flags = self.blocked[0]
            if sid not in self.stream_windows:  # the stream is gone (reset): drop what it still had queued
                self.blocked.popleft()
                continue
            if not self._fits(sid, len(payload)):
                return
            self.blocked.popleft()
            self._emit(sid, payload, flags)

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        settings = struct.pack(">HI", INITIAL_WINDOW_SIZE, MAX_WINDOW)
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535)))

    def connection_lost(self, exc) -> None:
        self._fail_all(f"connection lost: {exc}")

    def _fail_all(self, why: str) -> None:
        self.lost = why
        for call in self.calls.values():
            if call.status is None and call.error is None:
                call.error = why
            call._wake()
        self.calls.clear()
        if not self.ready.done():
            self.ready.set_exception(CallError(why))

    def data_received(self, data: bytes) -> None:
        buf = self.inbuf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self._frame(kind, flags, sid, payload)
        del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == DATA:
            self.unacked_in += len(payload)
            if self.unacked_in > 1 << 20:  # top the connection window up (stream windows are 2^31-1)
                self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked_in)))
                self.unacked_in = 0
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            call = self.calls.get(sid)
            if call is not None:
                call._data(payload)
                if flags & END_STREAM and call.status is None:  # a stream must end with trailers in gRPC
                    call.error = "the stream ended without trailers"
                    self._end(call)
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIO_FLAG:
                    payload = payload[5:]
                self.header_block = (sid, flags, bytearray(payload))
            elif self.header_block is not None:
                self.header_block[2].extend(payload)
            if flags & END_HEADERS and self.header_block is not None:
                sid, hflags, block = self.header_block
                self.header_block = None
                headers = dict(self.decoder.decode(bytes(block)))  # (decoded even when unused: the table)
                call = self.calls.get(sid)
                if call is not None and hflags & END_STREAM:  # trailers (or trailers-only)
                    call.status = headers.get("grpc-status", "2")
                    if call.status != "0":
                        call.error = f"grpc-status {call.status}: {headers.get('grpc-message', '')}"
                    self._end(call)
        elif kind == SETTINGS:
            if flags & ACK:
                if not self.ready.done():
                    self.ready.set_result(None)
                return
            for k in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[k:k + 6])
                if key == INITIAL_WINDOW_SIZE:
                    delta, self.stream_initial = value - self.stream_initial, value
                    for s in self.stream_windows:
                        self.stream_windows[s] += delta
            self._write(frame(SETTINGS, ACK, 0))
            self._unblock()
        elif kind == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif sid in self.stream_windows:
                self.stream_windows[sid] += inc
            self._unblock()
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.calls.get(sid)
            if call is not None:
                call.error = f"RST_STREAM {struct.unpack('>I', payload)[0]}"
                self._end(call)
        elif kind == GOAWAY:
            last = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
            code = struct.unpack(">I", payload[4:8])[0]
            self.lost = f"GOAWAY {code}"
            for s, call in list(self.calls.items()):
                if s > last:
                    call.error = f"GOAWAY {code} (stream not processed)"
                    self._end(call)

    def _end(self, call: Call) -> None:
        self.calls.pop(call.sid, None)
        self.stream_windows.pop(call.sid, None)
        call._wake()

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.write(frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)))  # (the last server-opened stream: none)
            self.transport.close()
