"""HTTP/2 framing edge cases of tokenmill's gRPC server, frame by frame from a hand-written client (its own
frames and an independent HPACK encoder/decoder, `hpack`), against both framings: grpc_frames.py (ours, the
EPP's default) and the `h2` library's state machine (the reference: every case here passes on it too).
The gRPC-client tests (grpc.aio as the gateway) run over both framings in test_router_grpc_h2.py and
test_router_epp.py."""

import asyncio
import struct

import pytest
from hpack import Decoder, Encoder

from tokenmill.router.grpc_frames import FramesProtocol
from tokenmill.router.grpc_h2 import GrpcH2Protocol, GrpcH2Server, Method

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
ECHO, COUNT = "/t.E/Echo", "/t.E/Count"
PROTOCOLS = {"h2": GrpcH2Protocol, "frames": FramesProtocol}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def frame(kind, flags, sid, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def grpc_msg(data: bytes) -> bytes:
    return b"\x00" + len(data).to_bytes(4, "big") + data


def request_headers(path=ECHO):
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t"),
            ("content-type", "application/grpc"), ("te", "trailers")]


class Client:
    """A bare HTTP/2 client: writes what it is told, reads frames, decodes header blocks, answers nothing by
    itself (no SETTINGS ack, no window updates) unless asked."""

    def __init__(self, reader, writer, settings=b""):
        self.reader, self.writer = reader, writer
        self.enc, self.dec = Encoder(), Decoder()
        self.buf = b""
        self.writer.write(PREFACE + frame(SETTINGS, 0, 0, settings))

    @classmethod
    async def connect(cls, port, settings=b""):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, settings)

    def headers_block(self, path=ECHO) -> bytes:
        return self.enc.encode(request_headers(path))

    async def frame(self):
        while True:
            if len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + n:
                    kind, flags, sid = self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
                    payload, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
                    return kind, flags, sid, payload
            data = await self.reader.read(65536)
            if not data:
                return None
            self.buf += data

    async def until_end(self, sids, ack_data=True):
        """Frames until every stream in sids has ended: {sid: (data bytes, trailers dict, reset code)}."""
        got = {s: [b"", {}, None] for s in sids}
        while any(v[1] == {} and v[2] is None for v in got.values()):
            f = await self.frame()
            assert f is not None, "the server closed the connection"
            kind, flags, sid, payload = f
            if kind == HEADERS:
                hs = dict(self.dec.decode(payload, raw=True))
                if flags & END_STREAM and sid in got:
                    got[sid][1] = hs
            elif kind == DATA and sid in got:
                got[sid][0] += payload
                if ack_data and payload:
                    self.writer.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", len(payload)))
                                      + frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", len(payload))))
            elif kind == RST_STREAM and sid in got:
                got[sid][2] = int.from_bytes(payload, "big")
            elif kind == GOAWAY:
                raise AssertionError(f"GOAWAY {payload!r}")
        return got

    def close(self):
        self.writer.close()


@pytest.fixture(params=["h2", "frames"])
def serve(request):
    """An echo server (every message back as it comes; Count: the total size of all messages, at the end)
    on the framing under test."""
    async def echo(call):
        while (m := await call.read()) is not None:
            await call.write(m)

    async def count(call):
        total = 0
        while (m := await call.read()) is not None:
            total += len(m)
        await call.write(str(total).encode())

    async def start(window=1 << 20):
        server = GrpcH2Server({ECHO: Method("stream", echo), COUNT: Method("stream", count)}, window=window,
                              protocol=PROTOCOLS[request.param])
        return server, await server.start("127.0.0.1", 0)

    return start


