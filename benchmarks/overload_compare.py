"""Overload side by side: several server trees under the same open-loop agent load (benchmarks/soak.py each).

    python benchmarks/overload_compare.py --sessions 10 --minutes 1 --repeats 2 \\
        --variant new=/work/wt14 --variant base=/tmp/base   # base: `git archive 45352f3 | tar -x -C /tmp/base`

Per repeat each variant runs soak.py (a fresh `tokenmill serve` from that tree, `tokenmill bench` from this
one, same seed and load), the order rotating between repeats. Prints per run and per variant (summed over
repeats): requests sent / ok / refused / failed, the refusals' latency (send to 429) p50/p99, the accepted
requests' SLO attainment, and goodput (requests completed within the SLO per second of arrivals), with the
ratio of each variant's goodput to the first one's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=SOURCE_TREE (repeatable; first is the reference)")
    ap.add_argument("--sessions", type=float, default=10.0)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup-min", type=float, default=0.25)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--out", default="/tmp/tokenmill-overload")
    ap.add_argument("--bench-flag", action="append", default=[],
                    help="extra `tokenmill bench` argument for every run (repeatable), e.g. --bench-flag=--arrival=gamma "
                         "--bench-flag=--burstiness=0.2 (bursts)")
    args = ap.parse_args(argv)
    variants = []
    for v in args.variant:
        name, sep, tree = v.partition("=")
        if not sep or not name or not Path(tree).is_dir():
            ap.error(f"--variant {v!r}: expected NAME=SOURCE_TREE (an existing directory)")
        variants.append((name, tree))
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n, _ in variants}
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for name, tree in order:
            out = Path(args.out) / f"{name}-{rep}"
            cmd = [sys.executable, str(HERE / "soak.py"), "--model", args.model, "--minutes", f"{args.minutes:g}",
                   "--sessions", f"{args.sessions:g}", "--warmup-min", f"{args.warmup_min:g}", "--out", str(out),
                   "--server-tree", tree, *(f"--bench-flag={b}" for b in args.bench_flag)]
            print(f"# repeat {rep + 1} {name}: " + " ".join(cmd), flush=True)
            subprocess.run(cmd, stdout=subprocess.DEVNULL)
            summary = json.loads((out / "summary.json").read_text())
            runs[name].append(summary)
            print(f"#   {json.dumps(summary)}", flush=True)

    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    print(f"\n{args.sessions:g} sessions/s ({args.sessions * 4:g} req/s), {args.minutes:g} min of arrivals per run, "
          f"{args.repeats} repeat(s), model {args.model}, bench flags {args.bench_flag or 'defaults'}\n")
    print("| variant | run | sent | ok | refused | failed | 429 p50 ms | 429 p99 ms | accepted in SLO | goodput req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in variants:
        for i, s in enumerate(runs[name]):
            print(f"| {name} | {i + 1} | {s['sent']} | {s['ok']} | {s['refused']} | {s['failed']} | "
                  f"{f(s['refusal_p50_ms'])} | {f(s['refusal_p99_ms'])} | {f(s['attainment_accepted'], '.1%')} | "
                  f"{s['goodput_rps']:.2f} |")
    ref = sum(s["good"] for s in runs[variants[0][0]])
    print("\n| variant | good / ok (all runs) | goodput req/s (mean) | goodput vs " + variants[0][0] + " |")
    print("|---|---:|---:|---:|")
    for name, _ in variants:
        good, ok = sum(s["good"] for s in runs[name]), sum(s["ok"] for s in runs[name])
        print(f"| {name} | {good}/{ok} | {sum(s['goodput_rps'] for s in runs[name]) / len(runs[name]):.2f} | "
              f"{f(good / ref if ref else None, '.3f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
