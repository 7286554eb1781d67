"""tokenmill's own gRPC-over-HTTP/2 server (router/grpc_h2.py, the EPP's `--epp-transport h2`) against
independent clients: grpc.aio (gRPC's C-core: framing, flow control, cancel, GOAWAY as gRPC does them) and a
bare h2 client connection where the frames themselves are checked."""

import asyncio
import json
import socket

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from test_router_epp import ENDPOINTS, Envoy, make_router, picked

from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.epp import EppServer
from tokenmill.router.grpc_frames import FramesProtocol
from tokenmill.router.grpc_h2 import GrpcH2Protocol, GrpcH2Server, Method

ECHO = "/test.Echo/Echo"
SLOW = "/test.Echo/SlowReader"
FRAMING = "h2"
PROTOCOLS = {"h2": GrpcH2Protocol, "frames": FramesProtocol}


@pytest.fixture(autouse=True, params=["h2", "frames"])
def framing(request):
    """Every test against both HTTP/2 framings of the server: the h2 library's state machine (the reference),
    and grpc_frames.py's own."""
    global FRAMING
    FRAMING = request.param
    yield request.param
    FRAMING = "h2"


def run(coro):
    return asyncio.run(coro)


def raw_frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def echo_methods(read_delay_s=0.0):
    async def echo(call):  # every message back, as it comes
        while (m := await call.read()) is not None:
            await call.write(m)

    async def slow(call):  # reads nothing for a while: the client must be held back by the window
        await asyncio.sleep(read_delay_s)
        total = 0
        while (m := await call.read()) is not None:
            total += len(m)
        await call.write(str(total).encode())

    return {ECHO: Method("stream", echo), SLOW: Method("stream", slow)}


async def serving(methods, window):
    server = GrpcH2Server(methods, window=window, protocol=PROTOCOLS[FRAMING])
    port = await server.start("127.0.0.1", 0)
    return server, port


def bidi(channel, path):
    return channel.stream_stream(path, request_serializer=None, response_deserializer=None)


def test_flow_control_large_messages_both_ways_with_a_small_window():
    """4 x 1 MiB each way through a 16 KiB window: the server waits for the client's WINDOW_UPDATEs when it
    sends, and the client waits for the server's (given only as the handler reads) when it sends."""
    async def main():
        server, port = await serving(echo_methods(), window=16384)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]) as ch:
                call = bidi(ch, ECHO)()
                blobs = [bytes([k]) * (1 << 20) + b"end%d" % k for k in range(4)]
                for b in blobs:
                    await call.write(b)
                    assert await call.read() == b
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
        finally:
            await server.stop(0)

    run(main())


def test_a_handler_that_does_not_read_holds_the_client_back_by_the_window():
    """While whole messages wait unread the server grants no window: a client sending 64 x 16 KiB to a
    handler that reads nothing for 0.3 s is held back (h2 client: it sees its window at 0), then everything
    arrives."""
    async def main():
        server, port = await serving(echo_methods(read_delay_s=0.3), window=65535)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", SLOW.encode()),
                                (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        msg = (b"\x00" + (1 << 14).to_bytes(4, "big") + b"x" * (1 << 14)) * 64  # 64 messages of 16 KiB
        sent, blocked, events, trailers = 0, False, [], None
        try:
            writer.write(conn.data_to_send())
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while trailers is None:
                while sent < len(msg):
                    window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                    if window <= 0:
                        blocked = blocked or loop.time() - t0 < 0.3
                        break
                    conn.send_data(sid, msg[sent:sent + window], end_stream=sent + window >= len(msg))
                    sent += window
                writer.write(conn.data_to_send())
                data = await asyncio.wait_for(reader.read(65536), 10)
                assert data, "the server closed the connection"
                for ev in conn.receive_data(data):
                    events.append(ev)
                    if isinstance(ev, h2.events.TrailersReceived):
                        trailers = dict(ev.headers)
                    if isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                writer.write(conn.data_to_send())
            assert blocked  # the client ran out of window before the handler started reading
            body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
            assert body[5:] == str(1 << 20).encode() and trailers[b"grpc-status"] == b"0"
        finally:
            writer.close()
            await server.stop(0)

    run(main())


def test_an_epp_request_with_a_large_body_is_picked_and_passed_back_whole():
    """A 3 MiB prompt in 48 KiB chunks (FULL_DUPLEX_STREAMED), passed back in one 3 MiB body message."""
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        envoy = Envoy(server.port)
        envoy.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                                  options=[("grpc.max_receive_message_length", 8 << 20)])
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
        envoy.stub = pb_grpc.ExternalProcessorStub(envoy.channel)
        try:
            data = json.dumps({"prompt": "word " * (3 << 18), "max_tokens": 4}).encode()
            call = envoy.open()
            await call.write(envoy.headers())
            step = 48 << 10
            for i in range(0, len(data), step):
                await call.write(envoy.body(data[i:i + step], eos=i + step >= len(data)))
            assert picked(await call.read()) in ENDPOINTS
            back = await call.read()
            assert back.request_body.response.body_mutation.streamed_response.body == data
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert router.in_flight == 0
        finally:
            await envoy.channel.close()
            await server.stop(0)

    run(main())