def test_frames_split_across_reads_and_several_frames_in_one_read(serve):
    """A request written one byte at a time (each byte its own read), then three whole requests in one write:
    every one echoed."""
    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            await c.writer.drain()
            await asyncio.sleep(0.05)
            raw = frame(HEADERS, END_HEADERS, 1, c.headers_block()) + frame(DATA, END_STREAM, 1, grpc_msg(b"one"))
            for b in raw:
                c.writer.write(bytes((b,)))
                await c.writer.drain()
                await asyncio.sleep(0.001)
            got = await c.until_end([1])
            assert got[1][0] == grpc_msg(b"one") and got[1][1][b"grpc-status"] == b"0"
            many = b"".join(frame(HEADERS, END_HEADERS, sid, c.headers_block())
                            + frame(DATA, 0, sid, grpc_msg(b"a%d" % sid)) + frame(DATA, END_STREAM, sid, grpc_msg(b"b"))
                            for sid in (3, 5, 7))
            c.writer.write(many)
            got = await c.until_end([3, 5, 7])
            for sid in (3, 5, 7):
                assert got[sid][0] == grpc_msg(b"a%d" % sid) + grpc_msg(b"b") and got[sid][1][b"grpc-status"] == b"0"
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_padding_priority_and_continuation(serve):
    """HEADERS padded and with priority fields, the block continued over two CONTINUATION frames, DATA padded,
    a PRIORITY frame and an unknown frame type between requests: all handled, the message echoed whole."""
    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            block = c.headers_block()
            pad = 7
            first = bytes((pad,)) + struct.pack(">IB", 0, 15) + block[:3] + b"\x00" * pad
            msg = grpc_msg(b"padded message")
            c.writer.write(frame(HEADERS, PADDED | PRIORITY_FLAG, 1, first)
                           + frame(CONTINUATION, 0, 1, block[3:5]) + frame(CONTINUATION, END_HEADERS, 1, block[5:])
                           + frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 3))
                           + frame(0xEE, 0, 0, b"unknown frame types are ignored")
                           + frame(DATA, PADDED, 1, bytes((4,)) + msg[:6] + b"\x00" * 4)
                           + frame(DATA, PADDED | END_STREAM, 1, bytes((0,)) + msg[6:]))
            got = await c.until_end([1])
            assert got[1][0] == msg and got[1][1][b"grpc-status"] == b"0"
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_a_frame_between_headers_and_continuation_is_a_connection_error(serve):
    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            block = c.headers_block()
            c.writer.write(frame(HEADERS, 0, 1, block[:4]) + frame(PING, 0, 0, b"12345678"))
            while True:
                f = await c.frame()
                assert f is not None, "closed without a GOAWAY"
                if f[0] == GOAWAY:
                    assert int.from_bytes(f[3][4:8], "big") == 1  # PROTOCOL_ERROR
                    break
                assert f[0] != PING  # nothing after the broken block is processed
            assert await c.reader.read() == b""  # then the connection closes
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_ping_is_answered_with_its_payload_and_settings_are_acknowledged(serve):
    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            c.writer.write(frame(PING, 0, 0, b"pingpong"))
            seen = set()
            while not {"ack", "pong"} <= seen:
                kind, flags, sid, payload = await c.frame()
                if kind == SETTINGS and flags & ACK:
                    seen.add("ack")
                if kind == PING:
                    assert flags & ACK and payload == b"pingpong"
                    seen.add("pong")
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_a_body_larger_than_the_window_is_taken_as_the_window_is_given_back(serve):
    """The server's window is 16 KiB (per stream and, above 64 KiB, not raised: the connection's stays at
    the default 65535): a 200 KiB request is only sent as WINDOW_UPDATEs come, and counted whole."""
    async def main():
        server, port = await serve(window=16384)
        c = await Client.connect(port)
        try:
            body = grpc_msg(b"x" * 200_000)
            c.writer.write(frame(HEADERS, END_HEADERS, 1, c.headers_block(COUNT)))
            stream_window, conn_window, sent, got = 16384, 65535, 0, None
            # (the client starts from the protocol's 65535 until it has read the server's SETTINGS: it
            # takes the smaller, as the server may have lowered it)
            while got is None:
                while sent < len(body) and min(stream_window, conn_window) > 0:
                    k = min(stream_window, conn_window, 16384, len(body) - sent)
                    c.writer.write(frame(DATA, END_STREAM if sent + k == len(body) else 0, 1, body[sent:sent + k]))
                    sent += k
                    stream_window -= k
                    conn_window -= k
                kind, flags, sid, payload = await c.frame()
                if kind == WINDOW_UPDATE:
                    inc = int.from_bytes(payload, "big")
                    if sid == 0:
                        conn_window += inc
                    else:
                        stream_window += inc
                elif kind == DATA and sid == 1:
                    got = payload
            assert got == grpc_msg(b"200000")
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_the_server_honours_a_small_peer_window_and_frame_size(serve):
    """The client allows 100 bytes per stream: a 1,000-byte echo comes in frames of at most 100 bytes, each
    after a WINDOW_UPDATE."""
    async def main():
        server, port = await serve()
        c = await Client.connect(port, settings=struct.pack(">HI", 0x4, 100))
        try:
            msg = grpc_msg(b"y" * 995)
            c.writer.write(frame(HEADERS, END_HEADERS, 1, c.headers_block()) + frame(DATA, END_STREAM, 1, msg))
            echoed, sizes = b"", []
            while len(echoed) < len(msg):
                kind, flags, sid, payload = await c.frame()
                if kind == DATA:
                    sizes.append(len(payload))
                    echoed += payload
                    c.writer.write(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", len(payload))))
            assert echoed == msg and max(sizes) <= 100 and len(sizes) >= 10
            got = await c.until_end([1])
            assert got[1][1][b"grpc-status"] == b"0"
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_a_client_reset_mid_stream_ends_the_call_and_the_connection_serves_on(serve):
    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            c.writer.write(frame(HEADERS, END_HEADERS, 1, c.headers_block(COUNT)) + frame(DATA, 0, 1, grpc_msg(b"x")[:4]))
            for _ in range(100):
                if any(conn.calls for conn in server.connections):
                    break
                await asyncio.sleep(0.01)
            (conn,) = server.connections
            (call,) = conn.calls.values()
            c.writer.write(frame(RST_STREAM, 0, 1, struct.pack(">I", 8)))  # CANCEL
            for _ in range(100):
                if not conn.calls and call.task.done():
                    break
                await asyncio.sleep(0.01)
            assert not conn.calls and call.closed and call.task.done()  # (the handler's task was cancelled)
            c.writer.write(frame(HEADERS, END_HEADERS, 3, c.headers_block()) + frame(DATA, END_STREAM, 3, grpc_msg(b"z")))
            got = await c.until_end([3])
            assert got[3][0] == grpc_msg(b"z") and got[3][1][b"grpc-status"] == b"0"
        finally:
            c.close()
            await server.stop(0)

    run(main())


def test_headers_are_decoded_right_when_the_same_block_bytes_change_meaning(serve):
    """HPACK: a block of one indexed field (index 62, the newest dynamic entry) names whatever was inserted
    last. The block `\\xbe` is sent after :path /t.E/Echo was inserted (echo), then after an unknown
    path was inserted (UNIMPLEMENTED), then after Echo again: the server's answers follow the table (our framing
    caches decoded blocks by their bytes: the cache must not outlive a table change)."""
    def literal_indexed(name_index: int, value: bytes) -> bytes:  # literal with incremental indexing, indexed name
        return bytes((0x40 | name_index,)) + bytes((len(value),)) + value

    # :method POST, :scheme http (indexed), :authority t, content-type (literals without indexing: the table
    # holds only what the test inserts), :path between them (pseudo-headers first)
    pseudo, ctype = b"\x83\x86\x01\x01t", b"\x0f\x10\x10application/grpc"

    async def main():
        server, port = await serve()
        c = await Client.connect(port)
        try:
            sid = 1
            for path, want in ((ECHO, b"0"), ("/no.Such/Method", b"12"), (ECHO, b"0")):
                # insert :path (static name index 4) with incremental indexing: it becomes dynamic entry 62
                c.writer.write(frame(HEADERS, END_HEADERS, sid, pseudo + literal_indexed(4, path.encode()) + ctype)
                               + frame(DATA, END_STREAM, sid, grpc_msg(b"p")))
                got = await c.until_end([sid])
                assert got[sid][1][b"grpc-status"] == want
                for _ in range(2):  # the same bytes twice: :path from the table
                    sid += 2
                    c.writer.write(frame(HEADERS, END_HEADERS, sid, pseudo + b"\xbe" + ctype)
                                   + frame(DATA, END_STREAM, sid, grpc_msg(b"q")))
                    got = await c.until_end([sid])
                    assert got[sid][1][b"grpc-status"] == want, (path, got[sid])
                    if want == b"0":
                        assert got[sid][0] == grpc_msg(b"q")
                (conn,) = server.connections
                if isinstance(conn, FramesProtocol):  # the repeated block was decoded once, then taken from the cache
                    assert list(conn.blocks) == [pseudo + b"\xbe" + ctype]
                sid += 2
        finally:
            c.close()
            await server.stop(0)

    run(main())


@pytest.mark.parametrize("bad", ["preface", "frame-size", "hpack"])
def test_a_broken_connection_gets_a_goaway_and_is_closed(request, serve, bad):
    """Our framing: a GOAWAY with the error's own code, then the close. (The h2 reference closes too, with a
    GOAWAY PROTOCOL_ERROR for a bad frame or block, none for a bad preface.)"""
    ours = request.node.callspec.params["serve"] == "frames"
    async def main():
        server, port = await serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            if bad == "preface":
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            elif bad == "frame-size":  # above the 16384 bytes the server allows
                writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(DATA, 0, 1, b"x" * 20000))
            else:  # an index past both tables
                writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xff\x7f"))
            data = b""
            while chunk := await reader.read(65536):
                data += chunk
            # the last frame before the close is a GOAWAY (after the server's SETTINGS when the preface was read)
            frames, i = [], 0
            while i + 9 <= len(data):
                n = int.from_bytes(data[i:i + 3], "big")
                frames.append((data[i + 3], data[i + 9:i + 9 + n]))
                i += 9 + n
            goaways = [p for k, p in frames if k == GOAWAY]
            if not ours and bad == "preface":
                return
            assert goaways, frames
            code = int.from_bytes(goaways[-1][4:8], "big")
            assert code == ({"preface": 1, "frame-size": 6, "hpack": 9} if ours else {"frame-size": 6, "hpack": 1})[bad]
        finally:
            writer.close()
            await server.stop(0)

    run(main())


