"""Fidelity of `tokenmill sim` (calibrated) against the real `tokenmill serve` on this machine.

    flock /tmp/cpu.lock python benchmarks/sim_fidelity.py --profile /tmp/cpu.json --rates 4,8,12 \\
        --num-requests 200 --out /tmp/fidelity

Per load level: a fresh `tokenmill serve --model demo --admission off` measured by `tokenmill bench`
(its own process), then `tokenmill sim` with the same workload flags, one worker, round-robin routing and
admission off (the single server); both write the bench's result.json. The table gives median and p90 TTFT,
TPOT and E2E, goodput and attainment, real vs sim, and the sim's relative error. Without --profile the
script first runs `tokenmill sim calibrate` (same engine settings as the server).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import _stop, wait_ready  # noqa: E402

from tokenmill.hardware import capabilities  # noqa: E402

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}




def load_flags(args, rate: float) -> list[str]:
    return ["--workload", args.workload, "--rate", f"{rate:g}", "--num-requests", str(args.num_requests),
            "--seed", str(args.seed), "--no-plots"] + sum((["--slo", s] for s in args.slo), [])


def run_real(args, rate: float, out: Path) -> dict:
    log = out / f"server-{rate:g}.log"
    cmd = [PY, "-m", "tokenmill", "serve", "--model", args.model, "--port", str(args.port), "--admission", "off",
           "--kv-cache-bytes", args.kv_cache_bytes, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ENV)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(server, url, log)
        dest = out / f"real-{rate:g}"
        subprocess.run([PY, "-m", "tokenmill", "bench", "--target", url, "--model", args.model, "--tokenizer",
                        args.tokenizer, "--out", str(dest), "--no-progress"] + load_flags(args, rate),
                       check=True, env=ENV, stdout=subprocess.DEVNULL)
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
    ap.add_argument("--rates", default="4,8,12")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--slo", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", default="256MiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--out", default="/tmp/sim_fidelity")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"ISA: {capabilities().summary()}")
    if not args.profile:
        args.profile = str(out / "profile.json")
        subprocess.run([PY, "-m", "tokenmill", "sim", "calibrate", "--model", args.model, "--out", args.profile,
                        "--kv-cache-bytes", args.kv_cache_bytes, "--max-num-batched-tokens",
                        str(args.max_num_batched_tokens)], check=True, env=ENV)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        real = run_real(args, rate, out)["summary"]
        sim, wall = run_sim(args, rate, out)
        rows.append((rate, real, sim["summary"], sim["sim"]["levels"][0]))
    print(f"\nworkload {args.workload}, {args.num_requests} requests per level, model {args.model}, "
          f"profile {args.profile}")
    print("| rate | metric | real | sim | error |")
    print("|---:|---|---:|---:|---:|")
    for rate, real, sim, level in rows:
        for name, key, sub in METRICS:
            r, s = value(real, key, sub), value(sim, key, sub)
            err = f"{100 * (s - r) / r:+.1f}%" if r and s is not None else "-"
            fmt = (lambda v: "-" if v is None else f"{v:.3g}")
            print(f"| {rate:g} | {name} | {fmt(r)} | {fmt(s)} | {err} |")
        print(f"| {rate:g} | sim events/s | | {level['events_per_s']:.0f} | |")


if __name__ == "__main__":
    main()
