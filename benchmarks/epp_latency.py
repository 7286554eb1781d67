"""Endpoint Picker decision latency: `tokenmill route --epp-port` under an open-loop 500 decisions/s.

    python benchmarks/epp_latency.py                             # 500/s for 10 s, admission off then leading
    python benchmarks/epp_latency.py --rate 1000 --duration 20 --workers 16
    python benchmarks/epp_latency.py --no-response-body         # the gateway streams no response body to it
    python benchmarks/epp_latency.py --placement shared --placement pinned --pattern full --pattern resp-headers \
        --server echo-aio --server picker --server picker-uvloop   # one run: placements x patterns x servers

Three processes: stub workers (one aiohttp process answering /health, /metrics and /v1/models on
`--workers` ports: the picker probes them but never sends them requests), the real `tokenmill route
--epp-port` CLI (by default as that CLI deploys it: its own HTTP/2 framing on uvloop), and a client playing
Envoy's ext_proc filter (by default the C++ one, `epp_loadgen.cpp`, built with g++ at run time: Poisson
arrivals, latency from the intended send time; `--client grpc` is grpc.aio), FULL_DUPLEX_STREAMED: for
each request, on a fixed schedule (open loop: a late picker does not slow the offered rate), one gRPC
stream sends the request headers and the body (a completion prompt: one of 8 shared 1,600-character
system prompts + a unique question), then waits for the picker's answer. The decision latency is the time
from writing the headers to reading the answer (the headers response naming the endpoint, or an
ImmediateResponse), measured here, so it includes gRPC transport both ways. The stream then plays the
upstream: response headers after a simulated TTFT (30 ms), a first SSE chunk, and the end of the body
after a simulated decode (300 ms), so the picker's load view sees the traffic it routed.

`lag` is how late this client started requests against its schedule: when it is large the client, not
the picker, was the bottleneck and the row is not a measurement of the picker. With `--client raw` the
latency is taken on the wire as the client sees it — from the moment its HEADERS frame is written to the
socket to the moment the answer is parsed off the socket (in data_received, before the waiting task runs)
— and `send lag` is how late that write was against the schedule; the `task-measured` p99 is the older
measure (from the task's own clock before the send to its wake-up after the answer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import wait_http  # noqa: E402

PY = sys.executable
PICKERS = ("picker", "picker-uvloop", "picker-h2", "picker-h2-uvloop", "picker-frames", "picker-frames-uvloop",
           "baseline", "baseline-h2-uvloop", "baseline-frames-uvloop")
SERVERS = (*PICKERS, "echo-h2", "echo-aio", "echo-aio-uvloop", "echo-aio-rw", "echo-aio-opts", "echo-aio-x2", "echo-sync")
# the ext_proc message patterns a gateway can be configured for (processing_mode), per request:
#   full          request headers + body (FULL_DUPLEX_STREAMED), response headers, every response body chunk
#                 (FULL_DUPLEX_STREAMED: each one echoed back), end of stream: what the inference gateways
#                 configure for an InferencePool by default
#   resp-headers  request headers + body, response headers; response_body_mode NONE, trailers SKIP: what the
#                 picker needs (the pick, the served endpoint, the status; the stream's end closes the gRPC call)
PATTERNS = ("full", "resp-headers")
PLACEMENTS = ("shared", "pinned")
CLIENTS = ("grpc", "raw", "cpp")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_workers(ports: list[int]) -> None:
    """The worker side: healthy, idle, empty gauges."""
    from aiohttp import web

    async def health(request):
        return web.json_response({"status": "ok"})

    async def metrics(request):
        return web.Response(text="# TYPE tokenmill_engine_steps counter\ntokenmill_engine_steps_total 1\n")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "demo", "object": "model"}]})

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for p in ports:
            await web.TCPSite(runner, "127.0.0.1", p).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def echo_server(kind: str, port: int, endpoints: list[str]) -> None:
    """The floor: a gRPC ext_proc server with the picker's message pattern and nothing else (no parsing, no
    policy, no metrics; every answer prebuilt). `aio`: grpc.aio, as the picker; `sync`: grpc.server with a
    thread pool."""
    import itertools
    from concurrent import futures

    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf import struct_pb2

    picks = []
    for ep in endpoints:
        md = struct_pb2.Struct()
        md.update({"envoy.lb": {"x-gateway-destination-endpoint": ep}})
        picks.append(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
                key="x-gateway-destination-endpoint", raw_value=ep.encode()))]), clear_route_cache=True)),
            dynamic_metadata=md))
    rr = itertools.cycle(picks)
    resp_headers_ack = pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def passthrough(kind: str, body: pb.HttpBody) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(**{kind: pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=body.body, end_of_stream=body.end_of_stream))))})

    def answer(req):
        which = req.WhichOneof("request")
        if which == "request_body":
            if req.request_body.end_of_stream:
                return (next(rr), passthrough("request_body", req.request_body))
            return ()
        if which == "response_headers":
            return (resp_headers_ack,)
        if which == "response_body":
            return (passthrough("response_body", req.response_body),)
        return ()

    class Aio(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):
            async for req in request_iterator:
                for r in answer(req):
                    yield r

    class AioReadWrite(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # context.read / write instead of an async generator
            while (req := await context.read()) is not grpc.aio.EOF:
                for r in answer(req):
                    await context.write(r)

    class Sync(pb_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):
            for req in request_iterator:
                yield from answer(req)

    if kind == "h2":  # the same answers through tokenmill's own HTTP/2 gRPC transport (router/grpc_h2.py)
        from tokenmill.router.grpc_h2 import GrpcH2Server, Method

        async def process(call):
            while (data := await call.read()) is not None:
                for r in answer(pb.ProcessingRequest.FromString(data)):
                    await call.write(r.SerializeToString())

        async def main_h2():
            server = GrpcH2Server({"/envoy.service.ext_proc.v3.ExternalProcessor/Process": Method("stream", process)})
            await server.start("127.0.0.1", port)
            await asyncio.Event().wait()

        asyncio.run(main_h2())
        return

    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=256))
        pb_grpc.add_ExternalProcessorServicer_to_server(Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server(options=ECHO_OPTIONS.get(kind, ()))
        if kind == "aio-uvloop":
            assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        pb_grpc.add_ExternalProcessorServicer_to_server(AioReadWrite() if kind == "aio-rw" else Aio(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind == "aio-uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# gRPC core knobs tried on the floor: no BDP pings, latency-first call combining
ECHO_OPTIONS = {"aio-opts": (("grpc.http2.bdp_probe", 0), ("grpc.optimization_target", "latency"))}


def wait_grpc(port: int, timeout_s: float = 60.0) -> None:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)


async def drive(epp_port: int, rate: float, duration_s: float, ttft_s: float, decode_s: float, seed: int,
                response_body: bool = True, n_channels: int = 1, chunks: int = 2) -> dict:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    rng = random.Random(seed)
    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
            ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode,
            response_body_mode=mode if response_body else processing_mode_pb2.ProcessingMode.NONE))
    resp_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    first_chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"choices":[{"text":"x"}]}\n\n'))
    gap_s = decode_s / max(1, chunks - 1)  # the tokens after the first, spread over the decode
    last_chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    lat, lags, outcomes, picks, starts = [], [], {}, {}, []
    # one HTTP/2 connection per channel (a distinct arg keeps gRPC from sharing the subchannel); Envoy too
    # opens one per worker thread. Streams go round-robin over them.
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}", options=[("tokenmill.bench.channel", k)])
                for k in range(n_channels)]
    stubs = [pb_grpc.ExternalProcessorStub(c) for c in channels]

    async def one(i: int, due: float):
        body = json.dumps({"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32,
                           "stream": True}).encode()
        lags.append(time.perf_counter() - due)
        call = stubs[i % n_channels].Process()
        t = time.perf_counter()
        await call.write(headers)
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        first = await call.read()
        lat.append(time.perf_counter() - t)
        starts.append(t - start)
        if first.HasField("immediate_response"):
            code = first.immediate_response.status.code
            outcomes[code] = outcomes.get(code, 0) + 1
            call.cancel()
            return
        ep = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
        picks[ep] = picks.get(ep, 0) + 1
        outcomes[200] = outcomes.get(200, 0) + 1
        await call.read()  # the body, passed back
        await asyncio.sleep(ttft_s)
        for msg in (resp_headers, first_chunk) if response_body else (resp_headers,):
            await call.write(msg)
            await call.read()
        if not response_body:
            await asyncio.sleep(decode_s)
        else:
            for _ in range(chunks - 2):  # one SSE event per token, as a streaming worker sends them
                await asyncio.sleep(gap_s)
                await call.write(first_chunk)
                await call.read()
            await asyncio.sleep(gap_s)
            await call.write(last_chunk)
            await call.read()
        await call.done_writing()  # the HTTP stream ended: Envoy closes the ext_proc stream

    n = int(rate * duration_s)
    # the client's own collector off while it measures: a full collection here (~10 ms over grpc/protobuf's
    # heap) would stall every stream in flight and be charged to the picker
    gc.collect()
    gc.disable()
    cpu0 = time.process_time()
    start = time.perf_counter() + 0.2
    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gc.enable()
    for e in results:  # a stream the server ended with an error: counted as an answer of its own, not a crash
        if isinstance(e, grpc.aio.AioRpcError):
            key = f"gRPC {e.code().name}"
            outcomes[key] = outcomes.get(key, 0) + 1
        elif isinstance(e, BaseException):
            raise e
    for c in channels:
        await c.close()
    return {"lat": lat, "lags": lags, "outcomes": outcomes, "picks": picks, "wall_s": time.perf_counter() - start,
            "client_cpu_s": time.process_time() - cpu0, "starts": starts}


async def drive_raw(epp_port: int, rate: float, duration_s: float, ttft_s: float, decode_s: float, seed: int,
                    response_body: bool = True, n_channels: int = 1, chunks: int = 2) -> dict:
    """`drive` with the raw HTTP/2 client (grpc_raw_client.py): the same streams, messages, schedule and
    measurement points, every request message serialized once (but the body, per request), answers parsed only
    as far as the first one (the pick or the ImmediateResponse)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpc_raw_client import CallError, RawGrpcConnection

    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    rng = random.Random(seed)
    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
            ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode,
            response_body_mode=mode if response_body else processing_mode_pb2.ProcessingMode.NONE)).SerializeToString()
    resp_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")]))).SerializeToString()
    first_chunk = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=b'data: {"choices":[{"text":"x"}]}\n\n')).SerializeToString()
    gap_s = decode_s / max(1, chunks - 1)
    last_chunk = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)).SerializeToString()
    lat, lags, outcomes, picks, starts, task_lat, send_lags, due_lat = [], [], {}, {}, [], [], [], []
    conns = [await RawGrpcConnection.connect("127.0.0.1", epp_port, "/envoy.service.ext_proc.v3.ExternalProcessor/Process")
             for _ in range(n_channels)]

    async def one(i: int, due: float):
        body = json.dumps({"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32,
                           "stream": True}).encode()
        body_msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()
        lags.append(time.perf_counter() - due)
        t = time.perf_counter()
        call = conns[i % n_channels].open()
        call.write(headers)
        call.write(body_msg)
        first = pb.ProcessingResponse.FromString(await call.read())
        task_lat.append(time.perf_counter() - t)
        # the round trip on the wire as this client sees it: its HEADERS frame written to the socket -> the
        # answer parsed off the socket (data_received), so this task's own wake-up is not in it; how late the
        # write was against the schedule is `send_lags`
        lat.append(call.first_at - call.sent_at)
        send_lags.append(call.sent_at - due)
        due_lat.append(call.first_at - due)
        starts.append(t - start)
        if first.HasField("immediate_response"):
            code = first.immediate_response.status.code
            outcomes[code] = outcomes.get(code, 0) + 1
            call.cancel()
            return
        ep = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
        picks[ep] = picks.get(ep, 0) + 1
        outcomes[200] = outcomes.get(200, 0) + 1
        await call.read()  # the body, passed back
        await asyncio.sleep(ttft_s)
        for msg in (resp_headers, first_chunk) if response_body else (resp_headers,):
            call.write(msg)
            await call.read()
        if not response_body:
            await asyncio.sleep(decode_s)
        else:
            for _ in range(chunks - 2):
                await asyncio.sleep(gap_s)
                call.write(first_chunk)
                await call.read()
            await asyncio.sleep(gap_s)
            call.write(last_chunk)
            await call.read()
        call.done_writing()
        if await call.read() is not None:  # the server's trailers (grpc-status 0) end the call
            raise CallError("a message after the end of the exchange")

    n = int(rate * duration_s)
    gc.collect()
    gc.disable()
    cpu0 = time.process_time()
    start = time.perf_counter() + 0.2
    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gc.enable()
    for e in results:
        if isinstance(e, CallError):
            key = f"error {str(e)[:40]}"
            outcomes[key] = outcomes.get(key, 0) + 1
        elif isinstance(e, BaseException):
            raise e
    for c in conns:
        c.close()
    return {"lat": lat, "lags": lags, "outcomes": outcomes, "picks": picks, "wall_s": time.perf_counter() - start,
            "client_cpu_s": time.process_time() - cpu0, "starts": starts, "task_lat": task_lat,
            "send_lags": send_lags, "due_lat": due_lat}


