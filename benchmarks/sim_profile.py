"""Where `tokenmill sim`'s event loop spends its time per request, by component (cProfile), on the same
synthetic Mooncake-shaped trace and cluster as benchmarks/sim_speed.py.

    flock /tmp/cpu.lock python benchmarks/sim_profile.py --workers 1000 --duration 4

Every function's own time (cProfile tottime) goes to the component of the tokenmill file it is in; time in
library code (numpy, prometheus_client, hashlib, builtins) goes to the tokenmill functions that called it, in
proportion to their calls' time. Times are under the profiler (~1.3-1.8x the plain run); shares are of the
profiled event loop.

    flock /tmp/cpu.lock python benchmarks/sim_profile.py --workers 1000 --duration 4 --py-spy

`--py-spy`: sample the plain run instead (py-spy, 250 Hz, a child process: no per-call overhead, which under
cProfile inflates small C calls such as numpy's 3x3 solve ~10x): each sample goes to the component of its
deepest tokenmill frame (library code to its tokenmill caller), samples outside the event loop to "outside the
event loop"; microseconds per request = share of the samples x the run's wall time / requests.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_speed import write_trace  # noqa: E402

from tokenmill.bench.runner import LoadConfig  # noqa: E402
from tokenmill.hardware import capabilities  # noqa: E402
from tokenmill.router.config import RouterConfig  # noqa: E402
from tokenmill.sim.simulation import SimConfig, run_simulation  # noqa: E402

COMPONENTS = [  # (path fragment, function name or None for any, component): first match wins
    ("tokenmill/engine/kv/block_pool.py", "__init__", "building the workers (before the loop)"),
    ("tokenmill/engine/kv/block_pool.py", "<listcomp>", "building the workers (before the loop)"),
    ("tokenmill/engine/scheduler.py", None, "engine: Scheduler"),
    ("tokenmill/engine/kv/hashing.py", None, "engine: KV block hashing"),
    ("tokenmill/engine/kv/", None, "engine: KV allocation, prefix lookups"),
    ("tokenmill/engine/step_budget.py", None, "engine: step-budget fit"),
    ("tokenmill/engine/request.py", None, "engine: Request bookkeeping"),
    ("tokenmill/sim/decode_run.py", None, "sim: decode fast-forward"),
    ("tokenmill/sim/cost_model.py", None, "sim: cost model"),
    ("tokenmill/sim/worker.py", None, "sim: worker step loop"),
    ("tokenmill/sim/cluster.py", "_on_token", "sim: per-token delivery"),
    ("tokenmill/sim/cluster.py", "_on_tokens", "sim: per-token delivery"),
    ("tokenmill/sim/cluster.py", None, "sim: request dispatch"),
    ("tokenmill/sim/clock.py", None, "sim: event loop"),
    ("tokenmill/router/router.py", "output_tokens", "router: per-token bookkeeping"),
    ("tokenmill/router/worker_state.py", "tokens", "router: per-token bookkeeping"),
    ("tokenmill/router/worker_state.py", "_take_decode", "router: per-token bookkeeping"),
    ("tokenmill/router/prefix_index.py", "chunk_hashes", "router: prompt chunk hashes"),
    ("tokenmill/router/", None, "router: decision, admission, first token / finish"),
    ("tokenmill/bench/", None, "workload: trace planning, records"),
    ("tokenmill/", None, "other tokenmill"),
]


def component(fn: tuple) -> str | None:
    path, _, name = fn
    path = path.replace("\\", "/")
    for frag, func, label in COMPONENTS:
        if frag in path and (func is None or func == name):
            return label
    return None


def attribute(stats: pstats.Stats) -> collections.Counter:
    """Own time per component; a non-tokenmill function's own time is split over its callers (recursively)."""
    raw = stats.stats
    out: collections.Counter = collections.Counter()

    def give(fn, t, depth=0):
        comp = component(fn)
        if comp is not None:
            out[comp] += t
            return
        callers = raw.get(fn, (0, 0, 0, 0, {}))[4]
        total = sum(v[2] for v in callers.values()) if callers else 0.0
        if depth > 12 or not callers or total <= 0:
            out["unattributed (library)"] += t
            return
        for caller, v in callers.items():
            give(caller, t * v[2] / total, depth + 1)

    for fn, (_, _, tt, _, _) in raw.items():
        if tt > 0:
            give(fn, tt)
    return out


SPY_ANCESTORS = [  # (a frame anywhere in the stack, component) for --py-spy
    ("Router.decide (", "router: decision (snapshot/table, policy, admission)"),
    ("Router._dispatch (", "router: dispatch bookkeeping (attempt, prefix index insert, metrics)"),
    ("Router.first_token (", "router: first token / finish (rates, metrics, pump)"),
    ("Router.finish (", "router: first token / finish (rates, metrics, pump)"),
    ("Turn.digest (", "workload: trace planning, records"),
]


