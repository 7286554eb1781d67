"""Endpoint Picker decision latency: `tokenmill route --epp-port` under an open-loop 500 decisions/s.

    python benchmarks/epp_latency.py                             # 500/s for 10 s, admission off then leading
    python benchmarks/epp_latency.py --rate 1000 --duration 20 --workers 16
    python benchmarks/epp_latency.py --no-response-body         # the gateway streams no response body to it

Three processes: stub workers (one aiohttp process answering /health, /metrics and /v1/models on
`--workers` ports: the picker probes them but never sends them requests), the real `tokenmill route
--epp-port` CLI, and this script playing Envoy's ext_proc filter (grpc.aio, FULL_DUPLEX_STREAMED): for
each request, on a fixed schedule (open loop: a late picker does not slow the offered rate), one gRPC
stream sends the request headers and the body (a completion prompt: one of 8 shared 1,600-character
system prompts + a unique question), then waits for the picker's answer. The decision latency is the time
from writing the headers to reading the answer (the headers response naming the endpoint, or an
ImmediateResponse), measured here, so it includes gRPC transport both ways. The stream then plays the
upstream: response headers after a simulated TTFT (30 ms), a first SSE chunk, and the end of the body
after a simulated decode (300 ms), so the picker's load view sees the traffic it routed.

`lag` is how late this client started requests against its schedule: when it is large the client, not
the picker, was the bottleneck and the row is not a measurement of the picker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import wait_http  # noqa: E402

PY = sys.executable
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




async def drive(epp_port: int, rate: float, duration_s: float, ttft_s: float, decode_s: float, seed: int,
                response_body: bool = True) -> dict:
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
    last_chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    lat, lags, outcomes, picks = [], [], {}, {}
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}")
    stub = pb_grpc.ExternalProcessorStub(channel)

    async def one(i: int, due: float):
        body = json.dumps({"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32,
                           "stream": True}).encode()
        lags.append(time.perf_counter() - due)
        call = stub.Process()
        t = time.perf_counter()
        await call.write(headers)
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        first = await call.read()
        lat.append(time.perf_counter() - t)
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
        await asyncio.sleep(decode_s)
        if response_body:
            await call.write(last_chunk)
            await call.read()
        await call.done_writing()  # the HTTP stream ended: Envoy closes the ext_proc stream

    n = int(rate * duration_s)
    start = time.perf_counter() + 0.2
    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks, return_exceptions=False)
    await channel.close()
    return {"lat": lat, "lags": lags, "outcomes": outcomes, "picks": picks, "wall_s": time.perf_counter() - start}


def decision_buckets(url: str) -> dict[float, float]:
    """The picker's own histogram (body complete -> answer, in-process): share of decisions <= each bound."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "tokenmill_router_epp_decision_seconds")
    b = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    total = b[float("inf")] or 1.0
    return {le: v / total for le, v in b.items()}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def router_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="decisions per second offered (open loop)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per mode")
    ap.add_argument("--workers", type=int, default=8, help="stub worker endpoints in the pool")
    ap.add_argument("--admission", action="append", help="modes to run, in order (default: off, leading)")
    ap.add_argument("--no-response-body", action="store_true", help="the gateway sends the picker response "
                    "headers only (response_body_mode NONE): 4 ext_proc messages per request instead of 8")
    ap.add_argument("--ttft-ms", type=float, default=30.0)
    ap.add_argument("--decode-ms", type=float, default=300.0)
    ap.add_argument("--stub-workers", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stub_workers:
        stub_workers([int(p) for p in args.stub_workers.split(",")])
        return 0
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    print(f"# {args.rate:g} decisions/s offered for {args.duration:g} s per mode, {args.workers} endpoints, "
          f"simulated TTFT {args.ttft_ms:g} ms + decode {args.decode_ms:g} ms", flush=True)
    ports = [free_port() for _ in range(args.workers)]
    stubs = subprocess.Popen([PY, __file__, "--stub-workers", ",".join(map(str, ports))], env=ENV)
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{ports[0]}/health")
        for mode in args.admission or ["off", "leading"]:
            hport, eport = free_port(), free_port()
            cmd = [PY, "-m", "tokenmill", "route", "--port", str(hport), "--epp-port", str(eport),
                   "--admission", mode, "--log-level", "warning"]
            for p in ports:
                cmd += ["--worker", f"tokenmill=http://127.0.0.1:{p}"]
            router = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL)
            try:
                wait_http(f"http://127.0.0.1:{hport}/health")
                cpu0 = router_cpu_s(router.pid)
                r = asyncio.run(drive(eport, args.rate, args.duration, args.ttft_ms / 1e3, args.decode_ms / 1e3, 0,
                                      not args.no_response_body))
                cpu = router_cpu_s(router.pid) - cpu0
                inside = decision_buckets(f"http://127.0.0.1:{hport}/metrics")
            finally:
                router.terminate()
                router.wait(10)
            lat = [x * 1e3 for x in r["lat"]]
            rows.append((mode, len(lat) / r["wall_s"], statistics.median(lat), pct(lat, 0.9), pct(lat, 0.99),
                         max(lat), pct(r["lags"], 0.99) * 1e3, cpu / len(lat) * 1e3, r["outcomes"],
                         len(r["picks"]), inside))
    finally:
        stubs.terminate()
        stubs.wait(10)
    print("| admission | decisions/s done | p50 ms | p90 ms | p99 ms | max ms | client lag p99 ms "
          "| picker CPU ms/decision | in-picker <= 0.5 / 1 / 2 ms | answers | endpoints used |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, done, p50, p90, p99, mx, lag, cpu, outcomes, used, inside in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
        shares = " / ".join(f"{100 * inside[le]:.1f}%" for le in (0.0005, 0.001, 0.002))
        print(f"| {mode} | {done:.0f} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {mx:.2f} | {lag:.2f} | {cpu:.3f} "
              f"| {shares} | {answers} | {used} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
