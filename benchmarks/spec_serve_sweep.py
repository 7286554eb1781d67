"""Speculative decoding through `tokenmill serve`, measured by `tokenmill bench`: output tok/s by load, from
idle (1 session) to saturation, speculation off vs each configuration, ratios vs off at each load.

    python benchmarks/spec_serve_sweep.py --concurrency 1 4 16 64 --duration 15 \
        --config off= --config draft-k4=demo-draft:4 --config draft-auto=demo-draft:auto \
        --config ngram-auto6=ngram:auto:6      # MODEL:K, or MODEL:auto:MAX_K (--speculative-max-k)
        --config nogap=ngram:auto@TOKENMILL_SPEC_GAP=0    # ...@VAR=VALUE[,VAR=VALUE]: the server's environment
    python benchmarks/spec_serve_sweep.py --num-threads 1 --rounds 2 --duration 7 ...   # a shared, loaded box

`--rounds R` repeats each level R times, configurations interleaved within a round; a configuration's ratio
is the median over rounds of its rate over off's rate in the same round, printed with the [min-max] range
(the resolution of the run). Per level the servers' /metrics give acceptance, the share of sequence-steps with
k > 0, the mean k, and k switches per request per minute (switches / (concurrency x seconds) x 60: the
closed loop keeps `concurrency` requests alive throughout).

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
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill.hardware import capabilities  # noqa: E402


def start_server(spec: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--model", "demo", "--port", "0", "--admission", "off", *extra]
    env = dict(os.environ)
    if "@" in spec:  # MODEL:K@VAR=VALUE,...: environment variables for this server (a diagnostic switch's A/B)
        spec, _, assigns = spec.partition("@")
        for a in assigns.split(","):
            var, eq, value = a.partition("=")
            if not eq or not var:
                raise SystemExit(f"--config ...@{assigns}: expected VAR=VALUE[,VAR=VALUE], got {a!r}")
            env[var] = value
    if spec:
        model, k, *max_k = spec.split(":")  # MODEL:K or MODEL:auto:MAX_K
        cmd += ["--speculative-model", model, "--num-speculative-tokens", k]
        if max_k:
            cmd += ["--speculative-max-k", max_k[0]]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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


def spec_counters(url: str) -> dict[str, float]:
    """The server's speculative-decoding counters from /metrics (summed over labels; chosen k by its `k`)."""
    out: dict[str, float] = defaultdict(float)
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as e:  # the counters are a report beside the table: a failed scrape must not lose the run
        print(f"(no /metrics from {url}: {e})", file=sys.stderr)
        return out
    for line in text.splitlines():
        if line.startswith("#") or "spec_decode" not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base.startswith("tokenmill_spec_decode_chosen_k"):
            m = re.search(r'k="(\d+)"', name)
            base = f"chosen_k={m.group(1) if m else '?'}"
        out[base] += float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--workload", default="batch:prompt=128,output=96,spread=0")
    ap.add_argument("--config", action="append", default=None,
                    help="NAME=MODEL:K (empty after '=': speculation off); repeatable")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds per level (each config --duration s per round); a config's ratio is the "
                         "median over rounds of its rate / off's rate in the same round (a burst of another job on "
                         "the shared machine hits one round of one config, not the ratio)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="every server's `--num-threads` (default: torch's choice)")
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    configs = dict(c.split("=", 1) for c in (a.config or ["off=", "draft-k4=demo-draft:4", "draft-auto=demo-draft:auto",
                                                           "ngram-k4=ngram:4", "ngram-auto=ngram:auto"]))
    extra = ["--num-threads", str(a.num_threads)] if a.num_threads else []
    servers = {n: start_server(s, extra) for n, s in configs.items()}
    res: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in a.concurrency} for n in configs}
    spec: dict[str, dict[int, dict[str, float]]] = {n: {c: defaultdict(float) for c in a.concurrency} for n in configs}
    base = next(iter(configs))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n, (_, url) in servers.items():  # warm-up: kernels, the auto policy's first cost samples
                bench(url, 2, 3.0, a.workload, Path(tmp) / f"warm-{n}")
            for c in a.concurrency:
                for r in range(a.rounds):
                    for n, (_, url) in servers.items():
                        before = spec_counters(url) if configs[n] else {}
                        res[n][c].append(bench(url, c, a.duration, a.workload, Path(tmp) / f"{n}-{c}-{r}"))
                        if configs[n]:  # this level's share of the counters
                            after = spec_counters(url)
                            for key in after:
                                spec[n][c][key] += after[key] - before.get(key, 0.0)
                    b = res[base][c][r]["output_throughput"]  # a partial result survives a run cut short
                    print(f"c={c} round {r}: " + ", ".join(f"{n} {res[n][c][r]['output_throughput']:.0f} tok/s "
                                                           f"({res[n][c][r]['output_throughput'] / b:.2f}x)"
                                                           for n in configs), file=sys.stderr, flush=True)
    finally:
        for p, _ in servers.values():
            p.terminate()
            p.wait(30)
    print(f"\n### tokenmill serve + tokenmill bench: output tok/s by concurrency ({a.workload}, {a.duration:g} s "
          f"per level and config, {a.rounds} interleaved round(s), "
          f"{'torch threads ' + str(a.num_threads) if a.num_threads else 'default threads'})\n\n{capabilities().summary()}\n")
    if a.rounds > 1:
        print(f"Ratio: median over rounds of (config / {base} in the same round), [min-max]; {base}: median tok/s\n")
    print("| concurrency | " + " | ".join(configs) + " |")
    print("|---:|" + "---:|" * len(configs))
    for c in a.concurrency:
        cells = []
        for n in configs:
            if n == base:
                cells.append(f"1.00x ({statistics.median(x['output_throughput'] for x in res[n][c]):.0f})")
                continue
            rs = [x["output_throughput"] / y["output_throughput"] for x, y in zip(res[n][c], res[base][c])]
            cells.append(f"{statistics.median(rs):.2f}x" + (f" [{min(rs):.2f}-{max(rs):.2f}]" if len(rs) > 1 else ""))
        print(f"| {c} | " + " | ".join(cells) + " |")
    print("\nTPOT p50 ms (median over rounds): " + "; ".join(
        f"{n}: " + ", ".join(f"{statistics.median((x.get('tpot_ms') or {}).get('p50', float('nan')) for x in res[n][c]):.2f}"
                             for c in a.concurrency)
        for n in configs))
    print("\nPer speculative configuration and level: acceptance (accepted / drafted tokens), share of decoding "
          "sequence-steps with k > 0, mean k over them, k switches per request per minute (switches / (concurrency x "
          "duration): the closed loop keeps `concurrency` requests alive for the whole level)\n")
    print("| config | " + " | ".join(f"c={c}" for c in a.concurrency) + " |")
    print("|---|" + "---|" * len(a.concurrency))
    for n, s in configs.items():
        if not s:
            continue
        cells = []
        for c in a.concurrency:
            sp = spec[n][c]
            drafted = next((v for key, v in sp.items() if "num_draft_tokens" in key), 0.0)
            acc = next((v for key, v in sp.items() if "num_accepted_tokens" in key and "per_pos" not in key), 0.0)
            sw = next((v for key, v in sp.items() if "k_switches" in key), 0.0)
            ks = {int(key.split("=")[1]): v for key, v in sp.items() if key.startswith("chosen_k=")}
            steps = sum(ks.values())
            on = sum(v for k, v in ks.items() if k)
            mean_k = sum(k * v for k, v in ks.items()) / on if on else 0.0
            cells.append(f"acc {acc / drafted if drafted else float('nan'):.2f}, k>0 {on / steps if steps else 0:.0%}, "
                         f"k {mean_k:.1f}, sw {sw / (c * a.duration * a.rounds / 60):.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
