"""Routing policies on a shared-prefix workload over several local tokenmill workers; prints a table.

    python benchmarks/routing_policies.py --rate 3 --duration 40
    python benchmarks/routing_policies.py --policies prefix-load prefix --sglang-python /tmp/sgr/bin/python
    python benchmarks/routing_policies.py --policies prefix-load prefix-load@/tmp/old   # A/B: a router from another checkout
    python benchmarks/routing_policies.py --policies prefix-load prefix-load:miss_weight=3,guard_abs=8

    python benchmarks/routing_policies.py --workloads zipf0.8-512 zipf1.2-1024 hot --rate 12 30 \
        --admission leading off --policies prefix-load least-load      # admission on vs off, side by side

Workloads (`--workloads`): `hot`, a skewed shared-prefix mix — a share `--hot` of the sessions use one hot
system prompt, the rest spread over `--groups` more (`tokenmill bench --workload
shared-prefix:groups=1,...@0.7 --workload shared-prefix:groups=15,...@0.3`); `zipfS-L`, `--zipf-groups`
(32) system prompts of L tokens whose popularity is Zipf with exponent S (`shared-prefix:...,zipf=S`).
Each router runs in front of fresh workers (cold caches); with several `--admission` modes it runs each
of them in turn on the same workers (order rotated per repeat), and the table puts their goodput side by
side with the ratio to `off`, the refusals and the share of accepted requests within both SLOs. sglang-router's `cache_aware` runs when --sglang-python names
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
                            slugify, table, tokenmill_router, warm_up, worker_counters, workers)

POLICIES = ["round-robin", "least-load", "prefix", "prefix-load"]


def workloads(args, name: str = "hot") -> list[str]:
    """`hot`: a share --hot of the sessions on one system prompt, the rest over --groups more.
    `zipfS-L`: --zipf-groups system prompts of L tokens, popularity Zipf with exponent S (e.g. zipf1.2-1024)."""
    if name.startswith("zipf"):
        s, _, length = name[4:].partition("-")
        return [f"shared-prefix:groups={args.zipf_groups},prompts=64,system={int(length or args.system)},"
                f"question={args.question},output={args.output},zipf={float(s)}"]
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
    p.add_argument("--rate", type=float, nargs="+", default=[3.0], help="open-loop requests/s (several: each)")
    p.add_argument("--workloads", nargs="+", default=["hot"],
                   help="hot (one hot system prompt + --groups more) and/or zipfS-L (--zipf-groups system prompts "
                        "of L tokens, Zipf popularity exponent S), e.g. zipf0.8-512 zipf1.2-1024")
    p.add_argument("--zipf-groups", type=int, default=32)
    p.add_argument("--admission", nargs="+", default=["off"], choices=["leading", "lagging", "off"],
                   help="admission modes; several: each router runs each mode on the same workers, side by side")
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
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)  # the ISA beside every table

    out = args.out or Path(tempfile.mkdtemp(prefix="tokenmill-routing-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(Path(tempfile.gettempdir()) / "tokenmill-routing-tiny")
    router_port = args.base_port + 50
    for port in [router_port, *range(args.base_port, args.base_port + args.workers)]:
        check_port_free(port)
    routers = [(name, "tokenmill") for name in args.policies]
    if args.sglang_python:
        routers.append(("sglang-router cache_aware", "sglang"))
    report = []
    for wl_name in args.workloads:
        wl = workloads(args, wl_name)
        for rate in args.rate:
            runs: dict[tuple[str, str], list[dict]] = {}
            for rep in range(args.repeats):
                shift = rep % len(routers)  # rotate the order: the machine's background load drifts
                for name, kind in routers[shift:] + routers[:shift]:
                    modes = args.admission if kind == "tokenmill" else ["-"]
                    modes = modes[rep % len(modes):] + modes[:rep % len(modes)]
                    run_dir = out / slugify(f"{wl_name}-{rate:g}-{name}-{rep}")
                    run_dir.mkdir(exist_ok=True)
                    with workers(model, args.workers, args.base_port, args.kv_cache_size, run_dir) as urls:
                        warm_up(urls)
                        for mode in modes:  # the same workers for each admission mode of this router
                            policy, params, checkout = parse_router(name)
                            router = (tokenmill_router(urls, router_port, policy, mode, run_dir, checkout=checkout,
                                                       config={"policy_params": params} if params else None)
                                      if kind == "tokenmill"
                                      else sglang_router(urls, router_port, args.sglang_python, run_dir))
                            listed = None if kind == "tokenmill" else "unknown"
                            with router as target:
                                if args.warmup > 0:  # caches filled and rates learned at half the rate, not measured
                                    bench(target, run_dir / f"warmup-{mode}", model, wl, rate / 2, args.warmup,
                                          args.slo, args.seed, listed_model=listed)
                                before = [worker_counters(u) for u in urls]
                                result = bench(target, run_dir / f"bench-{mode}", model, wl, rate, args.duration,
                                               args.slo, args.seed, listed_model=listed)
                                estimates = router_estimates(target) if kind == "tokenmill" else {}
                            after = [worker_counters(u) for u in urls]
                            delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
                            r = row(name, result, delta)
                            sm = result["summary"]
                            r["good_of_accepted"] = sm["good"] / sm["completed"] if sm.get("completed") else 0.0
                            runs.setdefault((name, mode), []).append({**r, "router_metrics": estimates})
                            print(f"{wl_name} @{rate:g} {name} admission={mode} #{rep}: goodput {r['goodput']:.2f} "
                                  f"req/s, refused {r['rejected']}", file=sys.stderr, flush=True)
            rows = {key: mean_row(key[0], rs) for key, rs in runs.items()}
            report.append({"workload": wl_name, "rate": rate, "spec": wl,
                           "runs": {f"{k[0]} | {k[1]}": v for k, v in runs.items()}})
            print(f"\n### {wl_name} at {rate:g} req/s: {' + '.join(wl)}\n")
            print(admission_table(rows, args.admission))
            if len(args.admission) == 1:
                print()
                print(table(list(rows.values())))
    print(f"\n{args.workers} tokenmill workers (tiny model, 1 thread, KV {args.kv_cache_size} each), Poisson arrivals for "
          f"{args.duration:g}s, SLO {args.slo}" + (f", after a {args.warmup:g}s warm-up at half the rate" if args.warmup
                                                else "") + f", {args.repeats} repeat(s) averaged")
    (out / "routing_policies.json").write_text(json.dumps(report, indent=1))
    print(f"\nresults: {out}")
    return 0


def admission_table(rows: dict, modes: list[str]) -> str:
    """Per router: goodput under each admission mode side by side, its ratio to `off`, refusals, and the share
    of accepted (completed) requests that met both SLOs."""
    head = "| router | " + " | ".join(f"goodput {m}" for m in modes)
    cols = len(modes)
    if "off" in modes:
        others = [m for m in modes if m != "off"]
        head += "".join(f" | {m} / off" for m in others)
        cols += len(others)
    head += " | refused (of requests) | accepted within SLO |"
    cols += 2
    lines = [head, "|" + "---|" * (cols + 1)]
    for name in dict.fromkeys(k[0] for k in rows):
        got = {m: rows[(name, m)] for m in [*modes, "-"] if (name, m) in rows}
        cells = [f"{got[m]['goodput']:.2f}" if m in got else "-" for m in modes]
        if "-" in got:
            cells = [f"{got['-']['goodput']:.2f}"] * len(modes)
        if "off" in modes:
            for m in modes:
                if m != "off":
                    ok = m in got and "off" in got and got["off"]["goodput"] > 0
                    cells.append(f"{got[m]['goodput'] / got['off']['goodput']:.2f}x" if ok else "-")
        refused = " / ".join(f"{m}: {100 * r['rejected'] / r['requests']:.1f}%" for m, r in got.items() if r["requests"])
        within = " / ".join(f"{m}: {100 * r['good_of_accepted']:.0f}%" for m, r in got.items())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {refused} | {within} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
