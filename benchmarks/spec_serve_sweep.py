"""Speculative decoding through `tokenmill serve`, measured by `tokenmill bench`: output tok/s by load, from
idle (1 session) to saturation, speculation off vs each configuration, ratios vs off at each load.

    python benchmarks/spec_serve_sweep.py --concurrency 1 4 16 64 --duration 15 \
        --config off= --config draft-k4=demo-draft:4 --config draft-auto=demo-draft:auto

Each configuration is one `tokenmill serve --model demo --admission off [--speculative-model M
--num-speculative-tokens K]` subprocess; each load level one `tokenmill bench --workload batch:...
--concurrency C --duration D` subprocess against it (closed loop: C sessions in flight at once, each a
single request, greedy, `ignore_eos`). The levels run interleaved (for each C, every configuration in turn)
so a drift of the shared machine hits all of them. `tokenmill bench --sweep` searches the highest *rate*
meeting an SLO target, not a throughput-by-load curve; closed-loop concurrency levels are the sweep from idle
to saturation this comparison needs. The bench's prompts are its synthetic text (not code): acceptance is
whatever the draft achieves on it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill.hardware import capabilities  # noqa: E402


def start_server(spec: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--model", "demo", "--port", "0", "--admission", "off"]
    if spec:
        model, k = spec.split(":")
        cmd += ["--speculative-model", model, "--num-speculative-tokens", k]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in p.stdout:  # the first line naming the URL (warnings may come before it)
        seen.append(line)
        m = re.search(r" at (http://[\d.]+:\d+)", line)
        if m:  # keep draining its output so that a full pipe never blocks the server
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, m.group(1)
        if len(seen) > 50:
            break
    p.terminate()
    raise SystemExit(f"tokenmill serve {spec} did not start:\n{''.join(seen)[-2000:]}")


def bench(url: str, c: int, duration: float, workload: str, out: Path) -> dict:
    tok = REPO / "tokenmill" / "model" / "demo" / "demo"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "--target", url, "--workload", workload, "--concurrency",
           str(c), "--duration", str(duration), "--out", str(out), "--no-plots", "--no-progress", "--tokenizer",
           str(tok), "--seed", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tokenmill bench failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads((out / "result.json").read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--workload", default="batch:prompt=128,output=96,spread=0")
    ap.add_argument("--config", action="append", default=None,
                    help="NAME=MODEL:K (empty after '=': speculation off); repeatable")
    a = ap.parse_args()
    configs = dict(c.split("=", 1) for c in (a.config or ["off=", "draft-k4=demo-draft:4", "draft-auto=demo-draft:auto",
                                                           "ngram-k4=ngram:4", "ngram-auto=ngram:auto"]))
    servers = {n: start_server(s) for n, s in configs.items()}
    res: dict[str, dict[int, dict]] = {n: {} for n in configs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n, (_, url) in servers.items():  # warm-up: kernels, the auto policy's first cost samples
                bench(url, 2, 3.0, a.workload, Path(tmp) / f"warm-{n}")
            for c in a.concurrency:
                for n, (_, url) in servers.items():
                    res[n][c] = bench(url, c, a.duration, a.workload, Path(tmp) / f"{n}-{c}")
    finally:
        for p, _ in servers.values():
            p.terminate()
            p.wait(30)
    base = next(iter(configs))
    print(f"\n### tokenmill serve + tokenmill bench: output tok/s by concurrency ({a.workload}, {a.duration:g} s "
          f"per level)\n\n{capabilities().summary()}\n")
    print("| concurrency | " + " | ".join(configs) + " |")
    print("|---:|" + "---:|" * len(configs))
    for c in a.concurrency:
        b = res[base][c]["output_throughput"]
        cells = [f"{res[n][c]['output_throughput'] / b:.2f}x" + (f" ({b:.0f})" if n == base else "")
                 for n in configs]
        print(f"| {c} | " + " | ".join(cells) + " |")
    print("\nTPOT p50 ms: " + "; ".join(
        f"{n}: " + ", ".join(f"{(res[n][c].get('tpot_ms') or {}).get('p50', float('nan')):.2f}" for c in a.concurrency)
        for n in configs))


if __name__ == "__main__":
    main()
