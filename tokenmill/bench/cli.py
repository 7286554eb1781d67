"""`tokenmill bench`: goodput under SLOs against any OpenAI-compatible server.

    tokenmill bench --target http://127.0.0.1:8000 --workload chat --rate 4 --num-requests 200 --out results/chat
    tokenmill bench --target URL --workload agent:repo=2048,max_context=8192 --concurrency 8 --duration 60 --out r/
    tokenmill bench --target URL --workload shared-prefix:groups=8,prompts=8 --sweep --out r/sweep
    tokenmill bench --target URL --workload trace:../shared/traces/mooncake_synthetic_trace.jsonl,time_scale=0.1 \\
        --num-requests 300 --out r/mooncake
    tokenmill bench --target URL --workload mix:chat=0.7,batch=0.3 --rate 2 --slo interactive:ttft=500,tpot=50 --out r/
    tokenmill bench --target URL --workload chat:think_s=0@3 --workload batch:output=64@1 --rate 2 --out r/
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from tokenmill.bench.arrivals import ARRIVALS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure goodput under SLOs against an OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the first listed by GET /v1/models)")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json for exact prompt lengths "
                   "(default: --model when it is a local directory; else an approximation the report states)")
    add_workload_args(p)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--prompt-format", choices=["tokens", "text"],
                   help="tokens: token-id prompts, exact lengths (default with a tokenizer on completions)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    p.add_argument("--extra-body", metavar="JSON", help="fields merged into every request body")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                   help="live progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload, arrival, load, SLO, sweep and output flags: `tokenmill bench` and `tokenmill sim` share
    them (same names, same meaning), so one line switches a benchmark between a server and the simulator."""
    p.add_argument("--workload", action="append", metavar="SPEC",
                   help="chat | agent | batch | code | shared-prefix | trace:FILE | mix:NAME=W,... ; parameters as "
                   "NAME:key=value,... ; repeat as SPEC@WEIGHT for a mix (default: chat)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open loop: requests/s (with --sweep: the first rate tried)")
    load.add_argument("--concurrency", type=int, help="closed loop: sessions in flight at once")
    p.add_argument("--sweep", action="store_true", help="find the highest rate with SLO attainment >= target")
    p.add_argument("--arrival", choices=sorted(ARRIVALS), default="poisson", help="open-loop arrival process")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (< 1: burstier than Poisson)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--duration", type=float, metavar="S", help="send no request after S seconds")
    limit.add_argument("--num-requests", type=int, metavar="N", help="send N requests (default 100; traces: all)")
    p.add_argument("--slo", action="append", metavar="CLASS:ttft=MS,tpot=MS",
                   help="override a class's SLO (repeatable; without CLASS: every class; e2e=MS also accepted)")
    p.add_argument("--out", required=True, metavar="DIR", help="where result.json, summary.md and plots go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-target", type=float, default=0.9, help="SLO attainment a rate must reach")
    p.add_argument("--sweep-trials", type=int, default=8, help="at most this many load levels")
    p.add_argument("--sweep-tol", type=float, default=0.1, help="stop when (hi - lo) / hi <= this")
    p.add_argument("--no-plots", action="store_true")


def run(args: argparse.Namespace) -> int:
    from tokenmill.bench.benchmark import run_benchmark
    from tokenmill.bench.config import BenchConfig
    from tokenmill.bench.report import write_report

    # the command as typed when run from a shell; in-process callers (tests) record just the subcommand
    args.command_line = ["tokenmill", *sys.argv[1:]] if sys.argv[1:2] == ["bench"] else ["tokenmill", "bench"]
    cfg = BenchConfig.from_args(args)
    result = asyncio.run(run_benchmark(cfg))
    write_report(result, cfg.out, plots=cfg.plots)
    best = result.best
    if result.sweep is not None:
        print(f"max rate with SLO attainment >= {100 * cfg.sweep.target:.0f}%: {result.sweep.max_rate:.3g} req/s "
              f"({len(result.runs)} trials)")
    if best is not None:
        print_run(best)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {cfg.out}/result.json, {cfg.out}/summary.md")
    completed = sum(r.summary.completed for r in result.runs)
    return 0 if completed else 1


def print_run(run) -> None:
    """Two lines on one run: counts, goodput and attainment; TTFT / TPOT percentiles (bench and sim)."""
    s = run.summary
    print(f"{run.label}: {s.completed}/{s.requests} completed, {s.rejected} rejected, {s.failed} failed; "
          f"goodput {s.goodput:.2f} req/s ({s.goodput_output_throughput:.1f} tok/s), "
          f"attainment {100 * (s.slo_attainment or 0):.1f}%, throughput {s.request_throughput:.2f} req/s")
    if s.ttft_ms:
        tpot = f"{s.tpot_ms.p50:.1f}/{s.tpot_ms.p99:.1f}" if s.tpot_ms else "-"
        print(f"TTFT p50/p99 {s.ttft_ms.p50:.1f}/{s.ttft_ms.p99:.1f} ms, TPOT p50/p99 {tpot} ms")
