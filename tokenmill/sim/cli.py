"""`tokenmill sim`: the real scheduler, KV manager, router policies and admission on a virtual clock.

    tokenmill sim calibrate --model demo --out profiles/this-cpu.json       # measure this machine (~1-2 min)
    tokenmill sim --model demo --hardware profiles/this-cpu.json --workers 1 --workload chat --rate 2 --out r/sim
    tokenmill sim --model qwen3-32b --hardware h100 --tp 2 --workers 8 --router prefix-load \\
        --workload shared-prefix:groups=150,prompts=5,system=6000,question=1200 --rate 40 --duration 120 --out r/
    tokenmill sim --model llama-3.1-405b --hardware b300 --tp 8 --dtype fp8 --price-per-hour 6 --sweep --out r/

Every workload, arrival, SLO, sweep and --out flag is `tokenmill bench`'s (same names, same meaning), and
the output is the bench's result.json / summary.md / plots, with a `sim` section added to result.json.
--hardware is a calibration profile (JSON from `tokenmill sim calibrate`) or a catalog GPU (h100, h200,
b200, b300: roofline cost model). --model is a catalog name (llama-3.1-8b/70b/405b, qwen3-32b, deepseek-v3),
a shipped model (demo) or a directory / config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from tokenmill.bench.cli import add_workload_args
    from tokenmill.router.admission import MODES
    from tokenmill.router.policies import POLICIES

    p = subparsers.add_parser("sim", help="simulate N workers + router on a virtual clock (real scheduler/policies)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="catalog name, shipped model or directory / config.json")
    p.add_argument("--hardware", help="calibration profile JSON, or h100 | h200 | b200 | b300")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--router", choices=sorted(POLICIES), help="routing policy (default: the router's, prefix-load)")
    p.add_argument("--admission", choices=MODES, help="router admission control (default: the router's, leading)")
    p.add_argument("--router-config", metavar="FILE", help="a `tokenmill route` config (JSON/TOML); workers ignored")
    add_workload_args(p)
    for a in p._actions:  # `sim calibrate --out` is the calibrate subcommand's; checked in run()
        if a.dest == "out":
            a.required = False
    g = p.add_argument_group("cost model and workers")
    g.add_argument("--tp", type=int, default=1, help="GPUs per worker (roofline)")
    g.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "fp4"], help="weights and math (roofline)")
    g.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per cached KV value (roofline; fp8 KV: 1)")
    g.add_argument("--mfu", type=float, default=0.5, help="share of peak FLOPs a step gets (roofline)")
    g.add_argument("--mbu", type=float, default=0.8, help="share of peak HBM bandwidth (roofline)")
    g.add_argument("--step-overhead-ms", type=float, default=2.0, help="per-step overhead (roofline)")
    g.add_argument("--kv-cache-bytes", help="KV cache per worker (default: the profile's engine, or HBM left)")
    g.add_argument("--block-size", type=int, help="tokens per simulated KV block (default: 16, or a Mooncake "
                   "trace's 512-token hash block for `--workload trace:` of one: it names sharing no finer)")
    g.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (default: profile's, or 8192)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-step-budget", action="store_true", help="do not size steps to the TPOT SLO")
    g.add_argument("--price-per-hour", type=float, help="USD per GPU-hour: cost per request and per million tokens")
    g.add_argument("--no-fast-forward", action="store_true",
                   help="step every decode step (default: steady decode runs in one event, same results)")
    t = p.add_argument_group("KV tiers below the pool (as `tokenmill serve`; sim/tiers.py)")
    t.add_argument("--kv-host-bytes", help="host DRAM tier per worker, e.g. 64GiB (default 0: off)")
    t.add_argument("--kv-disk-bytes", help="local disk tier per worker, e.g. 1TiB (default 0: off)")
    t.add_argument("--kv-host-shared", action="store_true",
                   help="one host tier of --kv-host-bytes for all workers (one host's /dev/shm)")
    t.add_argument("--kv-load-timeout-s", type=float, default=1.0, help="a tier load past this recomputes")
    t.add_argument("--kv-host-bw", type=float, metavar="GB/s", help="host tier read/write by one thread "
                   "(memcpy from /dev/shm; default 10)")
    t.add_argument("--kv-disk-read-bw", type=float, metavar="GB/s", help="disk tier read (default 6)")
    t.add_argument("--kv-disk-write-bw", type=float, metavar="GB/s", help="disk tier write (default 3)")
    t.add_argument("--kv-disk-latency-us", type=float, help="per disk block read/write (default 80)")
    t.add_argument("--kv-checksum-bw", type=float, metavar="GB/s", help="CRC-32 of each entry (default 4)")
    t.add_argument("--kv-link-bw", type=float, metavar="GB/s", help="pool <-> host copies on the engine thread "
                   "(default: the catalog GPU's PCIe per GPU x --tp; a calibrated CPU: memcpy, 50)")
    g.add_argument("--no-token-times", action="store_true", help="do not keep every token's time (big runs)")
    g.add_argument("--token-free", action="store_true",
                   help="Mooncake trace only: prompts as their hash_ids block names, no token ids (much faster; the "
                        "same schedule; records' digest of the names)")
    sp = p.add_argument_group("speculative decoding (the engine's SpecDecoder: auto policy and guard, or a fixed k)")
    sp.add_argument("--speculative-model", help="ngram | a draft model: its catalog name or config.json on a catalog "
                    "GPU (roofline), its calibration profile JSON on a calibration profile (as `tokenmill serve`)")
    sp.add_argument("--num-speculative-tokens", help="K | auto (as `tokenmill serve`)")
    sp.add_argument("--speculative-max-k", type=int, help="auto's largest k (default: the engine's: ngram 8, draft 6)")
    sp.add_argument("--spec-acceptance", metavar="ALPHA[:span=L]",
                    help="share of output positions a draft gets right, in runs of mean length L (default: "
                         "independent positions, a draft model's; a long span: n-gram's repeated spans)")
    sp.add_argument("--spec-lookup-us", type=float, default=15.0, help="n-gram: microseconds per lookup")
    sub = p.add_subparsers(dest="sim_command", metavar="calibrate|scenario")
    sc = sub.add_parser("scenario", help="run a shipped scenario (or a scenario file): its sim runs side by side",
                        description="Run the `tokenmill sim` runs of a scenario and compare them in one table "
                                    "(OUT/scenario.md; each run's result.json in OUT/NN-name/). Shipped: "
                                    "tokenmill/sim/scenarios/*.json; documented results: docs/benchmarks/sim.md.")
    sc.add_argument("scenario", nargs="?", help="a shipped scenario's name or a scenario JSON file (omit: list them)")
    sc.add_argument("--out", dest="scenario_out", metavar="DIR", help="output directory")
    sc.add_argument("--quick", action="store_true", help="the scenario's shortened runs (a smoke check)")
    sc.add_argument("--only", metavar="RUN[,RUN...]", help="run only these of its runs (by name)")
    sc.set_defaults(func=run_scenario_command)
    c = sub.add_parser("calibrate", help="measure this machine's engine step times and fit the cost model",
                       description="Measure the real engine's step times over a grid and fit the calibrated cost model.")
    c.add_argument("--model", required=True, help="shipped model name or HF-format directory")
    c.add_argument("--out", required=True, metavar="PROFILE.json")
    c.add_argument("--kv-cache-bytes", default="256MiB")
    c.add_argument("--max-num-batched-tokens", type=int, default=2048)
    c.add_argument("--num-threads", type=int, help="torch threads (as `tokenmill serve --num-threads`)")
    c.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (as `tokenmill serve --device`)")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype (as `tokenmill serve --dtype`)")
    c.add_argument("--quantization", default="none", choices=["none", "int8", "fp8"], help="weights (as `tokenmill serve --quantization`)")
    c.add_argument("--max-model-len", type=int, help="as `tokenmill serve --max-model-len` (CUDA graphs' buckets "
                   "shrink as it grows)")
    c.add_argument("--cuda-graphs", action="store_true", help="decode steps as captured CUDA graphs (as `tokenmill "
                   "serve --cuda-graphs`)")
    c.add_argument("--contexts", default="64,256,768,1536", help="context lengths of the grid")
    c.add_argument("--decodes", default="1,4,8,16,32,64", help="decode batch sizes of the grid")
    c.add_argument("--prefills", default="16,64,256,1024", help="prefill chunk sizes of the grid")
    c.add_argument("--repeats", type=int, default=4)
    c.add_argument("--draft-for", metavar="TARGET", help="--model is a draft: also time its proposals inside TARGET's "
                   "speculating engine (the proposer's own loop; `tokenmill sim --speculative-model` prices a "
                   "calibrated draft with it); implies --no-serving")
    c.add_argument("--no-serving", action="store_true", help="skip the serving-overhead measurement through a "
                   "real `tokenmill serve` (the profile then models the engine alone)")
    c.add_argument("--engine-profile", metavar="PROFILE.json", help="reuse this profile's engine fit (skip the "
                   "grid); measure the serving overhead only")
    c.add_argument("--port", type=int, default=18473, help="port of the server the serving measurement starts")
    c.add_argument("--serving-loads", default=None, metavar="F1,F2,F3",
                   help="open-loop serving runs at these fractions of the measured capacity (default 0.3,0.65,1.0)")
    c.add_argument("--capacity", type=float, metavar="REQ_PER_S", help="the server's capacity for the calibration "
                   "workload (skip the capacity probe)")
    c.set_defaults(func=run_calibrate)
    p.set_defaults(func=run)
    return p


def run_scenario_command(args: argparse.Namespace) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.sim.scenario import load, run_scenario, shipped

    if not args.scenario:
        for name, path in sorted(shipped().items()):
            print(f"{name}: {load(str(path)).get('description', '')}")
        return 0
    if not args.scenario_out:
        raise CLIError("tokenmill sim scenario NAME needs --out DIR")
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    run_scenario(args.scenario, Path(args.scenario_out), quick=args.quick, only=only)
    return 0


def _numbers(flag: str, text: str, kind=int) -> tuple:
    from tokenmill.cli import CLIError

    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise CLIError(f"{flag} {text!r}: expected comma-separated {what}") from None


def run_calibrate(args: argparse.Namespace) -> int:
    from tokenmill.engine.config import parse_bytes
    from tokenmill.sim.calibrate import Grid, calibrate, write_profile

    grid = Grid(_numbers("--contexts", args.contexts), _numbers("--decodes", args.decodes),
                _numbers("--prefills", args.prefills), args.repeats)
    engine_kwargs = {"kv_cache_bytes": parse_bytes(args.kv_cache_bytes),
                     "max_num_batched_tokens": args.max_num_batched_tokens, "num_threads": args.num_threads,
                     "device": args.device, "dtype": args.dtype, "quantization": args.quantization,
                     "cuda_graphs": args.cuda_graphs, "max_model_len": args.max_model_len}
    print(f"calibrating {args.model} on this machine ...", file=sys.stderr)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if args.engine_profile:
        from tokenmill.sim.cost_model import Calibrated

        profile = dict(Calibrated.load(args.engine_profile).profile)
        profile.pop("serving", None)
    else:
        profile = calibrate(args.model, grid, engine_kwargs, log=log)
    write_profile(profile, args.out)  # the engine fit is kept even if the serving measurement fails
    if args.draft_for:
        from tokenmill.sim.calibrate import calibrate_draft_loop

        profile["draft_loop"] = calibrate_draft_loop(args.draft_for, args.model, engine_kwargs, log=log)
        d = profile["draft_loop"]
        print(f"draft loop inside {args.draft_for}: {d['samples']} proposals, "
              + ", ".join(f"{k}={v:.3g}" for k, v in zip(d["features"], d["coef"]))
              + f" s; median |error| {100 * d['median_abs_rel_error']:.1f}%")
    if not args.no_serving and not args.draft_for:
        from tokenmill.sim.calibrate import measure_serving

        engine_args = ["--kv-cache-bytes", str(engine_kwargs["kv_cache_bytes"]), "--max-num-batched-tokens",
                       str(args.max_num_batched_tokens)]
        if args.num_threads:
            engine_args += ["--num-threads", str(args.num_threads)]
        engine_args += ["--device", args.device, "--dtype", args.dtype, "--quantization", args.quantization]
        if args.cuda_graphs:
            engine_args.append("--cuda-graphs")
        if args.max_model_len:
            engine_args += ["--max-model-len", str(args.max_model_len)]
        from tokenmill.sim.calibrate import SERVING_LOAD_FRACTIONS

        fractions = (_numbers("--serving-loads", args.serving_loads, float) if args.serving_loads
                     else SERVING_LOAD_FRACTIONS)
        profile["serving"] = measure_serving(profile, args.model, engine_args, fractions=fractions, port=args.port,
                                             capacity=args.capacity, log=log)
    profile["command"] = ["tokenmill", *sys.argv[1:]] if sys.argv[1:2] == ["sim"] else ["tokenmill", "sim", "calibrate"]
    write_profile(profile, args.out)
    f = profile["fit"]
    print(f"{f['samples']} steps measured in {f['seconds']:.0f} s; fit median |error| "
          f"{100 * f['median_abs_rel_error']:.1f}%, p90 {100 * f['p90_abs_rel_error']:.1f}%")
    print("coefficients: " + ", ".join(f"{k}={v:.3g}" for k, v in zip(profile["features"], profile["coef"])))
    if "serving" in profile:
        sv = profile["serving"]
        if "kinds" in sv:
            for k, t in sv["kinds"].items():
                print(f"serving overhead, {k} steps: {1000 * t['step_s']:.2f} ms per step + engine fit x "
                      f"{t['scale']:.3f} + {1000 * t['per_seq_s']:.3f} ms per streamed token + "
                      f"{1000 * t['per_request_s']:.2f} ms per request"
                      + (f"; over {sv['wide_rows']} rows: + engine fit x {t['wide_scale']:.3f}, "
                         f"+ {1000 * t['new_shape_s']:.2f} ms the first time" if "wide_rows" in sv else ""))
                if "table" in t:
                    print(f"  + decode table (batch size: ms): " + ", ".join(
                        f"{d:.1f}: {1000 * e:.2f}" for d, e in t["table"]) + f"; beyond: +{1000 * t['table_slope_s']:.3f}"
                        " ms per sequence")
            print(f"{1000 * sv['request_s']:.1f} ms per request outside the engine's steps"
                  + (f" ({sv['request_s_source']}; one stream: {1000 * sv['request_s_one_stream']:.1f} ms)"
                     if "request_s_source" in sv else ""))
            if "capacity" in sv:
                cap = sv["capacity"]
                print(f"capacity {cap['req_per_s']:.2f} req/s of {cap['workload']}; open-loop runs at "
                      + ", ".join(f"{r:g}" for r in cap["rates"]) + " req/s")
        else:
            print(f"serving overhead: {1000 * sv['step_s']:.2f} ms per step + {1000 * sv['per_seq_s']:.3f} ms per "
                  f"streamed token + {1000 * sv.get('per_request_s', 0.0):.2f} ms per request + "
                  f"{1e6 * sv.get('per_prefill_token_s', 0.0):.1f} us per prefill token; {1000 * sv['request_s']:.1f} "
                  "ms per request before the engine")
    print(f"wrote {args.out}")
    return 0


def build_config(args: argparse.Namespace):
    import dataclasses

    from tokenmill.bench.config import load_from_args
    from tokenmill.cli import CLIError
    from tokenmill.engine.config import parse_bytes
    from tokenmill.router.config import RouterConfig, load_config
    from tokenmill.sim.cost_model import RooflineParams
    from tokenmill.sim.simulation import SimConfig

    missing = [f for f in ("model", "hardware", "out") if getattr(args, f) is None]
    if missing:
        raise CLIError(f"give {', '.join('--' + m for m in missing)} (or `tokenmill sim calibrate`)")
    workloads, load, sweep = load_from_args(args)
    try:
        router = load_config(args.router_config) if args.router_config else RouterConfig()
        changes = {"workers": ()}
        if args.router:
            changes["policy"] = args.router
        if args.admission:
            changes["admission"] = dataclasses.replace(router.admission, mode=args.admission)
        router = dataclasses.replace(router, **changes)
    except (OSError, ValueError) as e:
        raise CLIError(f"router config: {e}") from None
    roofline = RooflineParams(dtype=args.dtype, kv_bytes=args.kv_bytes, mfu=args.mfu, mbu=args.mbu,
                              step_overhead_s=args.step_overhead_ms / 1000, tp=args.tp)
    try:
        kv = parse_bytes(args.kv_cache_bytes) if args.kv_cache_bytes else None
    except ValueError:
        raise CLIError(f"--kv-cache-bytes {args.kv_cache_bytes!r}: expected bytes such as 4GiB") from None
    command = ["tokenmill", *sys.argv[1:]] if sys.argv[1:2] == ["sim"] else ["tokenmill", "sim"]
    tier_bytes = {}
    for flag in ("kv_host_bytes", "kv_disk_bytes"):
        v = getattr(args, flag)
        try:
            tier_bytes[flag] = parse_bytes(v) if v else 0
        except ValueError:
            raise CLIError(f"--{flag.replace('_', '-')} {v!r}: expected bytes such as 64GiB") from None
    io = {}
    for flag, key, scale in (("kv_host_bw", "host_read_bw", 1e9), ("kv_host_bw", "host_write_bw", 1e9),
                             ("kv_disk_read_bw", "disk_read_bw", 1e9), ("kv_disk_write_bw", "disk_write_bw", 1e9),
                             ("kv_disk_latency_us", "disk_latency_s", 1e-6), ("kv_checksum_bw", "checksum_bw", 1e9),
                             ("kv_link_bw", "link_bw", 1e9)):
        if getattr(args, flag) is not None:
            io[key] = getattr(args, flag) * scale
    return SimConfig(
        model=args.model, hardware=args.hardware, out=Path(args.out), workers=args.workers, router=router,
        workloads=workloads, load=load, sweep=sweep, slos=tuple(args.slo or ()), seed=args.seed,
        plots=not args.no_plots, roofline=roofline, kv_cache_bytes=kv, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        step_budget=not args.no_step_budget, fast_forward=not args.no_fast_forward, token_free=args.token_free,
        price_per_hour=args.price_per_hour, **tier_bytes, kv_host_shared=args.kv_host_shared,
        kv_load_timeout_s=args.kv_load_timeout_s, tier_io=io,
        record_chunks=not args.no_token_times, speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens, speculative_max_k=args.speculative_max_k,
        spec_acceptance=args.spec_acceptance, spec_lookup_us=args.spec_lookup_us, command=tuple(command))


def simulate_and_write(cfg):
    """Run one SimConfig and write the bench's report to cfg.out, with the `sim` section added to result.json."""
    from tokenmill.bench.report import write_report
    from tokenmill.sim.simulation import run_simulation

    result, sim = run_simulation(cfg)
    write_report(result, cfg.out, plots=cfg.plots)
    path = cfg.out / "result.json"
    data = json.loads(path.read_text())
    data["sim"] = sim
    path.write_text(json.dumps(data, indent=2) + "\n")
    return result, sim


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    result, sim = simulate_and_write(cfg)
    if result.sweep is not None:
        print(f"max rate with SLO attainment >= {100 * cfg.sweep.target:.0f}%: {result.sweep.max_rate:.3g} req/s "
              f"({len(result.runs)} trials)")
    best = result.best
    if best is not None:
        from tokenmill.bench.cli import print_run

        print_run(best)
        level = sim["levels"][result.runs.index(best)]
        print(f"KV block size {sim['worker']['block_size']} tokens ({sim['block_size_source']})")
        print(f"simulated {level['simulated_s']:.1f} s in {level['wall_s']:.2f} s wall ({level['events']} events, "
              f"{level['events_per_s']:.0f} events/s)")
        if "spec" in level:
            sp = level["spec"]
            rate = sp["acceptance_rate"]
            print(f"speculative decoding: {sp['drafts']} verifies, {sp['draft_tokens']} draft tokens, acceptance "
                  + (f"{100 * rate:.1f}%" if rate is not None else "-") + f"; k chosen (sequence-steps): "
                  + ", ".join(f"{k}: {n}" for k, n in sp["chosen_k"].items())
                  + ("; guard caps (bucket: cap x workers): " + "; ".join(
                      f"{b}: " + ", ".join(f"{c} x{n}" for c, n in v.items()) for b, v in sp["guard_caps"].items())
                     if sp.get("guard_caps") else ""))
        if "cost" in level and level["cost"]["per_million_tokens"] is not None:
            c = level["cost"]
            print(f"cost: ${c['usd']:.4g} for the run, ${c['per_million_output_tokens']:.4g} per million output "
                  f"tokens, ${c['per_million_tokens']:.4g} per million tokens (prompt + output)")
    print(f"wrote {cfg.out}/result.json, {cfg.out}/summary.md")
    return 0 if any(r.summary.completed for r in result.runs) else 1
