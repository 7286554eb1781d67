"""Live worker discovery (--worker-dns): a stub resolver scripts a headless Service's answers while clients
keep sending requests; workers join, leave and flap, and no request is lost."""

import asyncio
import socket
from contextlib import AsyncExitStack

import aiohttp
import pytest
from router_fakes import FakeWorker

from tokenmill.router.app import create_app
from tokenmill.router.cluster import DISCOVERY, attach
from tokenmill.router.config import RouterConfig, config_from_dict
from tokenmill.router.discovery import DnsTarget, ResolveError, dns_resolver, plan
from tokenmill.router.router import Router
from tokenmill.router.worker_state import WorkerSpec


def run(coro):
    return asyncio.run(coro)


def test_dns_target_parsing_and_config_errors_name_the_field():
    t = DnsTarget.parse("vllm=workers.ns.svc.cluster.local:8000")
    assert (t.name, t.port, t.kind) == ("workers.ns.svc.cluster.local", 8000, "vllm")
    assert DnsTarget.parse("w:80").kind == "auto"
    assert t.url("10.1.2.3") == "http://10.1.2.3:8000" and t.url("fd00::5") == "http://[fd00::5]:8000"
    for bad in ("workers", "workers:http", "http://w:80", "w:0", "cuda=w:80"):
        with pytest.raises(ValueError):
            DnsTarget.parse(bad)
    cfg = config_from_dict({"worker_dns": ["w.ns.svc:8000"], "dns_interval_s": 2, "epp_port": 9002})
    assert cfg.worker_dns == (DnsTarget("w.ns.svc", 8000),) and cfg.epp_port == 9002
    with pytest.raises(ValueError, match="dns_interval_s"):
        RouterConfig(dns_interval_s=0)
    with pytest.raises(ValueError, match="epp_port"):
        RouterConfig(epp_port=70000)
    with pytest.raises(ValueError, match="worker_dns"):
        config_from_dict({"worker_dns": "w:80"})


def test_plan_adds_new_addresses_drains_vanished_ones_and_keeps_a_target_whose_lookup_failed():
    a, b = DnsTarget("a.svc", 8000), DnsTarget("b.svc", 9000)
    owned = {"http://10.0.0.1:8000": a, "http://10.0.0.2:8000": a, "http://10.0.1.1:9000": b}
    join, leave = plan(owned, {a: ["10.0.0.2", "10.0.0.3"], b: None})
    assert join == {"http://10.0.0.3:8000": a} and leave == ["http://10.0.0.1:8000"]
    join, leave = plan(owned, {a: [], b: ["10.0.1.1"]})  # a scaled to zero: all of a drains
    assert join == {} and leave == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_the_system_resolver_finds_localhost_and_an_unknown_name_is_empty_or_a_failure():
    async def main():
        assert "127.0.0.1" in await dns_resolver("localhost", 80)
        try:
            assert await dns_resolver("no-such-worker.invalid", 80) == []
        except ResolveError:
            pass  # no resolver reachable in this sandbox: a failure, which keeps the pool as it is
    run(main())


def _free_port(hosts) -> int:
    """A port free on every one of `hosts` (loopback addresses standing in for pod IPs)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


class StubDns:
    """The headless Service's answer, as the test scripts it."""

    def __init__(self):
        self.addresses: list[str] = []
        self.fail = False
        self.lookups = 0

    async def __call__(self, name, port):
        self.lookups += 1
        if self.fail:
            raise ResolveError("SERVFAIL")
        return list(self.addresses)


async def _serve_at(stack, app, host, port):
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    stack.push_async_callback(runner.cleanup)


