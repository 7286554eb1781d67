"""Scenario: llm-d's prefix-aware scheduling benchmark in `tokenmill sim` -- prefix-only vs prefix+load routing.

    flock /tmp/cpu.lock python benchmarks/sim_llmd.py --rates 6,10,14 --duration 120 --out /tmp/sim_llmd

The published setup (issue 15): Qwen3-32B on 8 workers x 2 H100 (TP2, 16 GPUs), 150 prefix groups x 5 users,
6k-token system prompts + 1.2k-token questions; prefix-only routing ended at TTFT > 140 s and 55% success,
prefix+load at TTFT near 0 and 100% success. Here: the same shapes as the bench's `shared-prefix` workload
(output 1,000 tokens: an assumption, the source does not fix it here), Poisson arrivals at each --rates
level for --duration seconds, the router's `prefix` policy (longest cached prefix; ties by load) vs
`prefix-load` (default), admission off on both (llm-d's gateway does not refuse). Success = completed within
the interactive SLO (--slo, default ttft=10000,tpot=100: a request waiting 10 s for its first token counts as
failed, as a client timeout would). Roofline cost model, bf16, catalog H100 SXM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tokenmill.hardware import capabilities

WORKLOAD = "shared-prefix:groups=150,prompts=5,system=6000,question=1200,output=1000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="6,10,14")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--slo", default="ttft=10000,tpot=100")
    ap.add_argument("--policies", default="prefix-only,prefix-load")
    ap.add_argument("--zipf", type=float, default=0.0, help="group popularity skew (shared-prefix zipf=)")
    ap.add_argument("--out", default="/tmp/sim_llmd")
    args = ap.parse_args()
    out = Path(args.out)
    workload = WORKLOAD + (f",zipf={args.zipf:g}" if args.zipf else "")
    print(f"ISA: {capabilities().summary()}")
    rows = []
    for rate in args.rates.split(","):
        for pol in args.policies.split(","):
            dest = out / f"{pol}-{rate}"
            cmd = [sys.executable, "-m", "tokenmill", "sim", "--model", "qwen3-32b", "--hardware", "h100", "--tp", "2",
                   "--workers", "8", "--router", pol, "--admission", "off", "--workload", workload, "--rate", rate,
                   "--duration", str(args.duration), "--slo", args.slo, "--no-token-times", "--no-plots",
                   "--out", str(dest)]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            d = json.loads((dest / "result.json").read_text())
            rows.append((rate, pol, d["summary"], d["sim"]["levels"][0], wall))
    line = " ".join(["tokenmill sim --model qwen3-32b --hardware h100 --tp 2 --workers 8 --admission off",
                     "--workload", workload, "--duration", str(args.duration), "--slo", args.slo])
    print(f"\n`{line} --router POLICY --rate R`\n")
    print("| rate req/s | policy | success (SLO) | TTFT p50 s | TTFT p90 s | TTFT max s | TPOT p50 ms | "
          "prefix hit | throughput req/s | sim wall s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate, pol, s, lvl, wall in rows:
        t = s["ttft_ms"]
        print(f"| {rate} | {pol} | {100 * (s['slo_attainment'] or 0):.0f}% | {t['p50'] / 1000:.2f} | "
              f"{t['p90'] / 1000:.2f} | {t['max'] / 1000:.1f} | {s['tpot_ms']['p50']:.1f} | "
              f"{100 * (s['prefix_cache_hit_rate'] or 0):.0f}% | {s['request_throughput']:.2f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