def test_many_concurrent_streams_on_one_connection():
    """400 ext_proc streams open at once on one HTTP/2 connection (h2's default limit would be 100): every
    one picked, the load view holds all 400, and all are released at the end. The open-stream count h2 checks
    new streams against is the server's own (its live calls), and closed streams (cancelled, finished) leave
    h2's stream table at once instead of at h2's next O(streams) walk."""
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        envoy = Envoy(server.port)
        try:
            async def one(i):
                call = envoy.open()
                await call.write(envoy.headers())
                await call.write(envoy.body(json.dumps({"prompt": f"p{i % 7} " * 40, "max_tokens": 4}).encode()))
                ep = picked(await call.read())
                await call.read()
                return call, ep

            calls = await asyncio.gather(*(one(i) for i in range(400)))
            assert {ep for _, ep in calls} <= set(ENDPOINTS)
            assert router.in_flight == 400
            (conn,) = server.server.connections
            assert type(conn) is PROTOCOLS[FRAMING]
            assert len(conn.calls) == 400
            if FRAMING == "h2":
                assert conn.h2.open_inbound_streams == 400
            else:  # our own framing keeps a send window per live stream, and only those
                assert set(conn.stream_windows) == set(conn.calls)
            # a quarter cancelled, a quarter finished: the server forgets each at once, and so does h2's
            # state machine (it holds only the live streams; the closed ones it only remembers how they closed)
            for call, _ in calls[:100]:
                call.cancel()
            for call, _ in calls[100:200]:
                await call.done_writing()
            for call, _ in calls[100:200]:
                assert await call.read() is grpc.aio.EOF
            for _ in range(100):
                if len(conn.calls) == 200:
                    break
                await asyncio.sleep(0.01)
            assert len(conn.calls) == 200 and router.in_flight == 200
            if FRAMING == "h2":
                assert set(conn.h2.streams) == set(conn.calls) and conn.h2.open_inbound_streams == 200
                assert len(conn.h2._closed_streams) >= 200  # how each closed is remembered (late frames)
            else:
                assert set(conn.stream_windows) == set(conn.calls)
            call, ep = await one(1000)
            assert ep in ENDPOINTS and len(conn.calls) == 201
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            for call, _ in calls[200:]:
                await call.done_writing()
            for call, _ in calls[200:]:
                assert await call.read() is grpc.aio.EOF
            await asyncio.sleep(0.05)
            assert router.in_flight == 0
            assert not conn.calls
            if FRAMING == "h2":
                assert not conn.h2.streams and conn.h2.open_inbound_streams == 0
            else:
                assert not conn.stream_windows and not conn.stream_owed
        finally:
            await envoy.channel.close()
            await server.stop(0)

    run(main())


def test_a_client_cancel_mid_stream_releases_the_load_and_the_connection_serves_on():
    """RST_STREAM (grpc.aio's cancel) after the pick and before the response: the handler's task is cancelled,
    the exchange closed (in-flight back to 0), and the same connection still serves new streams."""
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        envoy = Envoy(server.port)
        try:
            call = envoy.open()
            await call.write(envoy.headers())
            await call.write(envoy.body(json.dumps({"prompt": "hello " * 30, "max_tokens": 4}).encode()))
            assert picked(await call.read()) in ENDPOINTS
            await call.read()
            assert router.in_flight == 1
            call.cancel()
            for _ in range(100):
                if router.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert router.in_flight == 0
            assert not any(c.calls for c in server.server.connections)  # the server forgot the stream
            # mid-body too: headers and half a body, then cancel
            call = envoy.open()
            await call.write(envoy.headers())
            await call.write(envoy.body(b'{"prompt": "hel', eos=False))
            await asyncio.sleep(0.05)
            call.cancel()
            await asyncio.sleep(0.05)
            assert router.in_flight == 0 and not any(c.calls for c in server.server.connections)
            call = envoy.open()
            await call.write(envoy.headers())
            await call.write(envoy.body(json.dumps({"prompt": "again", "max_tokens": 4}).encode()))
            assert picked(await call.read()) in ENDPOINTS
            await call.read()
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
        finally:
            await envoy.channel.close()
            await server.stop(0)

    run(main())


