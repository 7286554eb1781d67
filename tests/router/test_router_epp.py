"""The Endpoint Picker (ext_proc gRPC) driven by a client that plays Envoy: header and body phases in both
body modes, the picked endpoint in header and dynamic metadata, prefix affinity across calls, the subset
hint, 429/503 immediate responses, the served-endpoint fallback, and gRPC health."""

import asyncio
import json
import time

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.classes import WorkloadClass
from tokenmill.router.config import RouterConfig
from tokenmill.router.epp import EppServer
from tokenmill.router.router import Router
from tokenmill.router.worker_state import WorkerSpec

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


TRANSPORT = "grpcio"


@pytest.fixture(autouse=True, params=["grpcio", "h2", "frames"])
def transport(request):
    """Every test against both EPP transports (grpc.aio, and tokenmill's own HTTP/2 server): the client is
    grpc.aio either way, an independent implementation that checks the h2 server's framing."""
    global TRANSPORT
    TRANSPORT = request.param
    yield request.param
    TRANSPORT = "grpcio"


def run(coro):
    return asyncio.run(coro)


def make_router(healthy=True, clock=None, **overrides) -> Router:
    cfg = RouterConfig(workers=tuple(WorkerSpec("http://" + e) for e in ENDPOINTS), **overrides)
    router = Router(cfg) if clock is None else Router(cfg, clock=clock)
    for w in router.pool:
        w.healthy = healthy
    return router


class Envoy:
    """Plays the gateway's ext_proc filter: one bidi stream per HTTP request."""

    def __init__(self, port: int):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def open(self):
        return self.stub.Process()

    @staticmethod
    def headers(path="/v1/completions", extra=(), eos=False, mode=FULL_DUPLEX, subset=None, response_mode=None):
        hs = [(":method", "POST"), (":path", path), ("content-type", "application/json"), *extra]
        md = base_pb2.Metadata()
        if subset is not None:
            s = struct_pb2.Struct()
            s.update({"x-gateway-destination-endpoint-subset": subset})
            md.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
        return pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]), end_of_stream=eos),
            metadata_context=md,
            protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode
                                                     if response_mode is None else response_mode))

    @staticmethod
    def body(data: bytes, eos=True):
        return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))

    @staticmethod
    def response_headers(status="200", served=None):
        md = base_pb2.Metadata()
        if served:
            s = struct_pb2.Struct()
            s.update({"x-gateway-destination-endpoint-served": served})
            md.filter_metadata["envoy.lb"].CopyFrom(s)
        return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":status", raw_value=status.encode())])), metadata_context=md)

    @staticmethod
    def response_body(data: bytes, eos=False):
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def picked(resp: pb.ProcessingResponse) -> str:
    """The endpoint a headers/body response names; asserts header and dynamic metadata agree."""
    which = resp.WhichOneof("response")
    common = getattr(resp, which).response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    assert header["x-gateway-destination-endpoint"] == meta, (header, meta)
    return meta


async def with_epp(router, fn):
    server = EppServer(router, "127.0.0.1", 0, TRANSPORT)
    assert type(server).__name__ == {"grpcio": "GrpcioEppServer", "h2": "H2EppServer", "frames": "H2EppServer"}[TRANSPORT]
    await server.start(ready=True)
    envoy = Envoy(server.port)
    try:
        return await fn(envoy, server)
    finally:
        await envoy.channel.close()
        await server.stop(0)


