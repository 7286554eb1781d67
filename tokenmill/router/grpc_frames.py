"""One HTTP/2 connection framed by tokenmill itself: the EPP's default transport (`--epp-transport frames`).

The same gRPC server as grpc_h2.py (its `GrpcH2Server`, `Call`, `Method`, `Sink`: the same handlers, the
same gRPC semantics) with the `h2` library's state machine replaced on the hot path by this module's own
framing. What an ext_proc exchange needs per request is small — a HEADERS block in, a few DATA frames in,
one HEADERS + DATA out per answer, trailers out — and h2 spends most of the transport's CPU on generality
(events, per-frame state-machine transitions, header validation and normalization, HPACK encoding of the
same two headers every time). Here:

* frames are parsed straight from the `data_received` buffer (`struct.unpack_from`, one offset walk; a frame
  split across reads waits in the buffer, several in one read are all handled in that callback);
* inbound HPACK by the `hpack` package (Huffman, the dynamic table), with the decoded headers cached by the
  raw header-block bytes: Envoy re-sends the same block (indexed fields) for every stream, and a block is
  cached only if decoding it left the dynamic table unchanged; any change of the table (an insertion, a
  size update) empties the cache, since the same bytes may then name other headers;
* outbound headers pre-encoded once (HPACK static-table index and literals without indexing: our encoder
  has no dynamic table, so it has no state); trailers with grpc-status 0 pre-encoded too;
* flow control both ways, by our own counters: inbound, DATA is credited back (WINDOW_UPDATE, stream and
  connection) as the handler takes the messages, once half a window is owed, so a handler that keeps up never
  stalls the client, and one that does not holds it back by at most a window per stream (as with h2);
  outbound, the peer's connection and stream windows (its SETTINGS_INITIAL_WINDOW_SIZE, applied to the open
  streams when it changes, and its WINDOW_UPDATEs) and its SETTINGS_MAX_FRAME_SIZE: a message that does not
  fit waits for a WINDOW_UPDATE (`send_message`), `send_now` declines it;
* SETTINGS (acknowledged), PING (answered), RST_STREAM (the call is cancelled), GOAWAY (both ways: ours on
  shutdown names the last stream accepted, later streams are refused), PRIORITY (ignored), padding and the
  priority fields of HEADERS, CONTINUATION, unknown frame types (ignored, RFC 9113 5.5);
* a connection error (a malformed frame, a frame too large, a bad HPACK block, a frame between HEADERS and
  its CONTINUATIONs, PUSH_PROMISE from a client) is a GOAWAY with its code, then the connection closes.

Not done (not needed by a gateway that speaks HTTP/2 correctly): enforcing our inbound windows on the peer
(DATA past them is taken, not a FLOW_CONTROL_ERROR), TLS, server push, priorities, h2c upgrade. The `h2`
transport (grpc_h2.GrpcH2Protocol) stays selectable as the reference this one is tested against.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from hpack import Decoder, HPACKError
from hpack.table import HeaderTable

from tokenmill.router.grpc_h2 import (INTERNAL, MAX_CONCURRENT_STREAMS, UNIMPLEMENTED, UNKNOWN, Call, CallClosed,
                                      CallsProtocol, _percent_encode, _Refuse)

log = logging.getLogger("tokenmill.router.grpc_frames")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = \
    0x0, 0x1, 0x3, 0x5, 0x6, 0x7, 0x9
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, \
    S_MAX_HEADER_LIST_SIZE = range(1, 7)
MAX_FRAME = 16384  # ours (the protocol's default, not changed in our SETTINGS)
MAX_WINDOW = 2**31 - 1
MAX_HEADER_LIST = 1 << 16
MAX_BLOCK_CACHE = 256
MAX_GRPC_MESSAGE = 1024  # characters of a grpc-message trailer (it must fit one HEADERS frame)
# the OK trailers of a "sink" call whose client has finished sending wait (in `later`) for the next write on the
# connection, at most this long: nobody waits on them (the sink's answers are out), and each write is a syscall
# and a TCP segment on both sides; under load the next pick's write takes them along
LATER_S = 0.002
FRAME_HEAD = struct.Struct(">HBBBI")  # length (24 bits as 16 + 8), type, flags, stream id (31 bits + R)
DATA_HEAD = struct.Struct(">HBBBIBI")  # a DATA frame's head and a whole gRPC message's 5-byte prefix


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


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# :status 200 is static-table entry 8 (indexed: 0x88); content-type is entry 31 (a literal without indexing
# with an indexed name: 4-bit prefix)
RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4) + _hpack_int(16, 7) + b"application/grpc"


def _trailers(status: int, message: str) -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message[:MAX_GRPC_MESSAGE]))
    return block


TRAILERS_OK = _trailers(0, "")


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEAD.pack(n >> 8, n & 0xFF, kind, flags, sid) + payload


class _Table(HeaderTable):
    """hpack's dynamic table, counting its changes (an insertion, a size change): the block cache's key."""

    def __init__(self):
        super().__init__()
        self.version = 0

    def add(self, name, value):
        self.version += 1
        return super().add(name, value)

    @HeaderTable.maxsize.setter
    def maxsize(self, newmax):
        self.version += 1
        HeaderTable.maxsize.fset(self, newmax)


class _ConnectionError(Exception):
    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


class FramesProtocol(CallsProtocol):
    """One HTTP/2 connection from a gRPC client; the same interface to `Call` as grpc_h2.GrpcH2Protocol."""

    def __init__(self, server):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.calls: dict[int, Call] = {}
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False  # the client's connection preface has been read
        self.out = bytearray()  # frames to write (one write per callback / loop iteration)
        self.later = bytearray()  # frames nobody waits on: they go with the next write of `out` (or after LATER_S)
        self.later_timer: asyncio.TimerHandle | None = None
        self.flush_scheduled = False
        self.receiving = False  # inside data_received: it writes `out` at its end
        self.closing = False  # GOAWAY sent or received: no new streams
        self.dead = False  # a connection error: nothing more is read
        self.last_sid = 0  # the highest client stream id seen
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.table = self.decoder.header_table = _Table()
        self.blocks: dict[bytes, list] = {}  # raw header block -> decoded headers, for one table version
        self.blocks_version = 0
        self.continued: bytearray | None = None  # a header block awaiting its CONTINUATION frames
        self.continued_sid = 0
        self.continued_end = False
        # outbound flow control (the peer's windows) and frame size
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.send_window = 65535  # the connection's
        self.stream_windows: dict[int, int] = {}
        self.window_waiters: dict[int, asyncio.Future] = {}
        # inbound: bytes taken by handlers and not yet credited back (connection; per stream)
        self.owed = 0
        self.stream_owed: dict[int, int] = {}
        self.threshold = max(1, server.window // 2)
        # diagnostics (--epp-trace): the time of the socket read being handled, and the calls answered since the
        # last write (each stamped with that write's time, then kept in server.trace)
        self.trace = server.trace
        self.recv_t = 0.0
        self.traced: list[tuple] = []
        self.peer_port = 0

    # -- I/O
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        if self.trace is not None:
            peer = transport.get_extra_info("peername")
            self.peer_port = peer[1] if peer else 0
        settings = struct.pack(">HIHIHI", S_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS,
                               S_INITIAL_WINDOW_SIZE, self.server.window, S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)
        self.out += frame(SETTINGS, 0, 0, settings)
        if self.server.window > 65535:  # the connection's window is not set by SETTINGS: opened here
            self.out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.server.window - 65535))
        self.flush()

    def flush(self) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        self._write_later()
        if self.closing and not self.calls and self.transport is not None:
            self.transport.close()

    def _write_later(self) -> None:
        """Write everything queued, `later` included."""
        if self.later:
            self.out += self.later
            self.later = bytearray()
        self._write()

    def _write(self) -> None:
        if self.out:
            if self.later:  # (after `out`: a stream's trailers follow its frames that are still there)
                self.out += self.later
                self.later = bytearray()
            if self.later_timer is not None:
                self.later_timer.cancel()
                self.later_timer = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(self.out)
            self.out = bytearray()
            if self.traced:
                t = time.perf_counter()
                self.trace.extend(rec + (t,) for rec in self.traced)
                self.traced.clear()

    def push(self) -> None:
        """Write what is queued now (Call.push): inside data_received the rest of the read is handled after."""
        self._write()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self.later_timer is not None:
            self.later_timer.cancel()
            self.later_timer = None
        for call in list(self.calls.values()):
            self._abort(call)
        for fut in self.window_waiters.values():
            if not fut.done():
                fut.set_result(None)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.dead:
            return
        if self.trace is not None:
            self.recv_t = time.perf_counter()
        buf = self.buf
        if buf:
            buf += data
            data = bytes(buf)
            buf.clear()
        i = 0
        if not self.preface:
            if len(data) < 24:
                if not PREFACE.startswith(data):
                    return self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf += data
                return
            if data[:24] != PREFACE:
                return self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface = True
            i = 24
        end = len(data)
        self.receiving = True
        try:
            while end - i >= 9:
                hi, lo, kind, flags, sid = FRAME_HEAD.unpack_from(data, i)
                n = hi << 8 | lo
                if n > MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {n} bytes (at most {MAX_FRAME})")
                if end - i < 9 + n:
                    break
                payload = data[i + 9:i + 9 + n]
                i += 9 + n
                self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
        except _ConnectionError as e:
            self.receiving = False
            return self._fail(e.code, str(e))
        finally:
            self.receiving = False
        if i < end:
            self.buf += data[i:]
        # what the frames produced (answers sent from the sinks, acks, window updates) goes out now, in this
        # callback, not after the other callbacks ready in this loop turn
        self._write()

    def _fail(self, code: int, why: str) -> None:
        """A connection error: GOAWAY with its code, then the connection closes (its calls are aborted)."""
        log.debug("HTTP/2 connection error from the client: %s", why)
        self.dead = self.closing = True
        self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code) + why.encode()[:256])
        self._write_later()
        self.loop.call_soon(self._close_transport)

    def _close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- frames in
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continued is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a frame between HEADERS and its CONTINUATION")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            if sid == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
            block = payload
            if flags & PADDED:
                block = self._unpad(block)
            if flags & PRIORITY_FLAG:
                if len(block) < 5:
                    raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
                block = block[5:]
            if flags & END_HEADERS:
                self._headers(sid, block, bool(flags & END_STREAM))
            else:
                self.continued, self.continued_sid, self.continued_end = bytearray(block), sid, bool(flags & END_STREAM)
        elif kind == CONTINUATION:
            if self.continued is None or sid != self.continued_sid:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self.continued += payload
            if len(self.continued) > 4 * MAX_HEADER_LIST:
                raise _ConnectionError(COMPRESSION_ERROR, "a header block past the header list size")
            if flags & END_HEADERS:
                block, self.continued = bytes(self.continued), None
                self._headers(sid, block, self.continued_end)
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
            self._window_update(sid, int.from_bytes(payload, "big") & 0x7FFFFFFF)
        elif kind == SETTINGS:
            if sid != 0:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & ACK:
                if payload:
                    raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS ack with a payload")
                return
            if len(payload) % 6:
                raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of other than 6-byte entries")
            self._settings(payload)
        elif kind == PING:
            if sid != 0:
                raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "PING of other than 8 bytes")
            if not flags & ACK:
                self.out += frame(PING, ACK, 0, payload)
        elif kind == RST_STREAM:
            if sid == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
            if sid > self.last_sid:
                raise _ConnectionError(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            call = self.calls.get(sid)
            if call is not None:
                self._abort(call)
            self._window_open(sid)
        elif kind == GOAWAY:
            if sid != 0 or len(payload) < 8:
                raise _ConnectionError(PROTOCOL_ERROR, "a malformed GOAWAY")
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self.closing = True
            for call in list(self.calls.values()):
                if call.sid > last:
                    self._abort(call)
            self.flush()  # (closes the connection once no call is left)
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        elif kind == PRIORITY:
            if len(payload) != 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
        # other types: ignored (RFC 9113 5.5)

    @staticmethod
    def _unpad(payload: bytes) -> bytes:
        if not payload or payload[0] >= len(payload):
            raise _ConnectionError(PROTOCOL_ERROR, "padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        data = self._unpad(payload) if flags & PADDED else payload
        call = self.calls.get(sid)
        if call is None:  # a stream we already answered or reset: the window back at once
            if sid > self.last_sid:
                raise _ConnectionError(PROTOCOL_ERROR, "DATA on an idle stream")
            self._credit(0, n)
            return
        if n > len(data):  # padding is credited now, the message bytes when the handler takes them
            self._credit(sid, n - len(data))
        call.unacked += len(data)
        if call.sink is not None and not call.buf and len(data) >= 5 and data[0] == 0 and \
                int.from_bytes(data[1:5], "big") == len(data) - 5:
            call.messages.append(data[5:])  # one whole message and nothing buffered before it: no reassembly
        else:
            try:
                call._data(data)
            except _Refuse as e:
                self._finish_now(call, e.status, str(e))
        if flags & END_STREAM:
            call.ended = True
            call._wake()
        if call.sink is not None:
            self._deliver(call)

    def _decode(self, block: bytes) -> list:
        table = self.table
        if table.version != self.blocks_version:  # the same bytes may name other headers now
            self.blocks.clear()
            self.blocks_version = table.version
        headers = self.blocks.get(block)
        if headers is not None:
            return headers
        try:
            headers = self.decoder.decode(block, raw=True)
        except HPACKError as e:
            raise _ConnectionError(COMPRESSION_ERROR, f"a header block that does not decode: {e}") from None
        if table.version == self.blocks_version:  # decoding it changed nothing: the same bytes, the same headers
            if len(self.blocks) >= MAX_BLOCK_CACHE:
                self.blocks.clear()
            self.blocks[block] = headers
        return headers

    def _headers(self, sid: int, block: bytes, ended: bool) -> None:
        headers = self._decode(block)  # always: the decoder's table must follow every block
        call = self.calls.get(sid)
        if call is not None:  # trailers: the end of the client's side
            if not ended:
                raise _ConnectionError(PROTOCOL_ERROR, "a second HEADERS without END_STREAM")
            call.ended = True
            call._wake()
            if call.sink is not None:
                self._deliver(call)
            return
        if sid <= self.last_sid:  # trailers of a stream we already finished: nothing to do
            return
        if not sid & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"a client stream with an even id {sid}")
        self.last_sid = sid
        if self.closing or len(self.calls) >= MAX_CONCURRENT_STREAMS:  # the client may retry elsewhere
            self.out += frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM))
            return
        method = content_type = path = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
        if path is None or method is None:
            self.out += frame(RST_STREAM, 0, sid, struct.pack(">I", PROTOCOL_ERROR))
            return
        self._request(sid, path.decode("latin-1"), method, content_type or b"", ended)

    def _request(self, sid: int, path: str, method_name: bytes, content_type: bytes, ended: bool) -> None:
        self.stream_windows[sid] = self.peer_initial_window
        self._start(sid, path, method_name, content_type, ended)

    def _settings(self, payload: bytes) -> None:
        for k in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HI", payload, k)
            if ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for sid in self.stream_windows:  # applies to the open streams too (RFC 9113 6.9.2)
                    self.stream_windows[sid] += delta
                for sid in list(self.window_waiters):
                    self._window_open(sid)
            elif ident == S_MAX_FRAME_SIZE:
                if not 16384 <= value < 1 << 24:
                    raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif ident == S_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            # HEADER_TABLE_SIZE: our encoder uses no dynamic table; the others do not bind a server
        self.out += frame(SETTINGS, ACK, 0)

    def _window_update(self, sid: int, inc: int) -> None:
        if sid == 0:
            if inc == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0 on the connection")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window past 2^31-1")
            for s in list(self.window_waiters):
                self._window_open(s)
            return
        if sid in self.stream_windows:
            if inc == 0 or self.stream_windows[sid] + inc > MAX_WINDOW:  # a stream error: that stream ends
                self.out += frame(RST_STREAM, 0, sid, struct.pack(">I", PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR))
                call = self.calls.get(sid)
                if call is not None:
                    self._abort(call)
                return
            self.stream_windows[sid] += inc
            self._window_open(sid)
        elif sid > self.last_sid:
            raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")

    def _window_open(self, sid: int) -> None:
        fut = self.window_waiters.pop(sid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- inbound flow control
    def _credit(self, sid: int, n: int) -> None:
        """n bytes received (and taken, or not to be read) go back to the client, once half a window is owed."""
        self.owed += n
        if self.owed >= self.threshold:
            self.out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.owed))
            self.owed = 0
            if not self.receiving:
                self.flush()
        if sid and sid in self.stream_windows:
            owed = self.stream_owed.get(sid, 0) + n
            if owed >= self.threshold:
                self.out += frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", owed))
                owed = 0
                if not self.receiving:
                    self.flush()
            self.stream_owed[sid] = owed

    def consumed(self, call: Call) -> None:
        """Give the client back the window of every byte received on this call so far. Called when no whole
        message waits unread: while the handler lags behind (messages queued), the window stays spent and
        the client is held back (at most one window per stream is buffered here)."""
        n, call.unacked = call.unacked, 0
        if n and not call.closed:
            self._credit(call.sid, n)

    # -- sending
    def _open_headers(self, call: Call) -> None:
        call.headers_sent = True
        self.out += frame(HEADERS, END_HEADERS, call.sid, RESPONSE_HEADERS)

    def send_now(self, call: Call, message: bytes) -> bool:
        n = len(message) + 5
        sid = call.sid
        if n > self.send_window or n > self.stream_windows[sid] or n > self.peer_max_frame:
            return False
        if not call.headers_sent:
            self._open_headers(call)
        self.send_window -= n
        self.stream_windows[sid] -= n
        self.out += DATA_HEAD.pack(n >> 8, n & 0xFF, DATA, 0, sid, 0, n - 5)
        self.out += message
        if not self.receiving:  # (inside data_received the write at its end takes it)
            self.flush()
        return True

    async def send_message(self, call: Call, payload: bytes) -> None:
        """Write one framed gRPC message (prefix included), in as many DATA frames as the windows allow."""
        if not call.headers_sent:
            self._open_headers(call)
        view = memoryview(payload)
        sid = call.sid
        while view:
            if call.closed:
                raise CallClosed(f"stream {sid} is closed")
            window = min(self.send_window, self.stream_windows.get(sid, 0), self.peer_max_frame)
            if window <= 0:
                fut = self.window_waiters[sid] = self.loop.create_future()
                self.flush()
                await fut
                continue
            chunk, view = view[:window], view[window:]
            k = len(chunk)
            self.send_window -= k
            self.stream_windows[sid] -= k
            self.out += FRAME_HEAD.pack(k >> 8, k & 0xFF, DATA, 0, sid)
            self.out += chunk
        self.flush()

    def _forget(self, sid: int) -> None:
        self.calls.pop(sid, None)
        self.stream_windows.pop(sid, None)
        self.stream_owed.pop(sid, None)

    def _finish_now(self, call: Call, status: int, message: str) -> None:
        """End the call: trailers with grpc-status (trailers-only when nothing was sent) and END_STREAM."""
        if call.closed:
            return
        call.closed = True
        self._forget(call.sid)
        if call.unacked:  # what the handler never read: the connection's window back
            self._credit(0, call.unacked)
            call.unacked = 0
        ok = status == 0 and not message
        if ok and call.sink is not None and call.ended and call.headers_sent and not self.closing:
            # the sink's answers are out and the client has finished: nothing waits on these trailers
            self.later += frame(HEADERS, END_HEADERS | END_STREAM, call.sid, TRAILERS_OK)
            if self.later_timer is None:
                self.later_timer = self.loop.call_later(LATER_S, self._write_later)
            call._wake()
            self._window_open(call.sid)
            self._sink_closed(call)
            return
        block = TRAILERS_OK if ok else _trailers(status, message)
        if not call.headers_sent:  # trailers-only
            block = RESPONSE_HEADERS + block
        self.out += frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block)
        if not call.ended:  # the client may still be sending: we will not read it
            self.out += frame(RST_STREAM, 0, call.sid, b"\x00\x00\x00\x00")
        call._wake()
        self._window_open(call.sid)
        if not self.receiving:
            self.flush()
        self._sink_closed(call)

    def _abort(self, call: Call) -> None:
        """The client reset the stream (or the connection is gone): the handler's task is cancelled."""
        if call.closed:
            return
        call.closed = True
        self._forget(call.sid)
        if call.unacked:
            self._credit(0, call.unacked)
            call.unacked = 0
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
        self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, NO_ERROR))
        self._flush()