def spy_component(stack: str) -> str:
    """A py-spy raw stack ("f (path:line);f (path:line);..."): the component of its deepest tokenmill frame."""
    if "EventLoop.run (" not in stack:
        return "outside the event loop (imports, building workers, results)"
    for frame, label in SPY_ANCESTORS:  # whole calls, whatever they call (first match wins)
        if frame in stack:
            return label
    for frame in reversed(stack.split(";")):
        m = re.match(r"(.*) \((.*):\d+\)$", frame)
        if m and "tokenmill/" in m.group(2):
            name = m.group(1).rsplit(".", 1)[-1].split("<locals>")[0].rstrip(".")
            return component((m.group(2), 0, name)) or "other tokenmill"
    return "unattributed (library)"


def run_plain(args, out: Path) -> tuple[int, float]:
    trace = out / "mooncake_shaped.jsonl"
    write_trace(trace, int(args.workers * args.per_worker_rate * args.duration * 1.1) + 10)
    cfg = SimConfig(model="llama-3.1-8b", hardware="h100", out=out / "run", workers=args.workers,
                    router=RouterConfig(), workloads=(f"trace:{trace}",),
                    load=LoadConfig("rate", rate=args.workers * args.per_worker_rate, duration_s=args.duration),
                    plots=False, record_chunks=False, token_free=args.token_free)
    result, sim = run_simulation(cfg)
    return result.runs[0].summary.requests, sim["levels"][0]["wall_s"]


def py_spy(args, out: Path) -> None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = out / "py-spy.txt"
    cmd = [exe, "record", "-r", "250", "-f", "raw", "-o", str(raw), "--", sys.executable, __file__, "--workers",
           str(args.workers), "--duration", str(args.duration), "--per-worker-rate", str(args.per_worker_rate),
           "--out", str(out), "--plain"] + (["--token-free"] if args.token_free else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy failed ({proc.returncode}): {proc.stderr[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("plain:")][-1]
    n, loop_s = int(line.split()[1]), float(line.split()[2])
    acc: collections.Counter = collections.Counter()
    for ln in raw.read_text().splitlines():
        stack, count = ln.rsplit(" ", 1)
        acc[spy_component(stack)] += int(count)
    outside = "outside the event loop (imports, building workers, results)"
    in_loop = sum(v for k, v in acc.items() if k != outside)
    print(f"ISA: {capabilities().summary()}")
    print(f"python {sys.version.split()[0]}; {args.workers} workers, {n} requests; event loop {loop_s:.1f} s "
          f"({1e3 * loop_s / n:.2f} ms per request), py-spy {sum(acc.values())} samples, {in_loop} in the loop")
    print("\n| component | samples | us per request | share of the loop |")
    print("|---|---:|---:|---:|")
    for label, c in acc.most_common():
        if label != outside:
            print(f"| {label} | {c} | {1e6 * loop_s * c / in_loop / n:.0f} | {100 * c / in_loop:.1f}% |")
    print(f"| all (event loop) | {in_loop} | {1e6 * loop_s / n:.0f} | 100% |")
    print(f"| ({outside}) | {acc[outside]} | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--per-worker-rate", type=float, default=1.5)
    ap.add_argument("--out", default="/tmp/sim_profile")
    ap.add_argument("--top", type=int, default=0, help="also print the top N functions by own time")
    ap.add_argument("--py-spy", action="store_true", help="sample the plain run with py-spy instead of cProfile")
    ap.add_argument("--token-free", action="store_true", help="prompts as the trace's block names (sim --token-free)")
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the run py-spy samples
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plain:
        n, loop_s = run_plain(args, out)
        print(f"plain: {n} {loop_s}")
        return
    if args.py_spy:
        return py_spy(args, out)
    trace = out / "mooncake_shaped.jsonl"
    write_trace(trace, int(args.workers * args.per_worker_rate * args.duration * 1.1) + 10)
    cfg = SimConfig(model="llama-3.1-8b", hardware="h100", out=out / "run", workers=args.workers,
                    router=RouterConfig(), workloads=(f"trace:{trace}",),
                    load=LoadConfig("rate", rate=args.workers * args.per_worker_rate, duration_s=args.duration),
                    plots=False, record_chunks=False, token_free=args.token_free)
    print(f"ISA: {capabilities().summary()}")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result, sim = run_simulation(cfg)
    prof.disable()
    lvl, n = sim["levels"][0], result.runs[0].summary.requests
    print(f"python {sys.version.split()[0]}; {args.workers} workers, {n} requests, {lvl['events']} events, "
          f"{lvl['steps']} engine steps; event loop {lvl['wall_s']:.1f} s under the profiler "
          f"({time.perf_counter() - t0:.1f} s with building the workers)")
    stats = pstats.Stats(prof)
    acc = attribute(stats)
    total = sum(acc.values())
    print("\n| component | s (profiled) | us per request | share |")
    print("|---|---:|---:|---:|")
    for label, t in acc.most_common():
        print(f"| {label} | {t:.2f} | {1e6 * t / n:.0f} | {100 * t / total:.1f}% |")
    print(f"| all (profiled run, workers' construction included) | {total:.2f} | {1e6 * total / n:.0f} | 100% |")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