async def pick_full_duplex(envoy, body: dict, extra=(), subset=None, chunks=2):
    """Headers then the body in `chunks` pieces; returns (stream, endpoint or ImmediateResponse)."""
    call = envoy.open()
    data = json.dumps(body).encode()
    await call.write(envoy.headers(extra=extra, subset=subset))
    step = -(-len(data) // chunks)
    for i in range(0, len(data), step):
        await call.write(envoy.body(data[i:i + step], eos=i + step >= len(data)))
    first = await call.read()
    if first.HasField("immediate_response"):
        return call, first.immediate_response
    assert first.HasField("request_headers")  # the held headers come first, with the pick
    endpoint = picked(first)
    second = await call.read()
    assert second.request_body.response.body_mutation.streamed_response.body == data  # the body, unchanged
    assert second.request_body.response.body_mutation.streamed_response.end_of_stream
    return call, endpoint


async def finish(call, envoy, served=None, stream=False):
    await call.write(envoy.response_headers(served=served))
    assert (await call.read()).HasField("response_headers")
    if stream:
        await call.write(envoy.response_body(b'data: {"choices":[{"text":"a"}]}\n\n'))
        await call.read()
    await call.write(envoy.response_body(b"data: [DONE]\n\n" if stream else b"{}", eos=True))
    assert (await call.read()).HasField("response_body")
    await call.done_writing()


def test_full_duplex_pick_is_a_routable_endpoint_and_a_shared_prefix_sticks_to_one_endpoint():
    router = make_router(policy="prefix-load", admission=AdmissionConfig(mode="off"))  # the routing policy alone
    system = "You are a helpful assistant. " * 40

    async def main(envoy, server):
        first = None
        for i in range(5):  # one after another, each answered (streamed) before the next: affinity across calls
            call, ep = await pick_full_duplex(envoy, {"prompt": system + f"question {i}", "max_tokens": 8,
                                                      "stream": True})
            assert ep in ENDPOINTS
            first = first or ep
            assert ep == first, "a shared prefix left its cached endpoint for a cold one"
            await finish(call, envoy, stream=True)
        open_call, ep = await pick_full_duplex(envoy, {"prompt": system + "q", "max_tokens": 8})
        assert ep == first
        other_call, other = await pick_full_duplex(envoy, {"prompt": "unrelated " * 100, "max_tokens": 8})
        assert other != first  # a cold prompt goes where nothing is queued
        w = router.pool.get("http://" + first)
        assert w.outstanding == 1 and router.in_flight == 2
        for call in (open_call, other_call):
            await finish(call, envoy)
        await asyncio.sleep(0.05)
        assert all(w.outstanding == 0 for w in router.pool) and router.in_flight == 0
        assert router.index.size("http://" + first) > 0
        text = router.metrics.render().decode()
        assert 'tokenmill_router_epp_requests_total{outcome="picked"} 7.0' in text
        assert "tokenmill_router_epp_decision_seconds_count 7.0" in text

    run(with_epp(router, main))


def test_the_epp_picks_what_the_proxys_router_picks_for_the_same_traffic():
    """Same requests, same order, admission on: the EPP's picks equal a twin Router's own `acquire` (what the
    HTTP proxy calls), with the leading admission overriding the policy while rates are unlearned.

    Both routers read one virtual clock, advanced by the test between requests (on real time, a slow machine
    moved the twin's decisions later than the EPP's, and its load view with them); the requests stream
    ("stream": true, response bodies on), so the EPP ends no prefill on a real-time timer of its own while
    the twin, which has no exchange, would not."""
    from tokenmill.router.prompt import prompt_key

    prompts = [("You are a helpful assistant. " * 40 if i % 3 else "Translate this. " * 30) + f"q{i}"
               for i in range(9)]
    now = [1000.0]
    router, twin = make_router(clock=lambda: now[0]), make_router(clock=lambda: now[0])

    async def main(envoy, server):
        got, want, calls = [], [], []
        for p in prompts:
            call, ep = await pick_full_duplex(envoy, {"prompt": p, "max_tokens": 8, "stream": True})
            got.append(ep)
            calls.append(call)
            ctx = twin.new_request(prompt_key({"prompt": p}, False, twin.cfg.prefix_index),
                                   twin.classes["interactive"], 8)
            want.append((await twin.acquire(ctx)).worker.removeprefix("http://"))
            now[0] += 0.005
        assert got == want and len(set(got)) > 1
        for call in calls:
            await finish(call, envoy)

    run(with_epp(router, main))


def test_buffered_mode_answers_headers_at_once_and_names_the_endpoint_in_the_body_response():
    router = make_router(policy="round-robin")

    async def main(envoy, server):
        seen = []
        for i in range(3):
            call = envoy.open()
            await call.write(envoy.headers(path="/v1/chat/completions", mode=BUFFERED))
            resp = await call.read()
            assert resp.HasField("request_headers") and not resp.request_headers.response.header_mutation.set_headers
            await call.write(envoy.body(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}).encode()))
            resp = await call.read()
            assert resp.HasField("request_body")
            seen.append(picked(resp))
            await finish(call, envoy)
        assert sorted(seen) == ENDPOINTS  # round-robin through the same policy code as the proxy

    run(with_epp(router, main))