LOADGEN_SRC = Path(__file__).resolve().parent / "epp_loadgen.cpp"


def build_loadgen() -> Path:
    """epp_loadgen.cpp compiled once per source version (g++ -O2; $CXX if set, as torch's cpp_extension picks
    its compiler) into ~/.cache/tokenmill/."""
    import hashlib

    src = LOADGEN_SRC.read_bytes()
    out = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / \
        f"epp_loadgen-{hashlib.sha256(src).hexdigest()[:16]}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cxx = os.environ.get("CXX", "g++")
        try:
            subprocess.run([cxx, "-O2", "-std=c++17", "-o", str(tmp), str(LOADGEN_SRC)], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"--client cpp needs a C++17 compiler ({cxx}): {e}") from None
        tmp.replace(out)
    return out


def drive_cpp(epp_port: int, rate: float, duration_s: float, ttft_s: float, decode_s: float, seed: int,
              response_body: bool = True, n_channels: int = 1, chunks: int = 2, schedule: str = "poisson") -> dict:
    """The same streams and messages as `drive_raw`, sent by epp_loadgen.cpp (epoll, pre-encoded frames, an
    open-loop Poisson or even schedule fixed in advance). Its latency is from each request's *intended* send
    time (the schedule) to the read(2) that carried the answer: the client's own lateness is in it, not hidden;
    `send_lags` (due -> the HEADERS written) and `wire` (written -> answer read) split it."""
    import tempfile

    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    rng = random.Random(seed)
    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    n = int(rate * duration_s)
    msgs = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
                ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
            protocol_config=pb.ProtocolConfiguration(
                request_body_mode=mode,
                response_body_mode=mode if response_body else processing_mode_pb2.ProcessingMode.NONE)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200")]))),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"choices":[{"text":"x"}]}\n\n')),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
    msgs += [pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(
        {"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32, "stream": True}).encode(),
        end_of_stream=True)) for i in range(n)]
    exe = build_loadgen()
    with tempfile.TemporaryDirectory() as d:
        inp, outp = Path(d, "in.bin"), Path(d, "out.csv")
        with open(inp, "wb") as f:
            f.write(len(msgs).to_bytes(4, "little"))
            for m in msgs:
                b = m.SerializeToString()
                f.write(len(b).to_bytes(4, "little") + b)
        proc = subprocess.run([str(exe), "127.0.0.1", str(epp_port), repr(rate), str(n), str(seed),
                               repr(ttft_s * 1e6), repr(decode_s * 1e6), "full" if response_body else "resp-headers",
                               str(chunks), str(n_channels), schedule, str(inp), str(outp)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"epp_loadgen failed: {proc.stderr.strip()}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        rows = [line.split(",") for line in outp.read_text().splitlines()]
    errors = {-1: "RST_STREAM", -2: "ended early", -3: "no endpoint", -4: "GOAWAY", -5: "timeout"}
    lat, wire, send_lags, outcomes, picks, starts, records = [], [], [], {}, {}, [], []
    start_ns = summary["start_ns"]
    for _, conn, sid, due, sent, first, end, outcome, endpoint in rows:
        due, sent, first, outcome = int(due), int(sent), int(first), int(outcome)
        key = errors.get(outcome, outcome)
        outcomes[key] = outcomes.get(key, 0) + 1
        if outcome > 0 or first:  # an answer came (a pick, a 429 / 503 ...): timed
            lat.append((first - due) / 1e9)
            wire.append((first - sent) / 1e9)
            send_lags.append((sent - due) / 1e9)
            starts.append((due - start_ns) / 1e9)
            records.append((int(conn), int(sid), due, sent, first))
        if outcome == 200:
            picks[endpoint] = picks.get(endpoint, 0) + 1
    return {"lat": lat, "lags": send_lags, "outcomes": outcomes, "picks": picks, "wall_s": summary["wall_s"],
            "client_cpu_s": summary["cpu_s"], "starts": starts, "wire": wire, "send_lags": send_lags,
            "records": records}


async def sequential_picks(epp_port: int, n: int, client: str) -> list[str]:
    """n requests one after another (each finished before the next), the endpoint picked for each: the same
    traffic through either client must give the same picks from a fresh picker."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    out = []
    if client == "raw":
        from grpc_raw_client import RawGrpcConnection

        conn = await RawGrpcConnection.connect("127.0.0.1", epp_port, "/envoy.service.ext_proc.v3.ExternalProcessor/Process")
    else:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}")
        stub = pb_grpc.ExternalProcessorStub(channel)
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
        ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=4, response_body_mode=4))  # FULL_DUPLEX_STREAMED
    open_calls = []
    for i in range(n):  # every stream kept open (its load stays on its endpoint) until all are picked
        body = pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(
            {"prompt": systems[(i * 5) % 8] + f"q{i}", "max_tokens": 8 + i % 50, "stream": True}).encode(),
            end_of_stream=True))
        if client == "raw":
            call = conn.open()
            call.write(headers.SerializeToString())
            call.write(body.SerializeToString())
            first = pb.ProcessingResponse.FromString(await call.read())
            if first.HasField("dynamic_metadata"):
                await call.read()
        else:
            call = stub.Process()
            await call.write(headers)
            await call.write(body)
            first = await call.read()
            if first.HasField("dynamic_metadata"):
                await call.read()
        open_calls.append(call)
        out.append(first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value if first.HasField("dynamic_metadata") else
            f"status {first.immediate_response.status.code}")
    for call in open_calls:
        if client == "raw":
            call.done_writing()
            assert await call.read() is None
        else:
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
    if client == "raw":
        conn.close()
    else:
        await channel.close()
    return out


def scrape(url: str) -> dict:
    """The picker's own numbers: its decision histogram (body complete -> answer, in-process; cumulative
    buckets) and its garbage-collector pauses (count and seconds, all generations)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {"decision": {}, "gc_n": 0.0, "gc_s": 0.0, "gc_long": 0.0, "held": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name == "tokenmill_router_epp_decision_seconds":
            out["decision"] = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
        if fam.name == "tokenmill_router_epp_e2e_seconds":  # headers read -> answer written (server side)
            out["e2e"] = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
        if fam.name == "tokenmill_router_queue_wait_seconds":  # requests admission held in a class queue
            out["held"] = sum(s.value for s in fam.samples if s.name.endswith("_count"))
        if fam.name == "tokenmill_router_gc_pause_seconds":
            out["gc_gen"] = {(s.labels["generation"], s.name.rsplit("_", 1)[1]): s.value for s in fam.samples
                             if s.name.endswith(("_count", "_sum"))}
            out["gc_n"] = sum(s.value for s in fam.samples if s.name.endswith("_count"))
            out["gc_s"] = sum(s.value for s in fam.samples if s.name.endswith("_sum"))
            out["gc_long"] = sum(s.value for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf") \
                - sum(s.value for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] == "0.005")
    return out


def gc_by_generation(before: dict, after: dict) -> str:
    """'g0 n/ms, g1 n/ms, g2 n/ms': the run's collections per generation, their count and total pause."""
    a, b = after.get("gc_gen", {}), before.get("gc_gen", {})
    parts = []
    for gen in sorted({g for g, _ in a}):
        n = a.get((gen, "count"), 0) - b.get((gen, "count"), 0)
        ms = (a.get((gen, "sum"), 0) - b.get((gen, "sum"), 0)) * 1e3
        parts.append(f"g{gen} {n:.0f}/{ms:.1f}")
    return ", ".join(parts)


def e2e_quantiles(before: dict, after: dict) -> tuple[float, float, float]:
    """The picker's own e2e histogram over the run: (p50 ms, p99 ms, share <= 2 ms); the quantiles
    interpolated linearly inside their bucket, as Prometheus' histogram_quantile does."""
    b = sorted((le, v - before.get("e2e", {}).get(le, 0.0)) for le, v in after["e2e"].items())
    total = b[-1][1] or 1.0

    def q(x: float) -> float:
        lo_le, lo_n = 0.0, 0.0
        for le, n in b:
            if n >= x * total:
                if le == float("inf"):
                    return lo_le * 1e3
                return (lo_le + (le - lo_le) * (x * total - lo_n) / max(n - lo_n, 1e-9)) * 1e3
            lo_le, lo_n = le, n
        return float("nan")

    return q(0.5), q(0.99), dict(b)[0.002] / total


def client_loop(kind: str):
    """asyncio.run on the client's loop of choice (the gateway's stand-in; Envoy's own client is C++)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def shares(before: dict, after: dict) -> dict[float, float]:
    """Share of the run's decisions <= each bound."""
    b = {le: v - before["decision"].get(le, 0.0) for le, v in after["decision"].items()}
    total = b[float("inf")] or 1.0
    return {le: v / total for le, v in b.items()}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def router_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of a process (all threads), or of one of its threads (tid: the main thread is tid = pid)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pid(pid: int) -> int:
    """The process py-spy started (its only child)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise RuntimeError("py-spy started no process")


def in_process(n: int, workers: int, modes: list[str]) -> None:
    """The picker's own Python per request, without gRPC: the same messages fed to epp._Exchange.handle in
    this process (~165 streams open, as at 500/s), CPU time per request and per pick."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tokenmill.router.admission import AdmissionConfig
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.epp import EppMetrics, _Exchange
    from tokenmill.router.router import Router
    from tokenmill.router.worker_state import WorkerSpec

    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
            ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    tail = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":status", raw_value=b"200")]))),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"choices":[{"text":"x"}]}\n\n')),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
    rng = random.Random(0)
    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    bodies = [pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(
        {"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32, "stream": True}).encode(),
        end_of_stream=True)) for i in range(n)]
    print("| admission | CPU ms/request (all 6 messages) | CPU ms/pick (request body -> answer) |")
    print("|---|---|---|")
    for name in modes:
        async def run() -> tuple[float, float]:
            cfg = RouterConfig(workers=tuple(WorkerSpec(f"http://127.0.0.1:{9000 + k}") for k in range(workers)),
                               admission=AdmissionConfig(mode=name))
            router = Router(cfg)
            for w in router.pool:
                w.healthy = True
            metrics, live, pick_s = EppMetrics(router.metrics.registry), [], 0.0
            t0 = time.process_time()
            for i in range(n):
                ex = _Exchange(router, metrics)
                await ex.handle(headers)
                t = time.process_time()
                await ex.handle(bodies[i])
                pick_s += time.process_time() - t
                live.append(ex)
                if len(live) > 165:
                    old = live.pop(0)
                    for msg in tail:
                        await old.handle(msg)
                    old.close()
            return (time.process_time() - t0) / n, pick_s / n

        per_request, per_pick = asyncio.run(run())
        print(f"| {name} | {per_request * 1e3:.3f} | {per_pick * 1e3:.3f} |")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