@pytest.mark.slow
def test_workers_join_leave_and_flap_under_traffic_and_no_request_is_lost():
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = _free_port(ips)
    target = DnsTarget("tokenmill-workers.test.svc", port)

    async def main():
        fakes = [FakeWorker(tpot_s=0.004) for _ in ips]
        dns = StubDns()
        dns.addresses = [ips[0]]
        async with AsyncExitStack() as stack:
            for ip, fake in zip(ips, fakes):
                await _serve_at(stack, fake.app(), ip, port)
            static = FakeWorker(tpot_s=0.004)  # a --worker beside the DNS target: discovery never touches it
            from router_fakes import serving
            static.url = await stack.enter_async_context(serving(static.app()))
            cfg = RouterConfig(workers=(WorkerSpec(static.url),), worker_dns=(target,), dns_interval_s=0.1,
                               health_interval_s=0.2, admission=RouterConfig().admission.__class__(mode="off"),
                               policy="round-robin")
            router = Router(cfg)
            app = create_app(router)
            attach(app, resolver=dns)
            url = await stack.enter_async_context(serving(app))
            discovery = app[DISCOVERY]
            urls = [target.url(ip) for ip in ips]
            assert router.pool.get(urls[0]).healthy  # resolved and probed before the first request

            results, stop = [], asyncio.Event()

            async def client(i, s):
                n = 0
                while not stop.is_set():
                    stream = n % 2 == 0
                    body = {"prompt": f"client {i} request {n} " + "x" * 200, "max_tokens": 8, "stream": stream}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        text = await r.text()
                        ok = r.status == 200 and (not stream or text.rstrip().endswith("data: [DONE]"))
                        results.append((r.status, ok))
                    n += 1

            def routed(u):
                return router.metrics.routed.labels(u)._value.get()

            async with aiohttp.ClientSession() as s:
                clients = [asyncio.create_task(client(i, s)) for i in range(6)]
                await asyncio.sleep(0.3)
                dns.addresses = ips[:2]  # join
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if routed(urls[1]) > 0:
                        break
                assert routed(urls[1]) > 0, "the joining worker never took traffic"
                dns.fail = True  # a DNS outage changes nothing
                await asyncio.sleep(0.3)
                assert {w.url for w in router.pool if not w.draining} == {static.url, *urls[:2]}
                dns.fail = False
                dns.addresses = ips[1:]  # 127.0.0.2 leaves (in-flight requests there must finish), .4 joins
                await asyncio.sleep(0.25)
                left = routed(urls[0])
                dns.addresses = [ips[2]]  # .3 flaps out ...
                await asyncio.sleep(0.25)
                dns.addresses = ips[1:]  # ... and back
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*clients)
            assert routed(urls[0]) == left, "a drained worker got new requests"
            assert router.pool.get(urls[0]) is None  # drained, then forgotten
            assert all(routed(u) > 0 for u in urls[1:]) and routed(static.url) > 0
            assert router.pool.get(urls[1]) is not None and not router.pool.get(urls[1]).draining
            assert len(results) > 50 and all(ok for _, ok in results), \
                f"{sum(not ok for _, ok in results)} of {len(results)} requests lost"
            assert sum(len(f.requests) for f in fakes + [static]) == len(results)  # no retries were needed
            text = router.metrics.render().decode()
            assert f'tokenmill_router_discovered_workers{{target="{target}"}} 2.0' in text
            assert f'tokenmill_router_discovery_events_total{{event="leave",target="{target}"}} 2.0' in text
            assert f'tokenmill_router_discovery_events_total{{event="join",target="{target}"}} 4.0' in text
            assert 'event="error"' in text
            assert discovery.rounds > 10
            assert all(w.outstanding == 0 for w in router.pool) and router.in_flight == 0
    run(main())


def test_cli_takes_worker_dns_alone_and_a_bad_one_is_a_message():
    from tokenmill.cli import CLIError, build_parser
    from tokenmill.router.cli import build_config

    def cfg(*argv):
        argv = ["route", *argv]
        return build_config(build_parser(argv).parse_args(argv))

    c = cfg("--worker-dns", "tokenmill=w.ns.svc:8000", "--dns-interval", "2", "--epp-port", "9002")
    assert c.workers == () and c.worker_dns == (DnsTarget("w.ns.svc", 8000, "tokenmill"),)
    assert c.dns_interval_s == 2 and c.epp_port == 9002
    with pytest.raises(CLIError, match="--worker-dns"):
        cfg()
    with pytest.raises(CLIError, match="NAME:PORT"):
        cfg("--worker-dns", "w.ns.svc")
    with pytest.raises(CLIError, match="dns_interval_s"):
        cfg("--worker-dns", "w:1", "--dns-interval", "0")
