"""Fidelity of `tokenmill sim` (calibrated) against the real `tokenmill serve` on this machine.

    flock /tmp/cpu.lock python benchmarks/sim_fidelity.py --profile /tmp/cpu.json --loads 0.3,0.55,0.85 \\
        --num-requests 200 --out /tmp/fidelity

The load levels: --rates R1,R2,.. (req/s), or --loads F1,F2,.. (default 0.3,0.55,0.85): fractions of the real
server's capacity for the workload, measured first on a fresh server by the probe `tokenmill sim calibrate` uses
for its own open-loop loads (calibrate.probe_capacity: a saturating closed loop; --capacity R skips it); the
capacity and the rates go to OUT/capacity.json and the output.

Per load level: a fresh `tokenmill serve --model demo --admission off` measured by `tokenmill bench`
(its own process), then `tokenmill sim` with the same workload flags, one worker, round-robin routing and
admission off (the single server); both write the bench's result.json. The table gives median and p90 TTFT,
TPOT and E2E, goodput and attainment, real vs sim, and the sim's relative error. Without --profile the
script first runs `tokenmill sim calibrate` (same engine settings as the server).

--repeats N runs the real side N times per level (a fresh server each time; the rounds go over all the
levels in turn, so a slow minute of the machine does not land on one level only); the table then gives the
real side's mean, its run-to-run spread ((max - min) / mean) and the sim's error against the mean. The sim is
deterministic: it runs once per level. Each real run also writes the engine core's per-step trace
(TOKENMILL_STEP_TRACE, server/engine_core.py) and the CPU seconds of the server (front-end, engine core) and
of the bench client (`real-R-K/cpu.json`), which is what `--explain` prints: per level, the real steps'
time against the profile's prediction for the same step shapes, and where the time between steps went.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import _stop, wait_ready  # noqa: E402

from tokenmill.hardware import capabilities  # noqa: E402
from tokenmill.sim.calibrate import (machine_busy_s, probe_capacity, process_cpu_s,  # noqa: E402
                                     rates_from_capacity)

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}




def load_flags(args, rate: float) -> list[str]:
    return ["--workload", args.workload, "--rate", f"{rate:g}", "--num-requests", str(args.num_requests),
            "--seed", str(args.seed), "--no-plots"] + sum((["--slo", s] for s in args.slo), [])


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def start_server(args, log: Path, trace: Path | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [PY, "-m", "tokenmill", "serve", "--model", args.model, "--port", str(args.port), "--admission", "off",
           "--kv-cache-bytes", args.kv_cache_bytes, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {**ENV, "TOKENMILL_STEP_TRACE": str(trace)} if trace else ENV
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(server, url, log)
    except BaseException:
        _stop([server])
        raise
    return server, url


def measure_capacity(args, out: Path) -> dict:
    """The check's loads: --loads fractions of the server's capacity for --workload, measured on a fresh server by
    calibrate.probe_capacity (the probe `tokenmill sim calibrate` runs for its own loads), or --capacity; written
    to OUT/capacity.json (and read from there with --sim-only)."""
    f = out / "capacity.json"
    if args.sim_only and f.exists():
        return json.loads(f.read_text())
    if args.capacity:
        cap = {"workload": args.workload, "req_per_s": args.capacity, "given": True}
    else:
        server, url = start_server(args, out / "server-capacity.log")
        try:
            # another seed than the check's runs: the probe's prompts are not the ones measured after it
            cap = probe_capacity(url, args.model, args.tokenizer, args.workload, out / "capacity", args.seed + 1000,
                                 env=ENV)
        finally:
            _stop([server])
    fractions = [float(x) for x in args.loads.split(",")]
    cap.update(fractions=fractions, rates=list(rates_from_capacity(cap["req_per_s"], fractions)))
    f.write_text(json.dumps(cap, indent=1) + "\n")
    return cap


def run_real(args, rate: float, out: Path, repeat: int = 0) -> dict:
    tag = f"{rate:g}" if args.repeats == 1 else f"{rate:g}-{repeat}"
    dest = out / f"real-{tag}"
    dest.mkdir(parents=True, exist_ok=True)
    log = out / f"server-{tag}.log"
    trace = dest / "steps.jsonl"
    trace.unlink(missing_ok=True)
    server, url = start_server(args, log, trace)
    try:
        procs = {"front-end": server.pid, **{f"core-{c}": c for c in _children(server.pid)}}
        before = {k: process_cpu_s(p) for k, p in procs.items()}
        bench0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        sys0 = machine_busy_s()
        t0 = time.perf_counter()
        subprocess.run([PY, "-m", "tokenmill", "bench", "--target", url, "--model", args.model, "--tokenizer",
                        args.tokenizer, "--out", str(dest), "--no-progress"] + load_flags(args, rate),
                       check=True, env=ENV, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        bench1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {k: process_cpu_s(p) - before[k] for k, p in procs.items()}
        cpu["bench"] = (bench1.ru_utime + bench1.ru_stime) - (bench0.ru_utime + bench0.ru_stime)
        # what the rest of the machine used meanwhile (other users' jobs: a run with much of it is not quiet)
        cpu["other"] = max(0.0, machine_busy_s() - sys0 - sum(cpu.values()))
        (dest / "cpu.json").write_text(json.dumps({"wall_s": wall, "cpu_s": cpu}, indent=1) + "\n")
        return json.loads((dest / "result.json").read_text())
    finally:
        _stop([server])


def run_sim(args, rate: float, out: Path) -> tuple[dict, float]:
    dest = out / f"sim-{rate:g}"
    t0 = time.perf_counter()
    subprocess.run([PY, "-m", "tokenmill", "sim", "--model", args.model, "--hardware", args.profile, "--workers", "1",
                    "--router", "round-robin", "--admission", "off", "--kv-cache-bytes", args.kv_cache_bytes,
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--out", str(dest)]
                   + load_flags(args, rate), check=True, env=ENV, stdout=subprocess.DEVNULL)
    return json.loads((dest / "result.json").read_text()), time.perf_counter() - t0


METRICS = [("TTFT p50", "ttft_ms", "p50"), ("TTFT p90", "ttft_ms", "p90"), ("TPOT p50", "tpot_ms", "p50"),
           ("TPOT p90", "tpot_ms", "p90"), ("E2E p50", "e2e_ms", "p50"), ("E2E p90", "e2e_ms", "p90"),
           ("goodput", "goodput", None), ("attainment", "slo_attainment", None)]


def value(summary: dict, key: str, sub: str | None):
    v = summary.get(key)
    return (v or {}).get(sub) if sub else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[1] / "tokenmill/model/demo/demo"))
    ap.add_argument("--profile", help="calibration profile (default: calibrate first, into --out)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rates", help="load levels, req/s")
    load.add_argument("--loads", help="load levels as fractions of the measured capacity for --workload (default "
                      "0.3,0.55,0.85: three loads up to ~85%% of capacity)")
    ap.add_argument("--capacity", type=float, metavar="REQ_PER_S", help="with --loads: this capacity instead of "
                    "probing it")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--slo", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", default="256MiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--repeats", type=int, default=1, help="real runs per level (run-to-run spread)")
    ap.add_argument("--real-only", action="store_true", help="skip the sim (real runs and traces only)")
    ap.add_argument("--sim-only", action="store_true",
                    help="reuse the real runs already in --out (real-R[-K]/result.json); run the sim only")
    ap.add_argument("--explain", action="store_true", help="per level: the real steps vs the profile's model")
    ap.add_argument("--out", default="/tmp/sim_fidelity")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"ISA: {capabilities().summary()}")
    if not args.profile:
        args.profile = str(out / "profile.json")
        subprocess.run([PY, "-m", "tokenmill", "sim", "calibrate", "--model", args.model, "--out", args.profile,
                        "--kv-cache-bytes", args.kv_cache_bytes, "--max-num-batched-tokens",
                        str(args.max_num_batched_tokens)], check=True, env=ENV)
    capacity = None
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    else:
        args.loads = args.loads or "0.3,0.55,0.85"
        capacity = measure_capacity(args, out)
        rates = capacity["rates"]
        print(f"capacity {capacity['req_per_s']:.2f} req/s of {args.workload}"
              + (" (given)" if capacity.get("given") else f" (probe: {capacity['concurrency']} sessions, "
                 f"{capacity['completed']} requests)") + "; loads " + ", ".join(
                  f"{f:g} -> {r:g} req/s" for f, r in zip(capacity["fractions"], rates)))
    reals: dict[float, list[dict]] = {r: [] for r in rates}
    for k in range(args.repeats):  # rounds over all the levels
        for rate in rates:
            if args.sim_only:
                tag = f"{rate:g}" if args.repeats == 1 else f"{rate:g}-{k}"
                reals[rate].append(json.loads((out / f"real-{tag}" / "result.json").read_text())["summary"])
            else:
                reals[rate].append(run_real(args, rate, out, k)["summary"])
    sims = {} if args.real_only else {rate: run_sim(args, rate, out)[0] for rate in rates}
    print(f"\nworkload {args.workload}, {args.num_requests} requests per level, model {args.model}, "
          f"profile {args.profile}, {args.repeats} real run(s) per level")
    fmt = (lambda v: "-" if v is None else f"{v:.3g}")
    if args.repeats == 1:
        print("| rate | metric | real | sim | error |")
        print("|---:|---|---:|---:|---:|")
    else:
        print("| rate | metric | real runs | real mean | real spread | sim | error vs mean |")
        print("|---:|---|---|---:|---:|---:|---:|")
    for rate in rates:
        sim = sims[rate]["summary"] if rate in sims else {}
        for name, key, sub in METRICS:
            rs = [value(r, key, sub) for r in reals[rate]]
            s = value(sim, key, sub)
            r = statistics.fmean(rs) if None not in rs else None
            err = f"{100 * (s - r) / r:+.1f}%" if r and s is not None else "-"
            if args.repeats == 1:
                print(f"| {rate:g} | {name} | {fmt(r)} | {fmt(s)} | {err} |")
            else:
                spread = f"{100 * (max(rs) - min(rs)) / r:.1f}%" if r else "-"
                print(f"| {rate:g} | {name} | {' / '.join(fmt(v) for v in rs)} | {fmt(r)} | {spread} | {fmt(s)} "
                      f"| {err} |")
        if rate in sims:
            print(f"| {rate:g} | sim events/s | | | | {sims[rate]['sim']['levels'][0]['events_per_s']:.0f} | |")
    if args.explain:
        explain(args, rates, out)


def sim_steps(model, shapes) -> list[float]:
    """The profile's time for each step of a real run, in order: step_s, plus new_shape_s on the first wide step of
    each row count (what the simulated worker charges: sim/worker.py)."""
    seen, out = set(), []
    for x in shapes:
        t = model.step_s(x)
        if model.wide_rows is not None and x.tokens > model.wide_rows and x.tokens not in seen:
            seen.add(x.tokens)
            t += model.new_shape_s(x)
        out.append(t)
    return out


def explain(args, rates: list[float], out: Path) -> None:
    """Per level and real run: the engine core's steps (TOKENMILL_STEP_TRACE) against the profile's model of
    the same step shapes, and the CPU the server and the bench client used."""
    from tokenmill.sim.cost_model import STEP_KINDS, Calibrated, StepShape, step_kind

    model = Calibrated.load(args.profile)
    per_kind = []  # (tag, kind, steps, real s, gap s, fit s, sim s)
    print("\n| run | steps | decode steps: mean seqs | real step ms | engine fit ms | real / fit | gap between "
          "steps ms | sim step ms (fit + serving) | (real step + gap) / sim | CPU s: core / front-end / bench / other "
          "per wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for rate in rates:
        for k in range(args.repeats):
            tag = f"{rate:g}" if args.repeats == 1 else f"{rate:g}-{k}"
            d = out / f"real-{tag}"
            if not (d / "steps.jsonl").exists():
                continue
            steps = [json.loads(line) for line in (d / "steps.jsonl").read_text().splitlines() if line.strip()]
            if not steps:
                continue
            real = sum(s["t1"] - s["t0"] for s in steps)
            gaps = [b["t0"] - a["t1"] for a, b in zip(steps, steps[1:]) if b["t0"] - a["t1"] < 0.05]
            shapes = [StepShape(s["tokens"], s["prefill_tokens"], s["decode_seqs"], s["attn_pairs"], s["decode_ctx"],
                                s["prefill_ctx"], s["logits"], s.get("new_requests", 0)) for s in steps]
            after = [b["t0"] - a["t1"] for a, b in zip(steps, steps[1:])] + [0.0]  # the pause after each step
            sims = sim_steps(model, shapes)
            for kind in STEP_KINDS:
                ix = [i for i, x in enumerate(shapes) if step_kind(x.prefill_tokens, x.decode_seqs) == kind]
                ratio = sorted((steps[i]["t1"] - steps[i]["t0"] + (after[i] if after[i] < 0.05 else 0.0))
                               / sims[i] for i in ix)  # per step: (real + gap) / sim
                q = (lambda f: ratio[min(len(ratio) - 1, int(f * len(ratio)))] if ratio else 0.0)
                per_kind.append((tag, kind, len(ix), sum(steps[i]["t1"] - steps[i]["t0"] for i in ix),
                                 sum(after[i] for i in ix if after[i] < 0.05),
                                 sum(model.engine_step_s(shapes[i]) for i in ix),
                                 sum(sims[i] for i in ix),
                                 q(0.1), q(0.5), q(0.9)))
            fit = sum(model.engine_step_s(x) for x in shapes)
            sim = sum(sims)
            dec = [s["decode_seqs"] for s in steps if s["prefill_tokens"] == 0]
            cpu = json.loads((d / "cpu.json").read_text()) if (d / "cpu.json").exists() else None
            cpu_txt = "-"
            if cpu:
                c, w = cpu["cpu_s"], cpu["wall_s"]
                core = sum(v for n, v in c.items() if n.startswith("core"))
                cpu_txt = " / ".join(f"{v / w:.2f}" for v in (core, c.get("front-end", 0), c.get("bench", 0),
                                                               c.get("other", 0)))
            n = len(steps)
            print(f"| {tag} | {n} | {statistics.fmean(dec) if dec else 0:.1f} | {1000 * real / n:.2f} | "
                  f"{1000 * fit / n:.2f} | {real / fit:.3f} | {1000 * statistics.fmean(gaps) if gaps else 0:.3f} | "
                  f"{1000 * sim / n:.2f} | {(real + sum(gaps)) / sim:.3f} | {cpu_txt} |")
    # scheduling vs step time: the same requests as steps, real vs sim. Fewer sim steps for the same tokens = larger
    # batches (the sim's server runs ahead or behind, or schedules differently); busy time = steps + pauses (real)
    # vs the sim's step times
    print("\nsteps, real vs sim (busy: real steps + pauses < 50 ms; sim: its step times; tokens per step: logits "
          "rows per step, the mean batch):\n")
    print("| run | real steps | sim steps | sim / real | real busy s | sim busy s | sim / real | real tokens per "
          "step | sim tokens per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate in rates:
        sim_file = out / f"sim-{rate:g}" / "result.json"
        if not sim_file.exists():
            continue
        lv = json.loads(sim_file.read_text())["sim"]["levels"][0]
        s_steps, s_busy = lv["steps"], lv["mean_worker_busy"] * lv["simulated_s"]
        s_tok = lv["output_tokens"] / s_steps if s_steps else 0.0
        for k in range(args.repeats):
            tag = f"{rate:g}" if args.repeats == 1 else f"{rate:g}-{k}"
            f = out / f"real-{tag}" / "steps.jsonl"
            steps = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
            if not steps:
                continue
            busy = sum(d["t1"] - d["t0"] for d in steps) + sum(
                g for g in (b["t0"] - a["t1"] for a, b in zip(steps, steps[1:])) if g < 0.05)
            toks = sum(d["logits"] for d in steps) / len(steps)
            print(f"| {tag} | {len(steps)} | {s_steps} | {s_steps / len(steps):.3f} | {busy:.1f} | {s_busy:.1f} | "
                  f"{s_busy / busy:.3f} | {toks:.2f} | {s_tok:.2f} |")
    print("\nper step kind (gap: the pause after the step, pauses >= 50 ms left out):\n")
    print("| run | kind | steps | real step ms | gap ms | engine fit ms | real / fit | sim step ms | "
          "(real step + gap) / sim | per step: p10 / p50 / p90 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for tag, kind, n, real, gap, fit, sim, p10, p50, p90 in per_kind:
        if n:
            print(f"| {tag} | {kind} | {n} | {1000 * real / n:.2f} | {1000 * gap / n:.2f} | {1000 * fit / n:.2f} | "
                  f"{real / fit:.3f} | {1000 * sim / n:.2f} | {(real + gap) / sim:.3f} | {p10:.2f} / {p50:.2f} / "
                  f"{p90:.2f} |")


if __name__ == "__main__":
    main()
