"""Routing policies on a shared-prefix workload over several local tokenmill workers; prints a table.

    python benchmarks/routing_policies.py --rate 3 --duration 40
    python benchmarks/routing_policies.py --policies prefix-load prefix --sglang-python /tmp/sgr/bin/python
    python benchmarks/routing_policies.py --policies prefix-load prefix-load@/tmp/old   # A/B: a router from another checkout
    python benchmarks/routing_policies.py --policies prefix-load prefix-load:miss_weight=3,guard_abs=8

Workload: a skewed shared-prefix mix — a share `--hot` of the sessions use one hot system prompt, the
rest spread over `--groups` more (`tokenmill bench --workload shared-prefix:groups=1,...@0.7 --workload
shared-prefix:groups=15,...@0.3`). Each router runs in front of fresh workers (cold caches) with admission
control off, so only the routing differs. sglang-router's `cache_aware` runs when --sglang-python names
an interpreter that has `sglang-router` installed (keep it out of tokenmill's environment).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from routing_common import (bench, check_port_free, make_model, router_estimates, row, sglang_router,  # noqa: E402
                            table, tokenmill_router, warm_up, worker_counters, workers)

POLICIES = ["round-robin", "least-load", "prefix", "prefix-load"]


def workloads(args) -> list[str]:
    shape = f"system={args.system},question={args.question},output={args.output}"
    return [f"shared-prefix:groups=1,prompts=256,{shape}@{args.hot}",
            f"shared-prefix:groups={args.groups},prompts=64,{shape}@{1 - args.hot:g}"]


def parse_router(spec: str) -> tuple[str, dict, str | None]:
    """`POLICY[:KEY=VALUE,...][@DIR]` -> (policy, policy_params, checkout), e.g. prefix-load:miss_weight=3@/tmp/old."""
    spec, _, checkout = spec.partition("@")
    policy, _, kv = spec.partition(":")
    params = {}
    for item in filter(None, kv.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--policies {spec!r}: expected KEY=VALUE after ':', got {item!r}")
        params[key] = json.loads(value)
    return policy, params, checkout or None


def mean_row(name: str, rs: list[dict]) -> dict:
    """The average of several runs' rows. Requests per worker: each run's counts sorted busiest first, then
    averaged (which worker ends up hot differs from run to run, so summing by port would hide a hot spot)."""
    avg = {k: (sum(r[k] for r in rs) / len(rs) if all(r[k] is not None for r in rs) else None)
           for k in rs[0] if isinstance(rs[0][k], (int, float))}
    ranked = [sorted(r["per_worker"], reverse=True) for r in rs]
    return {**avg, "router": name, "per_worker": [round(sum(c) / len(rs)) for c in zip(*ranked)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate", type=float, default=3.0, help="open-loop requests/s")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per router")
    p.add_argument("--system", type=int, default=768, help="tokens of each shared system prompt")
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--hot", type=float, default=0.5, help="share of sessions on the one hot system prompt")
    p.add_argument("--groups", type=int, default=5, help="other system prompts")
    p.add_argument("--kv-cache-size", default="8MiB", help="per worker: 4096 tokens, not all 6 system prompts")
    p.add_argument("--slo", default="interactive:ttft=1000,tpot=100")
    p.add_argument("--policies", nargs="*", default=POLICIES,
                   help="tokenmill policies to run (none: only sglang); POLICY:KEY=VALUE,... sets policy_params "
                        "(e.g. prefix-load:miss_weight=3); POLICY@DIR runs the router from the checkout DIR (e.g. a "
                        "`git worktree` of an older commit)")
    p.add_argument("--sglang-python", help="python of a venv with sglang-router installed")
    p.add_argument("--base-port", type=int, default=18300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of the same workload (same seed: the same system prompts) at half the rate before the "
                        "measured run, not counted: routers are measured warm, not on a cold start at full load")
    p.add_argument("--repeats", type=int, default=1, help="runs per router, in rotating order; the table averages")
    p.add_argument("--out", type=Path, default=None, help="keep bench results and logs here")
    args = p.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="tokenmill-routing-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(Path(tempfile.gettempdir()) / "tokenmill-routing-tiny")
    router_port = args.base_port + 50
    for port in [router_port, *range(args.base_port, args.base_port + args.workers)]:
        check_port_free(port)
    routers = [(name, "tokenmill") for name in args.policies]
    if args.sglang_python:
        routers.append(("sglang-router cache_aware", "sglang"))
    runs: dict[str, list[dict]] = {name: [] for name, _ in routers}
    for rep in range(args.repeats):
        shift = rep % len(routers)  # rotate the order: the machine's background load drifts
        for name, kind in routers[shift:] + routers[:shift]:
            run_dir = out / f"{name.replace(' ', '_').replace('/', '_')}-{rep}"
            run_dir.mkdir(exist_ok=True)
            with workers(model, args.workers, args.base_port, args.kv_cache_size, run_dir) as urls:
                warm_up(urls)
                policy, params, checkout = parse_router(name)
                router = (tokenmill_router(urls, router_port, policy, "off", run_dir, checkout=checkout,
                                           config={"policy_params": params} if params else None)
                          if kind == "tokenmill"
                          else sglang_router(urls, router_port, args.sglang_python, run_dir))
                with router as target:
                    if args.warmup > 0:  # caches filled and rates learned at half the rate, not measured
                        bench(target, run_dir / "warmup", model, workloads(args), args.rate / 2, args.warmup,
                              args.slo, args.seed, listed_model=None if kind == "tokenmill" else "unknown")
                    result = bench(target, run_dir / "bench", model, workloads(args), args.rate, args.duration,
                                   args.slo, args.seed, listed_model=None if kind == "tokenmill" else "unknown")
                    estimates = router_estimates(target) if kind == "tokenmill" else {}
                runs[name].append({**row(name, result, [worker_counters(u) for u in urls]),
                                   "router_metrics": estimates})
            print(f"{name} #{rep}: goodput {runs[name][-1]['goodput']:.2f} req/s", file=sys.stderr, flush=True)
    rows = [mean_row(name, rs) for name, rs in runs.items()]
    print(f"{args.workers} tokenmill workers (tiny model, 1 thread, KV {args.kv_cache_size} each), "
          f"{args.rate:g} req/s Poisson for {args.duration:g}s, shared-prefix system={args.system} "
          f"question={args.question} output={args.output}, {100 * args.hot:g}% on one hot prefix + {args.groups} "
          f"more, SLO {args.slo}" + (f", after a {args.warmup:g}s warm-up at {args.rate / 2:g} req/s" if args.warmup
                                       else "") + "\n")
    print(table(rows))
    if args.repeats > 1:
        each = {name: ", ".join(f"{r['goodput']:.2f}" for r in rs) for name, rs in runs.items()}
        print("\ngoodput of each run (req/s): " + "; ".join(f"{name}: {g}" for name, g in each.items()))
    (out / "routing_policies.json").write_text(json.dumps(runs, indent=1))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
