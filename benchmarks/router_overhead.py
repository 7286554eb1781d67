"""The router's own cost per request: one worker, small sequential streaming requests, direct vs routed.

    python benchmarks/router_overhead.py                       # 50 pairs, 64-token prompts, 32 output tokens
    python benchmarks/router_overhead.py --requests 100 --max-tokens 64 --policy round-robin

Starts one `tokenmill serve` worker (tiny random model, one torch thread) and one `tokenmill route`
in front of it, then sends `--requests` pairs of identical-shape requests (random token-id prompts, so
no prefix-cache hits; `ignore_eos`, so every stream has `--max-tokens` tokens), one at a time, alternating
direct and routed so background load hits both alike. Reports TTFT and total latency of each path, the
per-pair difference (routed − direct), and the router process's CPU time (utime + stime from
/proc/PID/stat) while it served the routed requests — per request and per streamed SSE event — with its
idle rate (health checks and metric scrapes, 1 per second) measured separately and subtracted.

Light by design (one worker, one request at a time, ~1 minute on the tiny model): safe on a shared machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import ENV, PY, _stop, make_model, wait_http  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process, seconds (resolution 1 / CLK_TCK)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S


def cpu_s(pid: int) -> float:
    return sum(cpu_times(pid))


def stream_once(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, float, int]:
    """One streaming completion on a kept-alive connection: (TTFT s, total s, SSE data events)."""
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, events = None, 0
    while True:
        line = resp.readline()
        if not line:
            raise RuntimeError("stream ended before [DONE]")
        if not line.startswith(b"data:"):
            continue
        if line[5:].strip() == b"[DONE]":
            break
        events += 1
        if ttft is None:
            ttft = time.perf_counter() - t0
    resp.read()
    return ttft, time.perf_counter() - t0, events


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/m/tiny")
    ap.add_argument("--requests", type=int, default=50, help="pairs (one direct + one routed each)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--policy", default="prefix-load")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds to measure the router's idle CPU rate")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)  # the ISA beside every table

    model = make_model(Path(args.model))
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 256)
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    wport, rport = free_port(), free_port()
    wurl, rurl = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{rport}"
    wlog, rlog = open(tmp / "worker.log", "w"), open(tmp / "router.log", "w")
    worker = subprocess.Popen([PY, "-m", "tokenmill", "serve", "--model", str(model), "--port", str(wport),
                               "--num-threads", "1", "--log-level", "warning", "--admission", "off"], stdout=wlog,
                              stderr=subprocess.STDOUT, env=ENV)
    router = None
    try:
        wait_http(wurl + "/health")
        router = subprocess.Popen([PY, "-m", "tokenmill", "route", "--worker", wurl, "--port", str(rport),
                                   "--policy", args.policy, "--admission", "off", "--log-level", "warning"],
                                  stdout=rlog, stderr=subprocess.STDOUT, env=ENV)
        wait_http(rurl + "/health", 60)
        conns = {"direct": http.client.HTTPConnection("127.0.0.1", wport, timeout=120),
                 "router": http.client.HTTPConnection("127.0.0.1", rport, timeout=120)}

        def body() -> bytes:
            prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
            return json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
                               "stream": True, "temperature": 0}).encode()

        for name in ("direct", "router", "direct", "router"):  # warm-up: torch first calls, connections
            stream_once(conns[name], body())

        time.sleep(0.5)
        c0, t0 = cpu_s(router.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_rate = (cpu_s(router.pid) - c0) / (time.monotonic() - t0)

        res = {"direct": [], "router": []}
        router_cpu, router_sys, router_wall, events = 0.0, 0.0, 0.0, 0
        for i in range(args.requests):
            order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
            for name in order:
                b = body()
                if name == "router":
                    (cu, cs), t = cpu_times(router.pid), time.monotonic()
                r = stream_once(conns[name], b)
                if name == "router":
                    u, sy = cpu_times(router.pid)
                    router_cpu += u + sy - cu - cs
                    router_sys += sy - cs
                    router_wall += time.monotonic() - t
                    events += r[2]
                res[name].append(r)
    finally:
        _stop([p for p in (router, worker) if p is not None])

    n = args.requests
    busy_cpu = max(0.0, router_cpu - idle_rate * router_wall)
    d_ttft = [(r[0] - d[0]) * 1e3 for d, r in zip(res["direct"], res["router"])]
    d_total = [(r[1] - d[1]) * 1e3 for d, r in zip(res["direct"], res["router"])]
    out = {"requests": n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "events_per_request": events / n, "router_cpu_ms_per_request": 1e3 * busy_cpu / n,
           "router_cpu_us_per_event": 1e6 * busy_cpu / events if events else None,
           "router_idle_cpu_ms_per_s": 1e3 * idle_rate,
           "router_sys_share": router_sys / router_cpu if router_cpu else None, "router_cpu_share_while_streaming": busy_cpu / router_wall}
    print(f"{n} sequential streaming requests per path, prompt {args.prompt_tokens} tokens, "
          f"{args.max_tokens} output tokens ({out['events_per_request']:.0f} SSE events each), policy {args.policy}\n")
    print("| path | TTFT p50 / p90 (ms) | total p50 / p90 (ms) |")
    print("|---|---|---|")
    for name in ("direct", "router"):
        ttft = [r[0] * 1e3 for r in res[name]]
        total = [r[1] * 1e3 for r in res[name]]
        out[name] = {"ttft_p50_ms": pct(ttft, .5), "ttft_p90_ms": pct(ttft, .9),
                     "total_p50_ms": pct(total, .5), "total_p90_ms": pct(total, .9)}
        label = "direct to the worker" if name == "direct" else "through `tokenmill route`"
        print(f"| {label} | {pct(ttft, .5):.1f} / {pct(ttft, .9):.1f} | {pct(total, .5):.1f} / {pct(total, .9):.1f} |")
    out["added_ttft_ms_median"] = statistics.median(d_ttft)
    out["added_total_ms_median"] = statistics.median(d_total)
    print(f"| added by the router (median of pair differences) | {out['added_ttft_ms_median']:.1f} | "
          f"{out['added_total_ms_median']:.1f} |")
    print(f"\nrouter CPU: {out['router_cpu_ms_per_request']:.2f} ms per request, "
          f"{out['router_cpu_us_per_event']:.0f} µs per streamed event, "
          f"{100 * out['router_cpu_share_while_streaming']:.0f}% of a core while streaming "
          f"({100 * (out['router_sys_share'] or 0):.0f}% of it in the kernel; "
          f"idle {out['router_idle_cpu_ms_per_s']:.1f} ms/s subtracted; /proc tick {TICK_S * 1e3:.0f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