def test_subset_hint_restricts_the_pick_and_an_empty_or_foreign_subset_is_503():
    router = make_router(policy="least-load")

    async def main(envoy, server):
        for _ in range(3):
            call, ep = await pick_full_duplex(envoy, {"prompt": "p", "max_tokens": 4}, subset=[ENDPOINTS[2]])
            assert ep == ENDPOINTS[2]  # even though least-load would spread to the idle ones
        call, ep = await pick_full_duplex(envoy, {"prompt": "p"}, subset=f"{ENDPOINTS[1]},{ENDPOINTS[2]}")
        assert ep == ENDPOINTS[1]
        for subset in ([], ["10.9.9.9:8000"]):
            call, imm = await pick_full_duplex(envoy, {"prompt": "p"}, subset=subset)
            assert imm.status.code == 503 and json.loads(imm.body)["error"]["code"] == "no-worker"

    run(with_epp(router, main))


def test_no_ready_endpoint_is_503_and_a_bad_body_is_400():
    router = make_router(healthy=False)

    async def main(envoy, server):
        call, imm = await pick_full_duplex(envoy, {"prompt": "p"})
        assert imm.status.code == 503
        headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
        assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
        call = envoy.open()
        await call.write(envoy.headers())
        await call.write(envoy.body(b"{not json"))
        imm = (await call.read()).immediate_response
        assert imm.status.code == 400 and "not valid JSON" in json.loads(imm.body)["error"]["message"]
        assert router.in_flight == 0

    run(with_epp(router, main))


def test_the_epp_and_the_proxy_refuse_the_same_bad_requests_with_the_same_message():
    """One request reader (request_fields.py) for both faces: what the HTTP proxy answers 400, the EPP
    answers 400 with the same message, and the bodies the proxy routes the EPP picks for."""
    from router_fakes import FakeWorker, routed

    cases = [(b"{not json", {}), (b"[1]", {}), (b'{"max_tokens": 3}', {}),
             (b'{"prompt": "x"}', {"x-tokenmill-class": "vip"}), (b'{"prompt": "x", "stream": "yes"}', {}),
             (b'{"prompt": "x", "max_tokens": -1}', {}), (b'{"prompt": "x", "max_tokens": true}', {}),
             (b'{"prompt": "x", "max_tokens": 2}', {}), (b'{"prompt": "x", "stream": true}', {"x-tokenmill-class": "batch"})]

    async def main():
        import aiohttp

        async with routed([FakeWorker()]) as (url, router), aiohttp.ClientSession() as s:
            server = EppServer(router, "127.0.0.1", 0, TRANSPORT)
            await server.start(ready=True)
            envoy = Envoy(server.port)
            try:
                for data, headers in cases:
                    async with s.post(url + "/v1/completions", data=data, headers=headers) as r:
                        proxy = (r.status, (await r.json())["error"]["message"] if r.status != 200 else None)
                    call = envoy.open()
                    await call.write(envoy.headers(extra=tuple(headers.items())))
                    await call.write(envoy.body(data))
                    first = await call.read()
                    if first.HasField("immediate_response"):
                        imm = first.immediate_response
                        epp = (imm.status.code, json.loads(imm.body)["error"]["message"])
                    else:
                        picked(first)
                        epp = (200, None)
                    call.cancel()
                    assert epp == proxy, (data, headers)
                for _ in range(200):  # the cancelled streams release their load when the picker sees them end
                    if router.in_flight == 0:
                        break
                    await asyncio.sleep(0.01)
                assert router.in_flight == 0
            finally:
                await envoy.channel.close()
                await server.stop(0)

    run(main())


def test_admission_refusal_is_an_immediate_429_with_retry_after():
    strict = WorkloadClass("interactive", ttft_slo_s=0.2, tpot_slo_s=1.0, priority=0, max_queue=0, max_wait_s=0.1)
    router = make_router(classes=(strict,), admission=AdmissionConfig(mode="leading"))
    for w in router.pool:  # every worker has ~10 s of prefill queued (the prior rate): no SLO can be met
        w.start("busy", 80_000, 10.0, router.clock(), max_tokens=1)

    async def main(envoy, server):
        call, imm = await pick_full_duplex(envoy, {"prompt": "hello " * 50, "max_tokens": 4})
        assert imm.status.code == 429, imm
        headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
        assert int(headers["retry-after"]) >= 1
        assert json.loads(imm.body)["error"]["type"] == "rate_limit_error"
        assert 'tokenmill_router_epp_requests_total{outcome="shed"} 1.0' in router.metrics.render().decode()
        assert router.in_flight == 0

    run(with_epp(router, main))