def test_a_finished_sink_calls_trailers_go_with_the_next_write_or_after_a_short_delay(monkeypatch):
    """grpc_frames defers the OK trailers of a "sink" call whose client has finished (nothing waits on them)
    to the next write on the connection — another stream's answer carries them — or, with no other traffic,
    writes them LATER_S after; a call whose client is still sending gets its trailers (and RST_STREAM) at once."""
    from tokenmill.router import grpc_frames
    from tokenmill.router.grpc_h2 import Sink

    class Upper(Sink):
        def __init__(self, call):
            self.call = call

        def message(self, data):
            if data == b"stop":  # finished while the client still sends: trailers now, and RST_STREAM
                self.call.finish()
            else:
                self.call.send_now(data.upper())

        def end(self):
            self.call.finish()

    async def stream_frame(c, timeout):  # the next frame on a stream (the connection's SETTINGS etc. skipped)
        while True:
            f = await asyncio.wait_for(c.frame(), timeout)
            if f[2] != 0:
                return f

    async def main():
        server = GrpcH2Server({ECHO: Method("sink", Upper)}, protocol=FramesProtocol)
        port = await server.start("127.0.0.1", 0)
        c = await Client.connect(port)
        try:
            monkeypatch.setattr(grpc_frames, "LATER_S", 60.0)  # only another write can carry them
            c.writer.write(frame(HEADERS, END_HEADERS, 1, c.headers_block()) + frame(DATA, 0, 1, grpc_msg(b"a")))
            kind, _, sid, payload = await stream_frame(c, 5)  # the response headers, then the answer
            assert (kind, sid) == (HEADERS, 1)
            c.dec.decode(payload, raw=True)
            assert await stream_frame(c, 5) == (DATA, 0, 1, grpc_msg(b"A"))
            c.writer.write(frame(DATA, END_STREAM, 1))  # the client is done: stream 1's trailers wait
            for _ in range(100):
                (conn,) = server.connections
                if conn.later:
                    break
                await asyncio.sleep(0.01)
            assert conn.later and not conn.calls
            with pytest.raises(asyncio.TimeoutError):
                await stream_frame(c, 0.2)
            c.writer.write(frame(HEADERS, END_HEADERS, 3, c.headers_block()) + frame(DATA, 0, 3, grpc_msg(b"b")))
            got = {}
            while 1 not in got or 3 not in got:  # stream 3's answer; stream 1's trailers in the same write
                kind, flags, sid, payload = await stream_frame(c, 5)
                if kind == HEADERS and flags & END_STREAM:
                    got[sid] = dict(c.dec.decode(payload, raw=True))
                elif kind == HEADERS:
                    c.dec.decode(payload, raw=True)
                elif kind == DATA:
                    got[sid] = payload
            assert got[1][b"grpc-status"] == b"0" and got[3] == grpc_msg(b"B") and not conn.later

            monkeypatch.setattr(grpc_frames, "LATER_S", 0.01)  # no other traffic: the delay writes them
            c.writer.write(frame(DATA, END_STREAM, 3))
            kind, flags, sid, payload = await stream_frame(c, 5)
            assert (kind, flags & END_STREAM, sid) == (HEADERS, END_STREAM, 3)
            assert c.dec.decode(payload, raw=True) == [(b"grpc-status", b"0")]

            monkeypatch.setattr(grpc_frames, "LATER_S", 60.0)
            c.writer.write(frame(HEADERS, END_HEADERS, 5, c.headers_block()) + frame(DATA, 0, 5, grpc_msg(b"stop")))
            got = await asyncio.wait_for(c.until_end([5]), 5)  # at once: trailers-only, then RST_STREAM
            assert got[5][1][b"grpc-status"] == b"0"
        finally:
            c.close()
            await server.stop(0)

    run(main())
