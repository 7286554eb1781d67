"""Workers joining and leaving a live router under load (`--worker-dns` discovery).

    python benchmarks/discovery_churn.py                       # 60 req/s for 12 s, 1 s discovery interval
    python benchmarks/discovery_churn.py --rate 100 --interval 0.5

Processes: stub OpenAI workers (one aiohttp process listening on 127.0.0.2 .. 127.0.0.5, one port: four
"pod IPs" behind one headless-Service port; each streams `--tokens` tokens `--tpot-ms` apart), a load
client (its own process, open loop at `--rate`: streaming completions), and the router in this process:
the real Router, HTTP app and WorkerDiscovery, with the DNS answer scripted (the stub resolver stands in
for the cluster DNS; everything after the lookup is the production code path).

Timeline: start with .2 and .3; at 1/4 of the run .4 joins; at 1/2 .2 leaves (it is drained: in-flight
streams finish, no new ones); at 3/4 .3 flaps (out for one interval, back). Reported: how long after the
DNS change the joiner got its first request (in seconds and discovery intervals), how many requests the
leaver got after the DNS change, and requests lost (not 200, or a stream without [DONE]).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

PY = sys.executable
IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]


def common_port() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((IPS[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in IPS[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


def stub_workers(port: int, tokens: int, tpot_s: float) -> None:
    from aiohttp import web

    async def health(request):
        return web.json_response({"status": "ok"})

    async def metrics(request):
        return web.Response(text="")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "demo", "object": "model"}]})

    async def complete(request):
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            await asyncio.sleep(tpot_s)
            await resp.write(b'data: {"choices":[{"index":0,"text":" t","finish_reason":null}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", complete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for ip in IPS:
            await web.TCPSite(runner, ip, port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def client(url: str, rate: float, duration_s: float, out: str) -> None:
    import aiohttp

    async def main():
        results = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one(i):
                body = {"prompt": f"request {i} " + "x" * 400, "max_tokens": 16, "stream": True}
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        text = await r.text()
                        results.append([r.status, text.rstrip().endswith("data: [DONE]")])
                except aiohttp.ClientError as e:
                    results.append([0, False, str(e)])
            start = time.monotonic()
            tasks = []
            for i in range(int(rate * duration_s)):
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        with open(out, "w") as f:
            json.dump(results, f)

    asyncio.run(main())


async def run_router(args, port: int) -> dict:
    from aiohttp import web

    from tokenmill.router.admission import AdmissionConfig
    from tokenmill.router.app import create_app
    from tokenmill.router.cluster import attach
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.discovery import DnsTarget
    from tokenmill.router.router import Router

    answer = IPS[:2]

    async def resolver(name, p):
        return list(answer)

    target = DnsTarget("tokenmill-workers.bench.svc", port, "openai")
    router = Router(RouterConfig(worker_dns=(target,), dns_interval_s=args.interval, health_interval_s=1.0,
                                 admission=AdmissionConfig(mode="off"), port=0))
    app = create_app(router)
    attach(app, resolver=resolver)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    out = tempfile.mktemp(suffix=".json")
    load = subprocess.Popen([PY, __file__, "--client", url, "--rate", str(args.rate), "--duration",
                             str(args.duration), "--out", out])
    urls = [target.url(ip) for ip in IPS]

    def routed(u):
        return router.metrics.routed.labels(u)._value.get()

    t0 = time.monotonic()
    report = {}
    await asyncio.sleep(args.duration / 4 + args.phase * args.interval)  # the change lands mid-interval
    answer = IPS[:3]  # .4 joins
    t_join = time.monotonic()
    while routed(urls[2]) == 0 and time.monotonic() - t_join < 10 * args.interval:
        await asyncio.sleep(0.005)
    report["join_s"] = time.monotonic() - t_join
    await asyncio.sleep(max(0.0, t0 + args.duration / 2 + args.phase * args.interval - time.monotonic()))
    answer = IPS[1:3]  # .2 leaves
    t_leave, before = time.monotonic(), routed(urls[0])
    w = router.pool.get(urls[0])
    while router.pool.get(urls[0]) is not None and not router.pool.get(urls[0]).draining:
        await asyncio.sleep(0.005)
    report["drain_start_s"] = time.monotonic() - t_leave
    report["in_flight_at_drain"] = w.outstanding
    report["after_dns_change"] = routed(urls[0]) - before
    at_drain = routed(urls[0])
    while router.pool.get(urls[0]) is not None:
        await asyncio.sleep(0.005)
    report["drained_s"] = time.monotonic() - t_leave
    report["after_drain_start"] = routed(urls[0]) - at_drain
    await asyncio.sleep(max(0.0, t0 + 3 * args.duration / 4 - time.monotonic()))
    answer = [IPS[2]]  # .3 flaps out ...
    await asyncio.sleep(args.interval * 1.5)
    answer = IPS[1:3]  # ... and back
    while load.poll() is None:
        await asyncio.sleep(0.05)
    with open(out) as f:
        results = json.load(f)
    os.unlink(out)
    report["requests"] = len(results)
    report["lost"] = sum(1 for r in results if not (r[0] == 200 and r[1]))
    await runner.cleanup()
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--interval", type=float, default=1.0, help="discovery interval (s)")
    ap.add_argument("--phase", type=float, default=0.5, help="DNS changes land this far (in intervals) after a "
                    "discovery round: the wait for the next round is (1 - phase) intervals")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--tpot-ms", type=float, default=20.0)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--stub-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        client(args.client, args.rate, args.duration, args.out)
        return 0
    if args.stub_port:
        stub_workers(args.stub_port, args.tokens, args.tpot_ms / 1e3)
        return 0
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    print(f"# {args.rate:g} req/s streaming for {args.duration:g} s, discovery interval {args.interval:g} s, "
          f"streams of {args.tokens} tokens {args.tpot_ms:g} ms apart", flush=True)
    port = common_port()
    stubs = subprocess.Popen([PY, __file__, "--stub-port", str(port), "--tokens", str(args.tokens),
                              "--tpot-ms", str(args.tpot_ms)])
    try:
        time.sleep(1.5)
        r = asyncio.run(run_router(args, port))
    finally:
        stubs.terminate()
        stubs.wait(10)
    iv = args.interval
    print("| event | measured |")
    print("|---|---|")
    print(f"| join: DNS change -> first request on the joiner | {r['join_s']:.2f} s ({r['join_s'] / iv:.2f} intervals) |")
    print(f"| leave: DNS change -> draining | {r['drain_start_s']:.2f} s ({r['drain_start_s'] / iv:.2f} intervals) |")
    print(f"| leave: requests in flight there when draining began | {r['in_flight_at_drain']} |")
    print(f"| leave: new requests sent to it after draining began | {int(r['after_drain_start'])} |")
    print(f"| leave: DNS change -> drained and forgotten | {r['drained_s']:.2f} s |")
    print(f"| requests sent / lost (not 200 or no [DONE]) | {r['requests']} / {r['lost']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