TCP_COUNTERS = ("TCPToZeroWindowAdv", "TCPLossProbes", "TCPTimeouts")


def tcp_counters() -> dict[str, int]:
    """The machine's TCP stall counters (/proc/net/netstat, all sockets): a receiver advertising a zero window
    (it did not read), tail-loss probes and retransmission timeouts (a segment re-sent after >= 200 ms)."""
    lines = open("/proc/net/netstat").read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            d = dict(zip(names.split()[1:], map(int, values.split()[1:])))
            return {k: d.get(k, 0) for k in TCP_COUNTERS}
    return dict.fromkeys(TCP_COUNTERS, 0)


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto `cpus` (sched_setaffinity(pid) moves one thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def transport_of(server: str) -> str:
    """The --epp-transport of a picker row: picker-frames* (our own HTTP/2 framing), *-h2* (the h2 library),
    else grpcio."""
    if server.startswith(("picker-frames", "baseline-frames")):
        return "frames"
    return "h2" if server.startswith(("picker-h2", "baseline-h2")) else "grpcio"


def run_one(server: str, mode: str, ports: list[int], args, stubs_pid: int, pattern: str = "full",
            placement: str = "shared", client: str = "grpc") -> tuple:
    """One row: start the server (the picker CLI, or an echo floor), drive it, stop it. `placement` pinned:
    the server alone on core 1 (a picker pod with a CPU of its own), this client and the stub workers on core 0
    (the gateway elsewhere); shared: every process on every core."""
    hport, eport = free_port(), free_port()
    env = ENV
    if server.startswith("baseline"):  # the same picker from another checkout (before / after in one run)
        env = {**ENV, "PYTHONPATH": args.baseline_src}
    copies = 1
    hops_file = None
    if server in PICKERS:
        cmd = [PY, "-m", "tokenmill", "route", "--port", str(hport), "--epp-port", str(eport),
               "--admission", mode, "--log-level", "warning"]
        if server != "baseline":  # (the baseline predates --event-loop: asyncio, and --epp-transport: grpcio)
            cmd += ["--event-loop", "uvloop" if server.endswith("-uvloop") else "asyncio",
                    "--epp-transport", transport_of(server)]
        if args.hops and client == "cpp" and transport_of(server) == "frames" and not server.startswith("baseline"):
            hops_file = Path(tempfile.mkdtemp(prefix="epp-hops-"), "server.csv")
            cmd += ["--epp-trace", str(hops_file)]
        for p in ports:
            cmd += ["--worker", f"tokenmill=http://127.0.0.1:{p}"]
    else:
        kind = server.split("-", 1)[1]
        if kind.endswith("-x2"):  # two processes on one port (SO_REUSEPORT, gRPC's default): one per core
            kind, copies = kind[:-3], 2
        cmd = [PY, __file__, "--echo-server", f"{kind}:{eport}", "--stub-workers", ",".join(map(str, ports))]
    if args.py_spy:  # profile the server process (py-spy installed beside, not a dependency)
        out = Path(args.py_spy) / f"{server}-{mode}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["py-spy", "record", "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(out), "--"] + cmd
    # cwd: `python -m` puts it first on sys.path, before PYTHONPATH (the baseline must not import this checkout)
    cwd = args.baseline_src if server.startswith("baseline") else None
    everything = set(range(os.cpu_count()))
    if placement == "pinned":
        cmd = ["taskset", "-c", "1"] + cmd
        for pid in (os.getpid(), stubs_pid):
            set_affinity(pid, {0})
    else:
        for pid in (os.getpid(), stubs_pid):
            set_affinity(pid, everything)
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL) for _ in range(copies)]
    try:
        if server in PICKERS:
            wait_http(f"http://127.0.0.1:{hport}/health")
        wait_grpc(eport)
        time.sleep(1.0 if copies > 1 else 0.0)  # the second copy listening too
        pids = [p.pid if not args.py_spy else child_pid(p.pid) for p in procs]
        cpu0 = sum(router_cpu_s(pid) for pid in pids)
        loop0 = router_cpu_s(pids[0], pids[0])  # the main thread: the asyncio loop, every handler and decision
        busy0, stubs0, client0, wall0 = machine_busy_s(), router_cpu_s(stubs_pid), time.process_time(), time.perf_counter()
        tcp0 = tcp_counters()
        m0 = scrape(f"http://127.0.0.1:{hport}/metrics") if server in PICKERS else None
        if client == "cpp":
            r = drive_cpp(eport, args.rate, args.duration, args.ttft_ms / 1e3, args.decode_ms / 1e3, args.seed,
                          pattern == "full", args.channels, args.chunks, args.schedule)
        else:
            r = client_loop(args.client_loop)((drive_raw if client == "raw" else drive)(
                eport, args.rate, args.duration, args.ttft_ms / 1e3, args.decode_ms / 1e3, 0, pattern == "full",
                args.channels, args.chunks))
        cpu = sum(router_cpu_s(pid) for pid in pids) - cpu0
        loop_busy = (router_cpu_s(pids[0], pids[0]) - loop0) / (time.perf_counter() - wall0) * len(pids)
        tcp = "/".join(str(v - tcp0[k]) for k, v in tcp_counters().items())
        # what the rest of the machine ran meanwhile (other sessions): a row with a busy neighbour is not clean
        others = (machine_busy_s() - busy0 - cpu - (router_cpu_s(stubs_pid) - stubs0)
                  - (time.process_time() - client0)) / (time.perf_counter() - wall0)
        m1 = scrape(f"http://127.0.0.1:{hport}/metrics") if server in PICKERS else None
    finally:
        for p, pid in zip(procs, pids if "pids" in locals() else [p.pid for p in procs]):
            os.kill(pid, signal.SIGTERM)  # (under py-spy: it writes its profile when its target exits)
        for p in procs:
            try:
                p.wait(40)  # its drain: in-flight streams get up to 30 s
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    lat = [x * 1e3 for x in r["lat"]]
    if hops_file is not None:
        HOPS.append((f"{server} ({mode}), {args.rate:g}/s", hops(r["records"], hops_file)))
    if args.trace:  # (start s, latency ms) of every request, to see whether the tail is one stall or spread
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        Path(args.trace, f"{time.strftime('%H%M%S')}-{server}-{mode}.json").write_text(json.dumps(
            {"starts": r["starts"], "lat_ms": lat, "held": m1["held"] - m0["held"] if m0 else None}))
    label = f"{server} (admission {mode})" if server in PICKERS else server
    label = f"{placement}, {pattern}, {client} client, {label}"
    if "wire" in r:  # the C++ client: (send lag p99, wire p99, wire p99.9), the main columns from the schedule
        split = (pct(r["send_lags"], 0.99) * 1e3, pct(r["wire"], 0.99) * 1e3, pct(r["wire"], 0.999) * 1e3)
    elif "due_lat" in r:  # the raw Python client: (send lag p99, from the schedule p99), the main columns on the wire
        split = (pct(r["send_lags"], 0.99) * 1e3, pct(r["due_lat"], 0.99) * 1e3, None)
    else:
        split = None
    return (label, len(lat) / r["wall_s"], statistics.median(lat), pct(lat, 0.9), pct(lat, 0.99), pct(lat, 0.999),
            max(lat),
            pct(r["lags"], 0.99) * 1e3, cpu / len(lat) * 1e3, r["client_cpu_s"] / len(lat) * 1e3, r["outcomes"],
            len(r["picks"]), shares(m0, m1) if m0 else None,
            (m1["gc_n"] - m0["gc_n"], (m1["gc_s"] - m0["gc_s"]) * 1e3, m1["gc_long"] - m0["gc_long"],
             gc_by_generation(m0, m1)) if m0 else None,
            m1["held"] - m0["held"] if m0 else None, others, tcp, loop_busy,
            e2e_quantiles(m0, m1) if m0 and "e2e" in m1 else None, split)