def test_shutdown_sends_goaway_lets_the_stream_in_flight_finish_then_closes():
    """stop(grace): a GOAWAY (NO_ERROR, naming the last accepted stream) on every connection; the stream in
    flight completes normally within the grace; then the connection closes. Checked frame by frame with a bare h2 client."""
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        events = []

        def send(sid, msg: pb.ProcessingRequest, end=False):
            data = msg.SerializeToString()
            conn.send_data(sid, b"\x00" + len(data).to_bytes(4, "big") + data, end_stream=end)

        def open_stream():
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"),
                                    (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                    (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
            return sid

        async def pump(until):
            while not until():
                writer.write(conn.data_to_send())
                data = await asyncio.wait_for(reader.read(65536), 5)
                if not data:
                    return False
                for ev in conn.receive_data(data):
                    events.append(ev)
                    if isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            writer.write(conn.data_to_send())
            return True

        def data_on(sid):
            return sum(1 for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)

        try:
            first = open_stream()
            send(first, Envoy.headers())
            send(first, Envoy.body(json.dumps({"prompt": "hi " * 20, "max_tokens": 4}).encode()))
            await pump(lambda: data_on(first) >= 2)  # picked, body passed back
            assert router.in_flight == 1
            stopping = asyncio.create_task(server.stop(5.0))
            await pump(lambda: any(isinstance(e, h2.events.ConnectionTerminated) for e in events))
            goaway = next(e for e in events if isinstance(e, h2.events.ConnectionTerminated))
            assert goaway.error_code == 0 and goaway.last_stream_id == first
            assert not stopping.done()  # waiting for the stream in flight
            # the gateway finishes the request it had in flight: response headers, end of stream. (h2's own
            # client state machine sends nothing after a GOAWAY: these frames are written by hand, the answer
            # read frame by frame, its header blocks decoded with the connection's HPACK decoder)
            resp = Envoy.response_headers().SerializeToString()
            writer.write(raw_frame(0, 0, first, b"\x00" + len(resp).to_bytes(4, "big") + resp)
                         + raw_frame(0, 1, first, b""))  # DATA, then an empty DATA with END_STREAM
            buf, trailers = b"", None
            while trailers is None:
                data = await asyncio.wait_for(reader.read(65536), 5)
                assert data, "the connection closed before the stream ended"
                buf += data
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n, kind, flags, sid = int.from_bytes(buf[:3], "big"), buf[3], buf[4], int.from_bytes(buf[5:9], "big")
                    payload, buf = buf[9:9 + n], buf[9 + n:]
                    if kind == 1 and sid == first and flags & 1:  # HEADERS with END_STREAM: the trailers
                        trailers = dict(conn.decoder.decode(payload, raw=True))
            assert trailers[b"grpc-status"] == b"0"
            await asyncio.wait_for(stopping, 5)
            assert router.in_flight == 0
            assert await asyncio.wait_for(reader.read(65536), 5) == b""  # the server closed the connection
        finally:
            writer.close()
            await server.stop(0)

    run(main())


def test_an_unknown_method_is_unimplemented_and_a_port_in_use_is_an_error():
    router = make_router()

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary("/no.Such/Method", request_serializer=None,
                                         response_deserializer=None)(b"")
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                s.listen()
                with pytest.raises(OSError, match="for the EPP"):
                    EppServer(router, "127.0.0.1", s.getsockname()[1], FRAMING)
        finally:
            await server.stop(0)

    run(main())


def test_health_watch_streams_the_status_and_its_changes():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    router = make_router()

    async def main():
        server = EppServer(router, "127.0.0.1", 0, FRAMING)
        await server.start(ready=True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                await server.set_ready(False)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
                unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"))
                assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                unknown.cancel()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await server.stop(0)

    run(main())
