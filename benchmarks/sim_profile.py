"""Where `tokenmill sim`'s event loop spends its time per request, by component (cProfile), on the same
synthetic Mooncake-shaped trace and cluster as benchmarks/sim_speed.py.

    flock /tmp/cpu.lock python benchmarks/sim_profile.py --workers 1000 --duration 4

Every function's own time (cProfile tottime) goes to the component of the tokenmill file it is in; time in
library code (numpy, prometheus_client, hashlib, builtins) goes to the tokenmill functions that called it, in
proportion to their calls' time. Times are under the profiler (~1.3-1.8x the plain run); shares are of the
profiled event loop.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--per-worker-rate", type=float, default=1.5)
    ap.add_argument("--out", default="/tmp/sim_profile")
    ap.add_argument("--top", type=int, default=0, help="also print the top N functions by own time")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "mooncake_shaped.jsonl"
    write_trace(trace, int(args.workers * args.per_worker_rate * args.duration * 1.1) + 10)
    cfg = SimConfig(model="llama-3.1-8b", hardware="h100", out=out / "run", workers=args.workers,
                    router=RouterConfig(), workloads=(f"trace:{trace}",),
                    load=LoadConfig("rate", rate=args.workers * args.per_worker_rate, duration_s=args.duration),
                    plots=False, record_chunks=False)
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
