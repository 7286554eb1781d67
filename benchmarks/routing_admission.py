"""Admission control under overload: leading indicators vs lagging signals vs none; prints a table.

    python benchmarks/routing_admission.py --rate 3 --duration 40

The router (prefix-load) runs in front of fresh local tokenmill workers with `--admission leading`
(predicted TTFT from router-counted queued prefill and learned rates), `lagging` (observed TTFT EWMA and
the workers' reported waiting queue) and `off`, at an offered load above what the workers can serve
within the SLO. Accepted requests should keep their SLO; refusals should be fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from routing_common import bench, check_port_free, make_model, tokenmill_router, warm_up, workers  # noqa: E402


def summarize(mode: str, result: dict, requests: list[dict], slo_ttft_s: float) -> dict:
    s = result["summary"]
    ok = [r for r in requests if r["status"] == "ok"]
    refused = [r for r in requests if r["status"] == "rejected"]
    ttft = [r["first_token_s"] - r["sent_s"] for r in ok if r.get("first_token_s") is not None]
    refuse_s = [r["end_s"] - r["sent_s"] for r in refused if r.get("end_s") is not None]
    return {
        "admission": mode, "requests": s["requests"], "goodput": s["goodput"],
        "accepted": len(ok) / s["requests"] if s["requests"] else 0.0,
        "good_of_accepted": s["good"] / len(ok) if ok else 0.0,
        "ttft_ok_of_accepted": sum(t <= slo_ttft_s for t in ttft) / len(ttft) if ttft else 0.0,
        "ttft_p90_ms": 1000 * float(np.percentile(ttft, 90)) if ttft else None,
        "refusal_p99_ms": 1000 * float(np.percentile(refuse_s, 99)) if refuse_s else None,
        "failed": s["failed"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--system", type=int, default=512)
    p.add_argument("--question", type=int, default=256)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--kv-cache-size", default="32MiB")
    p.add_argument("--ttft-ms", type=int, default=2000)
    p.add_argument("--tpot-ms", type=int, default=500)
    p.add_argument("--modes", nargs="+", default=["leading", "lagging", "off"])
    p.add_argument("--base-port", type=int, default=18400)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)  # the ISA beside every table

    out = args.out or Path(tempfile.mkdtemp(prefix="tokenmill-admission-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(Path(tempfile.gettempdir()) / "tokenmill-routing-tiny")
    router_port = args.base_port + 50
    for port in [router_port, *range(args.base_port, args.base_port + args.workers)]:
        check_port_free(port)
    slo = f"interactive:ttft={args.ttft_ms},tpot={args.tpot_ms}"
    router_cfg = {"classes": [{"name": "interactive", "ttft_slo_s": args.ttft_ms / 1000,
                               "tpot_slo_s": args.tpot_ms / 1000}]}
    workload = [f"shared-prefix:groups={args.groups},prompts=16,system={args.system},question={args.question},"
                f"output={args.output}"]
    rows = []
    for mode in args.modes:
        run_dir = out / mode
        run_dir.mkdir(exist_ok=True)
        with workers(model, args.workers, args.base_port, args.kv_cache_size, run_dir) as urls:
            warm_up(urls)
            with tokenmill_router(urls, router_port, "prefix-load", mode, run_dir, router_cfg) as target:
                result = bench(target, run_dir / "bench", model, workload, args.rate, args.duration, slo)
        requests = [json.loads(line) for line in (run_dir / "bench" / "requests.jsonl").read_text().splitlines()]
        rows.append(summarize(mode, result, requests, args.ttft_ms / 1000))
        print(f"{mode}: goodput {rows[-1]['goodput']:.2f} req/s", file=sys.stderr, flush=True)

    print(f"{args.workers} tokenmill workers (tiny model, 1 thread, KV {args.kv_cache_size}), prefix-load, "
          f"{args.rate:g} req/s Poisson for {args.duration:g}s, shared-prefix groups={args.groups} "
          f"system={args.system} question={args.question} output={args.output}, SLO {slo}\n")
    print("| admission | goodput (req/s) | accepted | TTFT within SLO, of accepted | good, of accepted | "
          "TTFT p90 of accepted (ms) | 429 latency p99 (ms) | failed |")
    print("|" + "---|" * 8)
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(f"| {r['admission']} | {r['goodput']:.2f} | {100 * r['accepted']:.0f}% | "
              f"{100 * r['ttft_ok_of_accepted']:.0f}% | {100 * r['good_of_accepted']:.0f}% | {fmt(r['ttft_p90_ms'])} | "
              f"{fmt(r['refusal_p99_ms'])} | {r['failed']} |")
    (out / "routing_admission.json").write_text(json.dumps(rows, indent=1))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
