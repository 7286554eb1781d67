"""Compare `tokenmill bench` with `vllm bench serve` on the same run shape (docs/benchmarks/bench.md).

    python benchmarks/bench_compare_vllm.py VLLM_RESULT.json TOKENMILL_OUT/result.json

VLLM_RESULT.json is what `vllm bench serve --save-result --result-filename ...` writes (with
`--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99`). Prints a Markdown table of
TTFT/TPOT/ITL/e2e (mean, median, p99) from both tools and their relative difference.
"""

from __future__ import annotations

import json
import sys

METRICS = [("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")]
STATS = [("mean", "mean"), ("median", "p50"), ("p99", "p99")]


def rows(vllm: dict, ours: dict) -> list[str]:
    out = ["| metric | vllm bench serve | tokenmill bench | difference |", "|---|---|---|---|"]
    for v_name, t_name in METRICS:
        for v_stat, t_stat in STATS:
            v = vllm.get(f"{v_stat}_{v_name}_ms")
            t = (ours["summary"].get(t_name) or {}).get(t_stat)
            if v is None or t is None:
                continue
            diff = f"{100 * (t - v) / v:+.1f}%" if v else "-"
            out.append(f"| {v_stat} {v_name} (ms) | {v:.2f} | {t:.2f} | {diff} |")
    s = ours["summary"]
    out.append(f"| completed | {vllm.get('completed')} | {s['completed']} | |")
    out.append(f"| output tokens | {vllm.get('total_output_tokens')} | {s['output_tokens']} | |")
    out.append(f"| request throughput (req/s) | {vllm.get('request_throughput', 0):.3f} | "
               f"{s['request_throughput']:.3f} | |")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f, open(sys.argv[2]) as g:
        print("\n".join(rows(json.load(f), json.load(g))))
