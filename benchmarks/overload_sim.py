"""Overload on the simulator: `tokenmill sim` (the router's own admission, class queues and pump over N
simulated workers, virtual clock) from several source trees, same workload, seeds and load.

    python benchmarks/overload_sim.py --variant base=/tmp/base14 --variant new=$PWD \\
        --variant new-nohold=$PWD:nohold.json --rates 32,64 --seeds 0,1,2 -- \\
        --model llama-3.1-70b --hardware h100 --tp 2 --workers 2 --duration 60 --slo agent:ttft=2000,tpot=250

A variant is NAME=TREE[:ROUTER_CONFIG] (a `tokenmill route` config file passed as --router-config); what
follows `--` goes to `tokenmill sim` as is. Prints per variant, rate and seed: requests sent / ok / refused,
refusals later than 50 ms after arrival (held, then refused), their p99, accepted within the SLO and
goodput (requests within --ttft-s / --tpot-s per second of arrivals); then the mean goodput per variant and
rate. The refusal latency is the virtual time from arrival to the refusal: no HTTP in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

AGENT = "agent:system=640,repo=640,task=64,tool=128,output=48,turns_min=4,turns_max=4,think_s=0.5,max_context=2048"


def summarize(recs: list[dict], ttft_s: float, tpot_s: float) -> dict:
    ok = [x for x in recs if x["status"] == "ok"]
    lat = sorted(x["end_s"] - x["sent_s"] for x in recs if x["status"] == "rejected")

    def met(x) -> bool:
        n = x["output_tokens"]
        return x["first_token_s"] - x["sent_s"] <= ttft_s and (n < 2 or (x["end_s"] - x["first_token_s"]) / (n - 1) <= tpot_s)

    good = sum(map(met, ok))
    span = max((x["sent_s"] for x in recs), default=0.0) or 1.0
    return {"sent": len(recs), "ok": len(ok), "refused": len(lat), "late": sum(v > 0.05 for v in lat),
            "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1000 if lat else 0.0, "good": good, "goodput": good / span}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sim_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=TREE[:ROUTER_CONFIG] (repeatable)")
    ap.add_argument("--rates", default="32,64", help="requests/s offered, comma-separated")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--workload", default=AGENT)
    ap.add_argument("--ttft-s", type=float, default=2.0)
    ap.add_argument("--tpot-s", type=float, default=0.25)
    ap.add_argument("--out", default="/tmp/tokenmill-overload-sim")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    variants = []
    for v in args.variant:
        name, sep, rest = v.partition("=")
        tree, _, rcfg = rest.partition(":")
        if not sep or not Path(tree).is_dir() or (rcfg and not Path(rcfg).is_file()):
            ap.error(f"--variant {v!r}: expected NAME=SOURCE_TREE[:ROUTER_CONFIG_FILE]")
        variants.append((name, tree, rcfg))
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}; tokenmill sim {' '.join(sim_args)}", flush=True)
    print("| variant | req/s | seed | sent | ok | refused | refused > 50 ms | their p99 ms | accepted in SLO | goodput req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    means: dict[tuple[str, str], list[float]] = {}
    for rate in args.rates.split(","):
        for seed in args.seeds.split(","):
            for name, tree, rcfg in variants:
                out = Path(args.out) / f"{name}-{rate}-{seed}"
                cmd = [sys.executable, "-m", "tokenmill", "sim", "--workload", args.workload, "--rate", rate,
                       "--seed", seed, "--out", str(out), "--no-plots", *(["--router-config", rcfg] if rcfg else []),
                       *sim_args]
                r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True)
                if r.returncode:
                    print(f"# {name} rate {rate} seed {seed} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                    return 1
                recs = [json.loads(x) for x in next(out.rglob("requests.jsonl")).read_text().splitlines() if x.strip()]
                s = summarize(recs, args.ttft_s, args.tpot_s)
                means.setdefault((name, rate), []).append(s["goodput"])
                print(f"| {name} | {rate} | {seed} | {s['sent']} | {s['ok']} | {s['refused']} | {s['late']} | "
                      f"{s['p99_ms']:.0f} | {s['good']}/{s['ok']} | {s['goodput']:.2f} |", flush=True)
    print("\n| variant | " + " | ".join(f"{r} req/s" for r in args.rates.split(",")) + " |")
    print("|---|" + "---:|" * len(args.rates.split(",")))
    for name, _, _ in variants:
        print(f"| {name} | " + " | ".join(f"{sum(g) / len(g):.2f}" for r in args.rates.split(",")
                                           for g in [means[(name, r)]]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