def test_a_request_held_by_admission_waits_in_its_stream_and_is_picked_when_work_finishes():
    cls = WorkloadClass("interactive", ttft_slo_s=3.0, tpot_slo_s=1.0, priority=0, max_queue=8, max_wait_s=2.5)
    # hold_drain="fast": the queued work finishing early (below) is what holding bets on; the default (slow)
    # refuses this request at once
    router = make_router(classes=(cls,), admission=AdmissionConfig(mode="leading", hold_drain="fast"))
    busy = [(w, w.start("busy", 30_000, 3.6, router.clock(), max_tokens=1)) for w in router.pool]  # ~3.7 s queued

    async def main(envoy, server):
        call = envoy.open()
        await call.write(envoy.headers())
        await call.write(envoy.body(json.dumps({"prompt": "hi " * 50, "max_tokens": 4}).encode()))
        answer = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.3)
        assert not answer.done() and router.queues.depths()["interactive"] == 1  # held, not refused
        for w, f in busy:  # the queued work finishes: the held request now meets its SLO
            w.finish(f, router.clock(), 1)
        router.pump()
        resp = await asyncio.wait_for(answer, 2.0)
        assert resp.HasField("request_headers") and picked(resp) in ENDPOINTS
        assert router.queues.depths()["interactive"] == 0
        await call.read()
        await finish(call, envoy)

    run(with_epp(router, main))


def test_a_held_request_whose_stream_is_dropped_leaves_its_queue_and_is_never_dispatched():
    """The gateway cancels the stream while admission holds the request: the queue entry goes, and the work
    finishing afterwards dispatches nothing to the dead stream (no load left anywhere)."""
    cls = WorkloadClass("interactive", ttft_slo_s=3.0, tpot_slo_s=1.0, priority=0, max_queue=8, max_wait_s=2.5)
    router = make_router(classes=(cls,), admission=AdmissionConfig(mode="leading", hold_drain="fast"))
    busy = [(w, w.start("busy", 30_000, 3.6, router.clock(), max_tokens=1)) for w in router.pool]

    async def main(envoy, server):
        call = envoy.open()
        await call.write(envoy.headers())
        await call.write(envoy.body(json.dumps({"prompt": "hi " * 50, "max_tokens": 4}).encode()))
        for _ in range(100):
            if router.queues.depths()["interactive"] == 1:
                break
            await asyncio.sleep(0.01)
        assert router.queues.depths()["interactive"] == 1 and router.in_flight == 1
        call.cancel()
        for _ in range(100):
            if router.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert router.in_flight == 0 and router.queues.depths()["interactive"] == 0
        for w, f in busy:
            w.finish(f, router.clock(), 1)
        router.pump()
        await asyncio.sleep(0.05)
        assert all(w.outstanding == 0 for w in router.pool)

    run(with_epp(router, main))


def test_an_exchange_closed_before_its_held_pick_is_awaited_releases_the_queue_entry_or_the_pick():
    """_Exchange.step answers a held request with an awaitable: if the stream closes before anyone awaits it
    (the h2 transport answers from a callback and starts a task only for such waits), close() takes the entry
    out of its class queue — or, when the pump already picked a worker for it, finishes that attempt."""
    from tokenmill.router.epp import EppMetrics, _Exchange

    cls = WorkloadClass("interactive", ttft_slo_s=3.0, tpot_slo_s=1.0, priority=0, max_queue=8, max_wait_s=2.5)

    async def main():
        for picked_first in (False, True):
            router = make_router(classes=(cls,), admission=AdmissionConfig(mode="leading", hold_drain="fast"))
            busy = [(w, w.start("busy", 30_000, 3.6, router.clock(), max_tokens=1)) for w in router.pool]
            ex = _Exchange(router, EppMetrics(router.metrics.registry))
            assert ex.step(Envoy.headers()) == []
            out = ex.step(Envoy.body(json.dumps({"prompt": "hi " * 50, "max_tokens": 4}).encode()))
            assert not isinstance(out, list) and router.queues.depths()["interactive"] == 1
            if picked_first:  # the work drains: the pump dispatches the held request before its waiter runs
                for w, f in busy:
                    w.finish(f, router.clock(), 1)
                router.pump()
                assert sum(w.outstanding for w in router.pool) == 1
            ex.close()
            out.close()  # (the coroutine nobody will await)
            assert router.in_flight == 0 and router.queues.depths()["interactive"] == 0
            if not picked_first:
                for w, f in busy:
                    w.finish(f, router.clock(), 1)
                router.pump()
            assert all(w.outstanding == 0 for w in router.pool), picked_first

    run(main())