HOPS: list[tuple[str, dict]] = []
HOP_NAMES = ("client lag (due -> HEADERS written)", "to the picker (written -> its socket read)",
             "read -> decision start (framing, protobuf, exchange)", "decision (pick, admission, bookkeeping)",
             "decision end -> answer written (serialize, frame, write)", "back (written -> client's read)",
             "total (due -> answer read)")


def hops(records: list[tuple], server_csv: Path) -> dict:
    """Join the C++ client's stamps (port, sid, due, sent, first) with the picker's (--epp-trace) on one clock:
    per hop the p50 / p99 over all requests and the mean over the slowest 1% (by total)."""
    by_key = {}
    for line in server_csv.read_text().splitlines()[1:]:
        port, sid, read, arrived, d0, d1, written = map(int, line.split(","))
        by_key[port, sid] = (read, d0, d1 or d0, written)
    rows = []
    for port, sid, due, sent, first in records:
        srv = by_key.get((port, sid))
        if srv is None:
            continue
        read, d0, d1, written = srv
        rows.append(tuple(x / 1e6 for x in (sent - due, read - sent, d0 - read, d1 - d0, written - d1, first - written,
                                             first - due)))
    server_csv.unlink()
    server_csv.parent.rmdir()
    if not rows:
        return {"n": 0}
    slow = sorted(rows, key=lambda x: x[-1])[-max(1, len(rows) // 100):]
    return {"n": len(rows), "of": len(records),
            "p50": [pct([x[k] for x in rows], 0.5) for k in range(len(HOP_NAMES))],
            "p99": [pct([x[k] for x in rows], 0.99) for k in range(len(HOP_NAMES))],
            "slow": [statistics.fmean(x[k] for x in slow) for k in range(len(HOP_NAMES))]}


def print_hops() -> None:
    for label, h in HOPS:
        if not h["n"]:
            print(f"# hops, {label}: no request matched the picker's trace")
            continue
        print(f"\n# hops, {label}: {h['n']} of {h['of']} requests matched (CLOCK_MONOTONIC on both sides)")
        print("| hop | p50 ms | p99 ms | mean over the slowest 1% ms |")
        print("|---|---|---|---|")
        for k, name in enumerate(HOP_NAMES):
            print(f"| {name} | {h['p50'][k]:.3f} | {h['p99'][k]:.3f} | {h['slow'][k]:.3f} |")


def verify_client(n: int, ports: list[int], args) -> int:
    """The same n sequential requests through each client to a fresh picker (admission off, asyncio): the raw
    client must see the picks the grpc client sees."""
    stubs = subprocess.Popen([PY, __file__, "--stub-workers", ",".join(map(str, ports))], env=ENV)
    seen = {}
    try:
        wait_http(f"http://127.0.0.1:{ports[0]}/health")
        for transport in ("grpcio", "h2", "frames"):
            for client in ("grpc", "raw"):
                hport, eport = free_port(), free_port()
                cmd = [PY, "-m", "tokenmill", "route", "--port", str(hport), "--epp-port", str(eport), "--admission",
                       "off", "--log-level", "warning", "--event-loop", "asyncio", "--epp-transport", transport]
                for p in ports:
                    cmd += ["--worker", f"tokenmill=http://127.0.0.1:{p}"]
                proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL)
                try:
                    wait_http(f"http://127.0.0.1:{hport}/health")
                    wait_grpc(eport)
                    seen[transport, client] = asyncio.run(sequential_picks(eport, n, client))
                finally:
                    proc.terminate()
                    proc.wait(40)
    finally:
        stubs.terminate()
        stubs.wait(10)
    ref = seen["grpcio", "grpc"]
    ok = True
    for key, picks in seen.items():
        same = sum(a == b for a, b in zip(ref, picks))
        ok &= same == n
        print(f"# verify: picker on {key[0]}, {key[1]} client: {n} sequential requests (streams kept open), "
              f"{len(set(picks))} endpoints used; picks equal to grpcio picker + grpc client: {same}/{n}")
    return 0 if ok else 1


def default_server() -> str:
    """The picker `tokenmill route --epp-port` runs with its defaults: --epp-transport frames on --event-loop auto
    (uvloop when it is installed)."""
    return "picker-frames-uvloop" if importlib.util.find_spec("uvloop") is not None else "picker-frames"


def default_client() -> str:
    """The C++ client (a gateway's cost per request, latency from the intended send time) when it can be built;
    else grpc.aio, whose own CPU per request on a shared 2-core box is ~3x the picker's."""
    return "cpp" if shutil.which("g++") else "grpc"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="decisions per second offered (open loop)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per mode")
    ap.add_argument("--workers", type=int, default=8, help="stub worker endpoints in the pool")
    ap.add_argument("--admission", action="append", help="modes to run, in order (default: off, leading)")
    ap.add_argument("--no-response-body", action="store_true", help="same as --pattern resp-headers")
    ap.add_argument("--pattern", action="append", choices=PATTERNS, help="ext_proc message patterns to run, in "
                    "order (default full): full = response headers and every response body chunk too; "
                    "resp-headers = response_body_mode NONE (request headers + body, response headers)")
    ap.add_argument("--chunks", type=int, default=2, help="response body chunks per request in the full pattern "
                    "(SSE events: one per token as a worker streams them; default %(default)s: first token + [DONE])")
    ap.add_argument("--placement", action="append", choices=PLACEMENTS, help="CPU placements to run, in order "
                    "(default shared): pinned = server alone on core 1, client and stub workers on core 0")
    ap.add_argument("--client-loop", default="asyncio", choices=("asyncio", "uvloop"), help="the client's event "
                    "loop (default %(default)s)")
    ap.add_argument("--client", action="append", choices=CLIENTS, help="load clients to run, in order (default "
                    "cpp when g++ is installed, else grpc): grpc = grpc.aio (what the tests use), raw = raw HTTP/2 frames (grpc_raw_client.py, needs h2), "
                    "cpp = epp_loadgen.cpp (built with g++ at run time; latency from the intended send time)")
    ap.add_argument("--verify-client", type=int, metavar="N", help="check the raw client against the grpc one: N "
                    "requests one after another to a fresh picker through each; the picks must be the same")
    ap.add_argument("--schedule", default="poisson", choices=("poisson", "uniform"), help="arrivals of the cpp "
                    "client (the Python clients send evenly spaced): poisson (default) or uniform")
    ap.add_argument("--seed", type=int, default=0, help="the cpp client's schedule and prompts")
    ap.add_argument("--channels", type=int, default=1, help="gRPC connections the client spreads streams over")
    ap.add_argument("--ttft-ms", type=float, default=30.0)
    ap.add_argument("--decode-ms", type=float, default=300.0)
    ap.add_argument("--server", action="append", choices=SERVERS, help="servers to run, in order (default: "
                    "what `tokenmill route --epp-port` runs by default: picker-frames-uvloop, or picker-frames without "
                    "uvloop); picker = the grpcio transport; baseline: the picker from --baseline-src; echo-aio / echo-sync: the gRPC floor, the same "
                    "messages with no picking")
    ap.add_argument("--baseline-src", metavar="DIR", help="PYTHONPATH of the `baseline` picker (e.g. `git archive "
                    "<commit> tokenmill | tar -x -C DIR`)")
    ap.add_argument("--py-spy", metavar="DIR", help="profile each server with py-spy (installed separately) into "
                    "DIR/<server>-<mode>.txt (collapsed stacks); its sampling costs CPU, so not a latency run")
    ap.add_argument("--pin", action="store_true", help="same as --placement pinned")
    ap.add_argument("--in-process", type=int, metavar="N", help="no gRPC: feed N requests' messages to the "
                    "picker's handler in this process and print its own CPU per request")
    ap.add_argument("--hops", action="store_true", help="with --client cpp, for picker-frames rows: the picker "
                    "stamps each stream (--epp-trace) and a table splits the round trip into hops on one clock")
    ap.add_argument("--trace", metavar="DIR", help="write each row's (start, latency) per request to DIR")
    ap.add_argument("--stub-workers", help=argparse.SUPPRESS)
    ap.add_argument("--echo-server", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_server:
        kind, port = args.echo_server.split(":")
        echo_server(kind, int(port), [f"127.0.0.1:{p}" for p in args.stub_workers.split(",")])
        return 0
    if args.in_process:
        from tokenmill.hardware import capabilities

        print(f"# CPU: {capabilities().summary()}", flush=True)
        in_process(args.in_process, args.workers, args.admission or ["off", "leading"])
        return 0
    if any(s.startswith("baseline") for s in args.server or ()) and not args.baseline_src:
        ap.error("--server baseline needs --baseline-src DIR")
    if args.stub_workers:
        stub_workers([int(p) for p in args.stub_workers.split(",")])
        return 0
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    patterns = args.pattern or (["resp-headers"] if args.no_response_body else ["full"])
    placements = args.placement or (["pinned"] if args.pin else ["shared"])
    if "pinned" in placements and not {0, 1} <= os.sched_getaffinity(0):
        ap.error("--placement pinned needs cores 0 and 1")
    print(f"# {args.rate:g} decisions/s offered for {args.duration:g} s per row, {args.workers} endpoints, "
          f"simulated TTFT {args.ttft_ms:g} ms + decode {args.decode_ms:g} ms ({args.chunks} response chunks in "
          f"the full pattern), {os.cpu_count()} cores, {args.channels} client connection(s), client loop "
          f"{args.client_loop}", flush=True)
    ports = [free_port() for _ in range(args.workers)]
    if args.verify_client:
        return verify_client(args.verify_client, ports, args)
    stubs = subprocess.Popen([PY, __file__, "--stub-workers", ",".join(map(str, ports))], env=ENV)
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{ports[0]}/health")
        for placement in placements:
            for pattern in patterns:
                for server in args.server or [default_server()]:
                    for mode in (args.admission or ["off", "leading"]) if server in PICKERS else ["-"]:
                        for client in args.client or [default_client()]:
                            rows.append(run_one(server, mode, ports, args, stubs.pid, pattern, placement, client))
                            print("# row:", rows[-1][:10], rows[-1][10], rows[-1][-1], flush=True)
    finally:
        stubs.terminate()
        stubs.wait(10)
    print("| placement, pattern, server | decisions/s done | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms "
          "| picker e2e p50 / p99 ms (<= 2 ms) | client lag p99 ms | send lag p99 / cpp: wire p99 / p99.9, raw: from schedule p99 ms "
          "| server CPU ms/request | server loop thread busy | client CPU ms/request | in-picker <= 0.5 / 1 / 2 ms "
          "| picker GC pauses (total ms; long) | held | other load (cores) | TCP zero-window / loss probe / RTO "
          "| answers | endpoints used |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (label, done, p50, p90, p99, p999, mx, lag, cpu, ccpu, outcomes, used, inside, gcs, held, others, tcp, loop,
         e2e, split) in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items(), key=str))
        shares = " / ".join(f"{100 * inside[le]:.1f}%" for le in (0.0005, 0.001, 0.002)) if inside else "-"
        gcs_text = "-" if gcs is None or gcs[:3] == (0, 0, 0) and "baseline" in label else \
            f"{gcs[0]:.0f} ({gcs[1]:.1f}; {gcs[2]:.0f} > 5 ms; {gcs[3]})"
        e2e_text = "-" if e2e is None else f"{e2e[0]:.2f} / {e2e[1]:.2f} ({100 * e2e[2]:.1f}%)"
        split_text = "-" if split is None else " / ".join(f"{x:.2f}" for x in split if x is not None)
        print(f"| {label} | {done:.0f} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {p999:.2f} | {mx:.2f} | {e2e_text} "
              f"| {lag:.2f} | {split_text} | {cpu:.3f} | {100 * loop:.0f}% | {ccpu:.3f} | {shares} | {gcs_text} "
              f"| {'-' if held is None else f'{held:.0f}'} | {others:.2f} | {tcp} | {answers} | {used} |")
    print_hops()
    return 0


if __name__ == "__main__":
    sys.exit(main())
