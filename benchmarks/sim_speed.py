"""Speed of `tokenmill sim`: events per second and wall time per simulated worker-hour, on Mooncake-shaped
traffic, at several cluster sizes; then an extrapolation to 1,000 workers x 1 hour from a fitted cost.

    flock /tmp/cpu.lock python benchmarks/sim_speed.py --workers 4,16,64 --duration 60

The trace: a synthetic Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids of 512-token
blocks) shaped like the published Mooncake conversation trace -- lognormal inputs with mean ~7.6k tokens,
outputs mean ~180 tokens, and about half of the requests opening with one of 64 shared prefixes of 1-8
blocks (the rest unique) -- written to --out. The model/hardware: Llama-3.1-8B on one H100 per worker
(roofline), prefix-load routing with leading admission, `--no-token-times` (no per-token record). The load is
`--per-worker-rate` requests/s per worker. Wall time is split by a least-squares fit

    wall_s = a x events + b x requests + c x requests x workers      (c: the router's O(N) snapshot)

and the target is extrapolated from the fit (with the events and requests per worker-second measured).
`--stepping`: each size also runs with fast-forward off (every decode step an event), same trace, and the
table gets the wall-time ratio and a check that both runs gave the same per-request results.
`--compare-block-size 16`: each size also runs with 16-token KV blocks (the default for this trace is its
512-token hash block, `tokenmill sim`'s auto), side by side: wall time and the simulated results.
`--split`: where the event loop's time goes per request (router decision, trace planning, hashing).
`--token-free`: prompts as the trace's block names (`tokenmill sim --token-free`, engine/kv/named_tokens.py).
`--compare-token-ids`: each size runs token-free and with token ids, same trace, side by side: wall time, and a
check that both gave the same per-request results (records equal but for their digest).
`--compare-full`: each size also runs with the router deciding on the full snapshot (RouterConfig.snapshot
"full": a WorkerView of every worker per decision) instead of its worker table, same trace, side by side: wall
time, and a check that both runs gave the same per-request results.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

from tokenmill.bench.runner import LoadConfig
from tokenmill.hardware import capabilities
from tokenmill.router.config import RouterConfig
from tokenmill.sim.simulation import SimConfig, run_simulation


def write_trace(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    prefixes = [list(range(1000 * i, 1000 * i + int(rng.integers(1, 9)))) for i in range(64)]
    next_id = 10**7
    with path.open("w") as f:
        for i in range(n):
            inp = int(min(max(64, rng.lognormal(np.log(7600) - 0.5, 1.0)), 120000))
            out = int(min(max(1, rng.lognormal(np.log(180) - 0.32, 0.8)), 2000))
            blocks = -(-inp // 512)
            ids = list(prefixes[int(rng.integers(64))][:blocks]) if rng.random() < 0.5 else []
            ids += list(range(next_id, next_id + blocks - len(ids)))
            next_id += blocks
            f.write(json.dumps({"timestamp": i * 1000, "input_length": inp, "output_length": out, "hash_ids": ids}) + "\n")


SPLIT_LABELS = {  # (module, class or None, attribute) -> label; router.snapshot is inside router.decide
    ("tokenmill.router.router", "Router", "decide"): "router.decide",
    ("tokenmill.router.router", "Router", "snapshot"): "router.snapshot",
    ("tokenmill.bench.workloads.trace", "Trace", "session"): "trace planning",
    ("tokenmill.sim.cluster", None, "chunk_hashes"): "router chunk hashes",
    ("tokenmill.sim.worker", "SimWorker", "cached_prefix_tokens"): "dispatch prefix lookup",
    # the per-request floor: work on every prompt token, and the real scheduler's calls
    ("tokenmill.sim.cluster", None, "block_hashes_of_array"): "KV block hashes",
    ("tokenmill.bench.session", "Turn", "digest"): "record digest",
    ("tokenmill.bench.session", "Turn", "flat_tokens"): "prompt array",
    ("tokenmill.engine.scheduler", "Scheduler", "schedule"): "Scheduler.schedule",
    # the rest of the real engine and router code a request goes through (the floor: FLOOR_LABELS)
    ("tokenmill.engine.scheduler", "Scheduler", "add"): "Scheduler.add",
    ("tokenmill.engine.scheduler", "Scheduler", "finish"): "Scheduler.finish",
    ("tokenmill.engine.step_budget", "StepBudget", "budget_for"): "StepBudget.budget_for",
    ("tokenmill.engine.step_budget", "StepBudget", "observe"): "StepBudget.observe",
    ("tokenmill.engine.step_budget", "StepBudget", "observe_many"): "StepBudget.observe_many",
    ("tokenmill.router.router", "Router", "first_token"): "Router.first_token",
    ("tokenmill.router.router", "Router", "output_tokens"): "Router.output_tokens",
    ("tokenmill.router.router", "Router", "finish"): "Router.finish",
}
# the code item 1 of the issue requires the sim to run (the real scheduler + KV manager, step budget, router
# decision and bookkeeping), timed where the sim calls it: what a request costs the loop at the least, whatever
# the sim's own code around it costs (dispatch prefix lookup: the real KVCacheManager's, through SimWorker)
FLOOR_LABELS = ("router.decide", "dispatch prefix lookup", "Scheduler.schedule", "Scheduler.add", "Scheduler.finish",
                "StepBudget.budget_for", "StepBudget.observe", "StepBudget.observe_many", "Router.first_token",
                "Router.output_tokens", "Router.finish")
CALLS: collections.Counter = collections.Counter()  # calls per label (--split)


def _instrument(acc: collections.Counter) -> None:
    import importlib

    for (mod, cls, attr), label in SPLIT_LABELS.items():
        owner = importlib.import_module(mod)
        owner = getattr(owner, cls) if cls else owner
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] += time.perf_counter() - t
                CALLS[_label] += 1

        setattr(owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="4,16,64")
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals per run")
    ap.add_argument("--per-worker-rate", type=float, default=1.5, help="requests/s per worker")
    ap.add_argument("--out", default="/tmp/sim_speed")
    ap.add_argument("--stepping", action="store_true", help="also run every size with fast-forward off")
    ap.add_argument("--block-size", type=int, default=None,
                    help="simulated KV block tokens (default: tokenmill sim's auto, the trace's 512)")
    ap.add_argument("--compare-block-size", type=int, default=None, metavar="N",
                    help="instead of --stepping: also run every size with N-token KV blocks (and the router's "
                         "prefix chunks at N), same trace, to show the block size's effect on speed and results")
    ap.add_argument("--compare-full", action="store_true",
                    help="also run every size with the router on the full snapshot (the decision path before the "
                         "worker table), same trace: wall time ratio and same-results check")
    ap.add_argument("--token-free", action="store_true", help="prompts as the trace's block names (sim --token-free)")
    ap.add_argument("--compare-token-ids", action="store_true",
                    help="run token-free, and also with token ids, same trace: wall time ratio and same-results check")
    ap.add_argument("--split", action="store_true",
                    help="time the router's decision (snapshot, policy, admission), trace planning and chunk hashing "
                         "per request (wrappers around them: adds a little overhead) and print where the time goes")
    args = ap.parse_args()
    if sum(map(bool, (args.stepping, args.compare_block_size, args.compare_full, args.compare_token_ids))) > 1:
        ap.error("--stepping, --compare-block-size, --compare-full, --compare-token-ids: one comparison per run")
    if args.compare_token_ids:
        args.token_free = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(w) for w in args.workers.split(",")]
    trace = out / "mooncake_shaped.jsonl"
    n = int(max(sizes) * args.per_worker_rate * args.duration * 1.1) + 10
    write_trace(trace, n)
    print(f"ISA: {capabilities().summary()}")
    print(f"python {sys.version.split()[0]}; trace {trace} ({n} rows)")
    rows, split, splits = [], collections.Counter(), []
    if args.split:
        _instrument(split)
    for w in sizes:
        runs = []
        tf = args.token_free
        variants = [(True, args.block_size, "table", tf)] + \
            ([(False, args.block_size, "table", tf)] if args.stepping else []) + \
            ([(True, args.compare_block_size, "table", tf)] if args.compare_block_size else []) + \
            ([(True, args.block_size, "full", tf)] if args.compare_full else []) + \
            ([(True, args.block_size, "table", False)] if args.compare_token_ids else [])
        for ff, bs, snap, token_free in variants:
            cfg = SimConfig(model="llama-3.1-8b", hardware="h100", out=out / f"w{w}", workers=w,
                            router=RouterConfig(snapshot=snap), workloads=(f"trace:{trace}",),
                            load=LoadConfig("rate", rate=w * args.per_worker_rate, duration_s=args.duration),
                            plots=False, record_chunks=False, fast_forward=ff, block_size=bs, token_free=token_free)
            split.clear()
            CALLS.clear()
            t0 = time.perf_counter()
            result, sim = run_simulation(cfg)
            if args.split and (ff, bs, snap, token_free) == variants[0]:
                splits.append((w, result.runs[0].summary.requests, sim["levels"][0]["wall_s"], dict(split),
                               dict(CALLS)))
            lvl = dict(sim["levels"][0], total_s=time.perf_counter() - t0, block_size=sim["worker"]["block_size"])
            runs.append((result, lvl))
        (result, lvl), s = runs[0], runs[0][0].runs[0].summary
        other = runs[1] if len(runs) > 1 else None
        drop = {"digest"} if args.compare_token_ids else set()  # a token-free record's digest is of the names
        same = other is not None and [{k: v for k, v in r.to_json().items() if k not in drop}
                                      for r in result.runs[0].records] == \
            [{k: v for k, v in r.to_json().items() if k not in drop} for r in other[0].runs[0].records]
        rows.append((w, s.requests, lvl["steps"], lvl["events"], lvl["wall_s"], lvl["simulated_s"], s,
                     other, same, lvl, result))
    print(f"KV block size {rows[0][9]['block_size']} tokens" + (f" (compared: {args.compare_block_size})"
                                                               if args.compare_block_size else ""))
    if args.compare_block_size:
        print("\n| workers | requests | wall s | events/s | with build s | completed | TTFT p50 ms | TTFT p90 ms | "
              f"TPOT p50 ms | hit % | {args.compare_block_size}-token blocks: wall s | with build s | completed | "
              "TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | hit % | x faster (loop) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for w, req, steps, ev, wall, simulated, s, other, same, lvl, res in rows:
            ol = other[1]

            def cols(x, t):
                hit = 100 * sum(r.cached_tokens or 0 for r in x.records) / max(1, sum(r.prompt_tokens for r in x.records))
                m = x.summary
                return (f"{m.completed} | {m.ttft_ms.p50 if m.ttft_ms else 0:.0f} | {m.ttft_ms.p90 if m.ttft_ms else 0:.0f}"
                        f" | {m.tpot_ms.p50 if m.tpot_ms else 0:.2f} | {hit:.1f}")
            print(f"| {w} | {req} | {wall:.1f} | {ev / wall:.0f} | {lvl['total_s']:.1f} | {cols(res.runs[0], lvl)} | "
                  f"{ol['wall_s']:.1f} | {ol['total_s']:.1f} | {cols(other[0].runs[0], ol)} | {ol['wall_s'] / wall:.1f} |")
    versus = "full snapshot" if args.compare_full else "token ids" if args.compare_token_ids else "stepping"
    print(f"prompts: {'token-free (block names)' if args.token_free else 'token ids'}")
    print("\n| workers | requests | engine steps | events | wall s | events/s | steps/s | simulated s | "
          f"sim-s per wall-s | completed | TTFT p50 ms | TPOT p50 ms | {versus}: events | wall s | x faster | "
          f"same results | ms/request | CPU ms/request | {versus}: CPU ms/request | x less CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for w, req, steps, ev, wall, simulated, s, other, same, lvl, _ in rows:
        step = other[1] if other and (args.stepping or args.compare_full or args.compare_token_ids) else None
        st = (f"{step['events']} | {step['wall_s']:.1f} | {step['wall_s'] / wall:.1f} | {'yes' if same else 'NO'}"
              if step else "- | - | - | -")
        print(f"| {w} | {req} | {steps} | {ev} | {wall:.1f} | {ev / wall:.0f} | {steps / wall:.0f} | "
              f"{simulated:.0f} | {simulated / wall:.2f} | {s.completed} | {s.ttft_ms.p50 if s.ttft_ms else 0:.0f} | "
              f"{s.tpot_ms.p50 if s.tpot_ms else 0:.1f} | {st} | {1e3 * wall / req:.2f} | "
              f"{1e3 * lvl['cpu_s'] / req:.2f} | " +
              (f"{1e3 * step['cpu_s'] / req:.2f} | {step['cpu_s'] / lvl['cpu_s']:.2f} |" if step else "- | - |"))
    if splits:
        print("\nwhere the event loop's time goes, per request (us; --split):\n")
        labels = list(SPLIT_LABELS.values())
        print("| workers | loop ms/request | " + " | ".join(labels) + " | other (engine, events) | routing per worker |")
        print("|---:|---:|" + "---:|" * (len(labels) + 2))
        for w, req, wall, acc, calls in splits:
            per = {k: 1e6 * acc.get(k, 0.0) / req for k in labels}
            other = 1e6 * wall / req - sum(v for k, v in per.items() if k != "router.snapshot")
            print(f"| {w} | {1e3 * wall / req:.2f} | " + " | ".join(f"{per[k]:.0f}" for k in labels) +
                  f" | {other:.0f} | {per['router.decide'] / w:.1f} |")
        for w, req, wall, acc, calls in splits:
            floor = sum(1e6 * acc.get(k, 0.0) / req for k in FLOOR_LABELS)
            total = 1000 * args.per_worker_rate * 3600.0
            print(f"\n{w} workers: the real engine/router code alone (FLOOR_LABELS) takes {floor:.0f} us per request "
                  f"of the loop's {1e6 * wall / req:.0f} us; 1,000 workers x 1 h = {total / 1e6:.1f} M requests x "
                  f"{floor:.0f} us = {total * floor / 1e6 / 60:.0f} min for that code alone (target: 10 min)")
        print("\ncalls per request and us per call:", "; ".join(
            f"{k} {calls.get(k, 0) / req:.2f} x {1e6 * acc.get(k, 0.0) / max(1, calls.get(k, 0)):.1f}"
            for k in labels))
    x = np.array([[ev, req, req * w] for w, req, steps, ev, *_ in rows], dtype=float)
    y = np.array([r[4] for r in rows])
    from tokenmill.sim.cost_model import nnls

    a, b, c = nnls(x, y)
    events_per_worker_s = np.mean([r[3] / (r[0] * r[5]) for r in rows])
    target_w, target_s = 1000, 3600.0
    req_total = target_w * args.per_worker_rate * target_s
    events_total = events_per_worker_s * target_w * target_s
    est = a * events_total + b * req_total + c * req_total * target_w
    print(f"\nfit: {1e6 * a:.1f} us per event, {1e3 * b:.2f} ms per request, {1e6 * c:.2f} us per request per "
          f"worker (routing snapshot)")
    print(f"1,000 workers x 1 h at {args.per_worker_rate:g} req/s/worker: {req_total:.3g} requests, "
          f"{events_total:.3g} events -> {est / 60:.0f} min wall (one process) "
          f"[{a * events_total / 60:.0f} events + {b * req_total / 60:.0f} requests + "
          f"{c * req_total * target_w / 60:.0f} routing]")


if __name__ == "__main__":
    main()