def test_served_endpoint_moves_the_load_and_streaming_responses_feed_the_first_token():
    router = make_router(policy="least-load")

    async def main(envoy, server):
        call, ep = await pick_full_duplex(envoy, {"prompt": "p", "max_tokens": 8, "stream": True})
        fallback = next(e for e in ENDPOINTS if e != ep)
        await call.write(envoy.response_headers(served=fallback))
        await call.read()
        assert router.pool.get("http://" + ep).outstanding == 0
        served = router.pool.get("http://" + fallback)
        assert served.outstanding == 1 and served.decode_streams == 0
        await call.write(envoy.response_body(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'))
        await call.read()
        assert served.decode_streams == 1 and served.observed_ttft.value is not None
        await call.write(envoy.response_body(b"data: [DONE]\n\n", eos=True))
        resp = await call.read()
        assert resp.response_body.response.body_mutation.streamed_response.body == b"data: [DONE]\n\n"
        assert served.outstanding == 0 and served.decode_streams == 0 and router.in_flight == 0
        assert 'outcome="fallback"} 1.0' in router.metrics.render().decode()

    run(with_epp(router, main))


def test_without_response_bodies_the_prefill_ends_at_its_predicted_ttft_and_the_stream_end_finishes_it():
    router = make_router()

    async def main(envoy, server):
        call = envoy.open()
        await call.write(envoy.headers(response_mode=processing_mode_pb2.ProcessingMode.NONE))
        await call.write(envoy.body(json.dumps({"prompt": "p " * 200, "max_tokens": 8, "stream": True}).encode()))
        ep = picked(await call.read())
        await call.read()
        w = router.pool.get("http://" + ep)
        assert w.prefill_tokens > 0 and w.outstanding == 1
        for _ in range(100):  # the predicted TTFT of ~100 uncached tokens on the prior rates: tens of ms
            await asyncio.sleep(0.01)
            if w.prefill_tokens == 0:
                break
        assert w.prefill_tokens == 0 and w.outstanding == 1
        await call.write(envoy.response_headers())
        assert (await call.read()).HasField("response_headers")
        await call.done_writing()  # the HTTP stream ended: Envoy closes the ext_proc stream
        for _ in range(50):
            await asyncio.sleep(0.01)
            if w.outstanding == 0:
                break
        assert w.outstanding == 0 and router.in_flight == 0

    run(with_epp(router, main))


def test_a_gateway_that_drops_the_stream_releases_the_load():
    router = make_router()

    async def main(envoy, server):
        call, ep = await pick_full_duplex(envoy, {"prompt": "p", "max_tokens": 8})
        assert router.pool.get("http://" + ep).outstanding == 1
        call.cancel()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if router.in_flight == 0:
                break
        assert router.in_flight == 0 and router.pool.get("http://" + ep).outstanding == 0

    run(with_epp(router, main))


def test_grpc_health_reports_liveness_readiness_and_the_ext_proc_service():
    router = make_router()

    async def main(envoy, server):
        stub = health_pb2_grpc.HealthStub(envoy.channel)
        for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        await server.set_ready(False)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

    run(with_epp(router, main))


@pytest.mark.slow
def test_tokenmill_route_cli_serves_the_epp_beside_http_and_discovers_workers_by_dns():
    """The real CLI: `tokenmill route --worker-dns localhost:PORT --epp-port ...` in its own process."""
    import os
    import socket
    import subprocess
    import sys

    import aiohttp
    from router_fakes import FakeWorker, serving

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    async def main():
        fake = FakeWorker()
        async with serving(fake.app()) as wurl:
            wport, hport, eport = int(wurl.rsplit(":", 1)[1]), free_port(), free_port()
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "route", "--worker-dns", f"localhost:{wport}",
                                     "--dns-interval", "0.5", "--port", str(hport), "--epp-port", str(eport),
                                     "--epp-transport", TRANSPORT,
                                     "--log-level", "warning"], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                async with aiohttp.ClientSession() as s:
                    for _ in range(200):
                        try:
                            async with s.get(f"http://127.0.0.1:{hport}/health") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        await asyncio.sleep(0.1)
                    else:
                        raise AssertionError("the router never became healthy")
                    async with s.get(f"http://127.0.0.1:{hport}/admin/workers") as r:
                        urls = {w["url"] for w in (await r.json())["workers"]}
                assert f"http://127.0.0.1:{wport}" in urls  # localhost's A record (and ::1 when it has one)
                envoy = Envoy(eport)
                try:
                    stub = health_pb2_grpc.HealthStub(envoy.channel)
                    resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING
                    call, ep = await pick_full_duplex(envoy, {"prompt": "hello", "max_tokens": 4})
                    assert ep in {u.removeprefix("http://") for u in urls}
                    await finish(call, envoy)
                finally:
                    await envoy.channel.close()
            finally:
                proc.terminate()
                out = proc.communicate(timeout=20)[0].decode()
            assert f"epp=grpc://127.0.0.1:{eport} ({TRANSPORT})" in out and f"dns:localhost:{wport}" in out
    run(main())


def e2e_samples(router) -> tuple[float, float, dict[str, float]]:
    """(count, sum, cumulative buckets) of tokenmill_router_epp_e2e_seconds."""
    count = total = 0.0
    buckets = {}
    for line in router.metrics.render().decode().splitlines():
        if line.startswith("tokenmill_router_epp_e2e_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("tokenmill_router_epp_e2e_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("tokenmill_router_epp_e2e_seconds_bucket"):
            buckets[line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
    return count, total, buckets


def test_the_e2e_histogram_times_headers_arrival_to_answer_written_for_picks_and_refusals():
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main(envoy, server):
        # the gateway sends the headers, then the body 0.25 s later: the server-side e2e (headers read ->
        # answer written) covers the wait, the decision histogram (body complete -> picked) does not
        call = envoy.open()
        await call.write(envoy.headers())
        await asyncio.sleep(0.25)
        await call.write(envoy.body(json.dumps({"prompt": "hello " * 20, "max_tokens": 4}).encode()))
        assert picked(await call.read()) in ENDPOINTS
        await call.read()
        await asyncio.sleep(0.05)
        count, total, buckets = e2e_samples(router)
        assert count == 1 and 0.25 <= total < 1.0 and buckets["0.25"] == 0 and buckets["1.0"] == 1
        assert "tokenmill_router_epp_decision_seconds_bucket{le=\"0.25\"} 1.0" in router.metrics.render().decode()
        await finish(call, envoy)
        # a refusal is an answer too (400 here); the response path after the answer adds no sample
        bad, imm = await pick_full_duplex(envoy, {"prompt": "x", "max_tokens": -1})
        assert imm.status.code == 400
        await asyncio.sleep(0.05)
        count, total2, _ = e2e_samples(router)
        assert count == 2 and total2 - total < 0.25  # answered at once: no wait between its messages

    run(with_epp(router, main))


def test_the_picker_serves_on_uvloop():
    uvloop = pytest.importorskip("uvloop")
    router = make_router(admission=AdmissionConfig(mode="off"))

    async def main(envoy, server):
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        call, ep = await pick_full_duplex(envoy, {"prompt": "hello " * 20, "max_tokens": 4, "stream": True})
        assert ep in ENDPOINTS
        await finish(call, envoy, stream=True)
        await asyncio.sleep(0.05)
        assert router.in_flight == 0 and e2e_samples(router)[0] == 1

    uvloop.run(with_epp(router, main))


def test_a_full_duplex_body_that_ends_with_trailers_is_picked_at_the_trailers():
    router = make_router(admission=AdmissionConfig(mode="off"))
    data = json.dumps({"prompt": "hello " * 20, "max_tokens": 4}).encode()

    async def main(envoy, server):
        call = envoy.open()
        await call.write(envoy.headers())
        await call.write(envoy.body(data, eos=False))  # the body's end is signalled by the trailers
        await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        first = await call.read()
        assert first.HasField("request_headers") and picked(first) in ENDPOINTS
        body = (await call.read()).request_body.response.body_mutation.streamed_response
        assert body.body == data and not body.end_of_stream  # the trailers end the request, not the body
        assert (await call.read()).HasField("request_trailers")
        assert router.in_flight == 1
        await finish(call, envoy)
        # refused at the trailers: the immediate response alone
        call = envoy.open()
        await call.write(envoy.headers())
        await call.write(envoy.body(b'{"prompt": "x", "max_tokens": -1}', eos=False))
        await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        assert (await call.read()).immediate_response.status.code == 400
        await asyncio.sleep(0.05)
        assert router.in_flight == 0

    run(with_epp(router, main))


def test_the_hop_trace_stamps_each_answer_in_order_and_a_pick_is_written_before_the_next_decision(tmp_path):
    """--epp-trace (frames only): per answered stream, the socket read, the decision's start and end and the
    write of its answer, on perf_counter's clock. Two requests in one socket read: the first pick is written
    before the second decision starts (Call.push), not at the end of the read."""
    from hpack import Encoder

    router = make_router(admission=AdmissionConfig(mode="off"))
    path = tmp_path / "hops.csv"
    if TRANSPORT != "frames":
        with pytest.raises(ValueError, match="frames"):
            EppServer(router, "127.0.0.1", 0, TRANSPORT, str(path))
        with pytest.raises(ValueError, match="epp_trace"):
            RouterConfig(workers=router.cfg.workers, epp_trace=str(path), epp_transport=TRANSPORT)
        return

    def frame(kind, flags, sid, payload=b""):
        return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload

    def message(m) -> bytes:
        data = m.SerializeToString()
        return b"\x00" + len(data).to_bytes(4, "big") + data

    async def main():
        server = EppServer(router, "127.0.0.1", 0, TRANSPORT, str(path))
        await server.start(ready=True)
        before = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        enc = Encoder()
        block = enc.encode([(":method", "POST"), (":scheme", "http"), (":path", EXT_PROC_PATH), (":authority", "t"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
        out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0)
        for sid in (1, 3):  # two whole requests in one write: one socket read on the server
            body = json.dumps({"prompt": f"request {sid} " * 30, "max_tokens": 4}).encode()
            out += frame(1, 4, sid, block) + frame(0, 0, sid, message(Envoy.headers())) \
                + frame(0, 0, sid, message(Envoy.body(body)))
        writer.write(out)
        picks, buf = {}, b""
        while len(picks) < 2:
            buf += await asyncio.wait_for(reader.read(65536), 10)
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                kind, sid, payload, buf = buf[3], int.from_bytes(buf[5:9], "big"), buf[9:9 + n], buf[9 + n:]
                if kind == 0 and sid not in picks:
                    picks[sid] = picked(pb.ProcessingResponse.FromString(payload[5:]))
        writer.close()
        await server.stop(0)
        return before, time.perf_counter(), picks

    before, after, picks = run(main())
    assert set(picks) == {1, 3} and set(picks.values()) <= set(ENDPOINTS)
    lines = path.read_text().splitlines()
    assert lines[0] == "peer_port,sid,read_ns,arrived_ns,decision_start_ns,decision_end_ns,written_ns"
    rows = {int(r[1]): r for r in (list(map(int, line.split(","))) for line in lines[1:])}
    assert set(rows) == {1, 3}
    for port, sid, read, arrived, d0, d1, written in rows.values():
        assert port > 0 and before * 1e9 <= read <= arrived <= d0 <= d1 <= written <= after * 1e9
    assert rows[1][2] == rows[3][2]  # one socket read carried both requests ...
    assert rows[1][6] <= rows[3][4]  # ... and the first pick was written before the second decision began


def test_streamed_body_answers_are_the_nested_messages():
    """epp.StreamedBody: its message() (set through the field path) is the message the nested constructors build,
    and its SerializeToString() (written directly, the body spliced in) is protobuf's own serialization of it, byte
    for byte, for bodies on both sides of every varint length boundary of the nested prefixes."""
    from tokenmill.router.epp import StreamedBody

    lengths = (0, 1, 3, 115, 116, 117, 118, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 1700, 16370, 16371,
               16372, 16375, 16376, 16377, 16378, 16380, 16383, 16384, 16385, 2_097_140, 2_097_151, 2_097_152)
    for phase in ("request_body", "response_body"):
        for n in lengths:
            body = bytes(range(256)) * (n // 256) + bytes(n % 256)
            for eos in (False, True):
                ref = pb.ProcessingResponse(**{phase: pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body,
                                                                                             end_of_stream=eos))))})
                got = StreamedBody(phase, body, eos)
                assert got.message() == ref
                assert got.SerializeToString() == ref.SerializeToString(), (phase, n, eos)
                assert pb.ProcessingResponse.FromString(got.SerializeToString()) == ref
    with pytest.raises(ValueError, match="request_body or response_body"):
        StreamedBody("request_headers", b"", True)
