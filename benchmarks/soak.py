"""Soak: `tokenmill serve` under a steady open-loop agent workload for a long time; does anything drift?

    python benchmarks/soak.py --minutes 20 --sessions 4          # the issue's run: ~80% of sustainable
    python benchmarks/soak.py --minutes 4 --sessions 4 --out /tmp/soak   # a shorter one

Starts `tokenmill serve` (engine core in its own process, the defaults plus --serve-flag ...), runs
`tokenmill bench` with the agent workload at --sessions new sessions per second (4 turns each, so 4x that in
requests/s) for --minutes, in its own process, and meanwhile samples every --sample-s seconds the resident
memory (VmRSS) of the front-end and of the engine core process and the server's /tokenmill/state. Then it
waits for the server to go idle and reads the KV blocks still in use (must be 0: a leaked block is one a
finished request never gave back; cached prefix blocks are free, not used).

Prints, per minute of arrivals: requests sent / ok / refused (429/503, admission: not errors) / failed
(errors: must be 0), TTFT p50/p99, TPOT p50/p99 of the completed ones, and the RSS of both processes;
then the RSS trend after warm-up (least-squares slope, MiB per minute; the first --warmup-min minutes
excluded) and the idle KV check. The sustainable rate of the agent workload on this machine is measured
by benchmarks/serve_admission.py (docs/benchmarks/serve_admission.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PY = sys.executable
AGENT = ("agent:system=640,repo=640,task=64,tool=128,output=48,turns_min=4,turns_max=4,think_s=0.5,"
         "max_context=2048")


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / var if var else None


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--minutes", type=float, default=20.0, help="minutes of arrivals")
    ap.add_argument("--sessions", type=float, default=4.0, help="new agent sessions per second (4 requests each)")
    ap.add_argument("--workload", default=AGENT)
    ap.add_argument("--slo", default="agent:ttft=2000,tpot=250")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-min", type=float, default=1.0, help="minutes left out of the RSS trend")
    ap.add_argument("--serve-flag", action="append", default=[], help="extra `tokenmill serve` argument (repeatable)")
    ap.add_argument("--bench-flag", action="append", default=[],
                    help="extra `tokenmill bench` argument (repeatable), e.g. --bench-flag=--arrival=gamma")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/tokenmill-soak")
    ap.add_argument("--server-tree", default=None,
                    help="run the server from this source tree (PYTHONPATH), e.g. a `git archive` of another commit")
    args = ap.parse_args(argv)
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([PY, "-m", "tokenmill", "serve", "--model", args.model, "--port", "0",
                               "--slo", args.slo, *args.serve_flag],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": args.server_tree} if args.server_tree else None,
                              cwd=args.server_tree)  # `-m` puts the working directory first on sys.path
    try:
        return _soak(args, out, server)
    finally:
        if server.poll() is None:  # an exception before the orderly SIGTERM: leave no orphan server behind
            server.kill()  # its engine core exits when the front-end's end of their socket closes
            server.wait()


def _soak(args, out: Path, server: subprocess.Popen) -> int:
    from tokenmill.model.loader import resolve_model_path

    line = server.stdout.readline()
    m = re.search(r"at (http://[\d.]+:\d+)", line)
    if not m:
        print(line + server.stdout.read(), file=sys.stderr)
        return 1
    url = m.group(1)
    log_lines: list[str] = []
    threading.Thread(target=lambda: log_lines.extend(server.stdout), daemon=True).start()
    core_pid = get_json(url + "/tokenmill/state").get("engine_core_pid")
    samples: list[dict] = []
    stop = threading.Event()
    t_start = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            try:
                st = get_json(url + "/tokenmill/state")
            except OSError as e:  # a slow answer under load: skip this sample, say so
                print(f"# state sample failed: {e}", flush=True)
                stop.wait(args.sample_s)
                continue
            samples.append({"t": time.monotonic() - t_start, "front_rss": rss_mib(server.pid),
                            "core_rss": rss_mib(core_pid) if core_pid else None,
                            "kv_used": st["stats"]["kv_blocks_used"], "in_flight": st["num_in_flight"],
                            "kv_cached": st["stats"].get("kv_blocks_cached"),
                            "kv_total": st["stats"]["kv_blocks_total"],
                            "evictions": st["stats"].get("kv_evictions_total")})
            stop.wait(args.sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rate = args.sessions * 4
    bench = [PY, "-m", "tokenmill", "bench", "--target", url, "--workload", args.workload, "--rate", f"{rate:g}",
             "--duration", f"{args.minutes * 60:g}", "--slo", args.slo, "--seed", str(args.seed),
             "--out", str(out / "bench"), "--no-plots", "--no-progress", "--request-timeout", "300",
             "--tokenizer", str(resolve_model_path(args.model)), *args.bench_flag]  # token-id prompts: exact lengths
    print("# " + " ".join(bench), flush=True)
    t_bench = time.monotonic() - t_start
    rc = subprocess.run(bench, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if rc.returncode != 0:
        print(rc.stderr[-2000:], file=sys.stderr)
    # idle: wait for in-flight to drain, then the KV blocks still used are leaks
    deadline = time.monotonic() + 60
    st = get_json(url + "/tokenmill/state")
    while (st["num_in_flight"] or st["stats"]["num_running"] or st["stats"]["num_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        st = get_json(url + "/tokenmill/state")
    time.sleep(args.sample_s)
    st = get_json(url + "/tokenmill/state")
    stop.set()
    sampler.join()
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        (out / "metrics.txt").write_bytes(r.read())  # the server's own admission figures, for a post-mortem
    server.terminate()
    code = server.wait(60)

    records = [json.loads(x) for x in (out / "bench" / "requests.jsonl").read_text().splitlines() if x.strip()]
    print(f"\nmodel {args.model}; workload {args.workload}; {args.sessions:g} sessions/s = {rate:g} req/s for "
          f"{args.minutes:g} min; SLO {args.slo}; serve flags {args.serve_flag or 'defaults'}; "
          f"bench flags {args.bench_flag or 'defaults'}")
    print("\n| minute | sent | ok | refused | failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
          "| front-end RSS MiB | core RSS MiB | prefix-cached blocks | evictions |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    n_min = int(-(-args.minutes // 1))
    total_failed = 0
    for k in range(n_min):
        rs = [r for r in records if k * 60 <= r["sent_s"] < (k + 1) * 60]
        ok = [r for r in rs if r["status"] == "ok"]
        failed = [r for r in rs if r["status"] == "failed"]
        total_failed += len(failed)
        ttft = [(r["first_token_s"] - r["sent_s"]) * 1000 for r in ok if r.get("first_token_s") is not None]
        tpot = [(r["end_s"] - r["first_token_s"]) * 1000 / (r["output_tokens"] - 1) for r in ok
                if r.get("first_token_s") is not None and r.get("end_s") is not None and r["output_tokens"] > 1]
        ss = [s for s in samples if t_bench + k * 60 <= s["t"] < t_bench + (k + 1) * 60]
        front = max((s["front_rss"] for s in ss if s["front_rss"]), default=None)
        core = max((s["core_rss"] for s in ss if s["core_rss"]), default=None)
        cached = max((s["kv_cached"] for s in ss if s.get("kv_cached") is not None), default=None)
        evicted = max((s["evictions"] for s in ss if s.get("evictions") is not None), default=None)
        print(f"| {k + 1} | {len(rs)} | {len(ok)} | {sum(r['status'] == 'rejected' for r in rs)} | {len(failed)} | "
              f"{fmt(pct(ttft, .5))} | {fmt(pct(ttft, .99))} | {fmt(pct(tpot, .5))} | {fmt(pct(tpot, .99))} | "
              f"{fmt(front, '.1f')} | {fmt(core, '.1f')} | {fmt(cached)} | {fmt(evicted)} |")
    if samples and samples[-1].get("kv_total"):
        print(f"\nKV pool: {samples[-1]['kv_total']} blocks; the prefix cache fills it with new content until "
              "evictions start (its index grows with it: bounded by the pool)")
    after = [s for s in samples if s["t"] >= t_bench + args.warmup_min * 60]
    for key, name in (("front_rss", "front-end"), ("core_rss", "engine core")):
        pts = [(s["t"], s[key]) for s in after if s[key]]
        if pts:
            print(f"\n{name} RSS after {args.warmup_min:g} min warm-up: {min(v for _, v in pts):.1f}–"
                  f"{max(v for _, v in pts):.1f} MiB over {len(pts)} samples, slope {fmt(slope_per_min(pts), '+.2f')} MiB/min"
                  f" (second half: {fmt(slope_per_min(pts[len(pts) // 2:]), '+.2f')} MiB/min)")
    slo = dict(kv.split("=") for kv in args.slo.split(":", 1)[1].split(","))
    ttft_slo, tpot_slo = float(slo["ttft"]) / 1000, float(slo["tpot"]) / 1000
    ok_recs = [r for r in records if r["status"] == "ok" and r.get("first_token_s") is not None]

    def met(r) -> bool:
        n = r["output_tokens"]
        tpot = (r["end_s"] - r["first_token_s"]) / (n - 1) if n > 1 else 0.0
        return r["first_token_s"] - r["sent_s"] <= ttft_slo and tpot <= tpot_slo

    refused_ms = [(r["end_s"] - r["sent_s"]) * 1000 for r in records if r["status"] == "rejected" and r.get("end_s")]
    print(f"\naccepted requests within the SLO: {sum(map(met, ok_recs))}/{len(ok_recs)}"
          + (f" ({sum(map(met, ok_recs)) / len(ok_recs):.1%})" if ok_recs else "")
          + f"; refusals (429/503) answered in p50 {fmt(pct(refused_ms, .5), '.1f')} ms, "
            f"p99 {fmt(pct(refused_ms, .99), '.1f')} ms, max {fmt(max(refused_ms, default=None), '.1f')} ms")
    errors = [r.get("error") for r in records if r["status"] == "failed"][:5]
    print(f"\nrequests: {len(records)} sent, {sum(r['status'] == 'ok' for r in records)} ok, "
          f"{sum(r['status'] == 'rejected' for r in records)} refused, {total_failed} failed" +
          (f" (first errors: {errors})" if errors else ""))
    print(f"idle after the run: {st['stats']['kv_blocks_used']} KV blocks in use (leaked), "
          f"{st['num_in_flight']} in flight, {st['stats']['num_running']} running, {st['stats']['num_waiting']} waiting; "
          f"server exit code {code} after SIGTERM")
    (out / "samples.json").write_text(json.dumps({"samples": samples, "t_bench": t_bench}, indent=1))
    good = sum(map(met, ok_recs))
    ttft_ok = [(r["first_token_s"] - r["sent_s"]) * 1000 for r in ok_recs]
    (out / "summary.json").write_text(json.dumps({
        "sent": len(records), "ok": len(ok_recs), "refused": len(refused_ms), "failed": total_failed,
        "good": good, "goodput_rps": good / (args.minutes * 60), "attainment_accepted": good / len(ok_recs) if ok_recs else None,
        "refusal_p50_ms": pct(refused_ms, .5), "refusal_p99_ms": pct(refused_ms, .99), "refusal_max_ms": max(refused_ms, default=None),
        "ttft_p50_ms": pct(ttft_ok, .5), "ttft_p99_ms": pct(ttft_ok, .99), "kv_leaked": st["stats"]["kv_blocks_used"],
        "exit_code": code}, indent=1))
    ok = total_failed == 0 and st["stats"]["kv_blocks_used"] == 0 and code == 0
    print("PASS" if ok else "FAIL", "(errors 0, KV leaked 0, clean exit)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
