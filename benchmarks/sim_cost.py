"""Scenario: H200 vs B300 tokens per hour and cost per million tokens on Llama-3.1-405B (`tokenmill sim`, roofline).

    python benchmarks/sim_cost.py --h200-price 3.5 --b300-price 8.05 --concurrency 128 --duration 120

One worker of 8 GPUs (TP8) per configuration, a closed loop of --concurrency sessions of the bench's `batch`
workload (--workload, default prompt 2048 / output 512, lognormal lengths), so the worker runs saturated and
the output is its throughput. Prices are inputs (USD per GPU-hour): the defaults only encode the issue's
"2.3x the price" ratio, they are not market quotes. Configurations: H200 FP8, B300 FP8, B300 FP4 (weights and
math; KV in FP8 everywhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tokenmill.hardware import capabilities


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--h200-price", type=float, default=3.5)
    ap.add_argument("--b300-price", type=float, default=8.05)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--workload", default="batch:prompt=2048,output=512")
    ap.add_argument("--out", default="/tmp/sim_cost")
    args = ap.parse_args()
    print(f"ISA: {capabilities().summary()}")
    configs = [("h200", "fp8", args.h200_price), ("b300", "fp8", args.b300_price), ("b300", "fp4", args.b300_price)]
    rows = []
    for hw, dtype, price in configs:
        dest = Path(args.out) / f"{hw}-{dtype}"
        cmd = [sys.executable, "-m", "tokenmill", "sim", "--model", "llama-3.1-405b", "--hardware", hw, "--tp", "8",
               "--dtype", dtype, "--kv-bytes", "1", "--workers", "1", "--workload", args.workload, "--concurrency",
               str(args.concurrency), "--duration", str(args.duration), "--price-per-hour", str(price),
               "--no-token-times", "--no-plots", "--out", str(dest)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        d = json.loads((dest / "result.json").read_text())
        rows.append((hw, dtype, price, d["summary"], d["sim"]["levels"][0]))
    base = rows[0]
    print(f"\n`tokenmill sim --model llama-3.1-405b --hardware HW --tp 8 --dtype DTYPE --kv-bytes 1 --workload "
          f"{args.workload} --concurrency {args.concurrency} --duration {args.duration:g} --price-per-hour P`\n")
    print("| GPU | dtype | $/GPU-h | output tok/h | x H200 | TPOT p50 ms | $ per M output tokens | x H200 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for hw, dtype, price, s, lvl in rows:
        tph = s["output_throughput"] * 3600
        cost = lvl["cost"]["per_million_output_tokens"]
        print(f"| {hw} | {dtype} | {price:g} | {tph:.3g} | {tph / (base[3]['output_throughput'] * 3600):.2f} | "
              f"{s['tpot_ms']['p50']:.1f} | {cost:.2f} | {cost / base[4]['cost']['per_million_output_tokens']:.2f} |")


if __name__ == "__main__":
    main()
