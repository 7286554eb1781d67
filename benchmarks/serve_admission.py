"""Goodput of one `tokenmill serve` from idle to overload: admission on (leading) vs off, optionally vLLM.

    python benchmarks/serve_admission.py --model demo --sessions 0.25,0.5,1,2 --duration 20 --out /tmp/adm
    python benchmarks/serve_admission.py --model DIR --modes leading,off --vllm-python /tmp/vllm/bin/python

Each point starts a fresh server (cold prefix cache, priors not yet learned), runs `tokenmill bench` with
the agent workload at `--sessions` new sessions per second for `--duration` seconds of arrivals, and
stops the server. Per point it prints: requests sent / completed / refused (429/503), goodput (good
requests per second: completed within the TTFT and TPOT SLOs), attainment over all requests and over
the accepted ones, TTFT p50/p90 of the accepted, and the server's own admission figures (share of first
tokens whose predicted TTFT was within ±25% of the observed, deadline misses). A refused turn ends its
session (the bench's agent cannot go on without its reply), as a real client would.

The targets of issue 17: at every overloaded point goodput >= 90% of the sweep's maximum and attainment
of accepted requests >= 95%; below saturation no refusals that would have met their SLO.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from routing_common import _stop, wait_ready  # noqa: E402

from tokenmill.hardware import capabilities  # noqa: E402

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
AGENT = ("agent:system=640,repo=640,task=64,tool=128,output=48,turns_min=4,turns_max=4,think_s=0.5,"
         "max_context=2048")  # ~1.35k-token first turns growing to ~1.9k (the demo model's context is 2048)


def start_server(mode: str, args, port: int, log: Path) -> subprocess.Popen:
    if mode == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port",
               str(port), "--enable-prompt-tokens-details"]
        if args.vllm_dtype:  # default: vLLM's own choice (bf16 for a bf16 checkpoint on every x86 CPU)
            cmd += ["--dtype", args.vllm_dtype]
        env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}
    else:
        cmd = [PY, "-m", "tokenmill", "serve", "--model", args.model, "--port", str(port), "--admission", mode,
               "--slo", f"agent:ttft={args.ttft_ms:g},tpot={args.tpot_ms:g}", "--kv-cache-bytes", args.kv_cache_bytes, *args.serve_arg]
        env = ENV
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)




def stop(p: subprocess.Popen) -> None:
    _stop([p])


def admission_figures(url: str) -> dict:
    """Within-±25% share of the TTFT predictions and deadline misses, from the server's /metrics."""
    import urllib.request

    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    buckets, misses, admitted = {}, 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tokenmill_admission_ttft_prediction_relative_error_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == "tokenmill_admission_ttft_deadline_misses_total":
                misses += s.value
            elif s.name == "tokenmill_admission_admitted_total":
                admitted += s.value
    total = buckets.get(float("inf"), 0.0)
    within = (buckets.get(0.25, 0.0) - buckets.get(-0.25, 0.0)) / total if total else None
    return {"pred_within_25": within, "pred_error_p50": _hist_quantile(buckets, 0.5), "deadline_misses": misses,
            "admitted": admitted, "predictions": total}


def _hist_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of (observed - predicted) / predicted, interpolated within histogram buckets."""
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    prev_le, prev_n = -1.0, 0.0  # a relative error is > -1
    for le in sorted(buckets):
        n = buckets[le]
        if n >= q * total:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (q * total - prev_n) / max(n - prev_n, 1e-9)
        prev_le, prev_n = le, n
    return None


def run_point(mode: str, sessions_per_s: float, args, out: Path, port: int) -> dict:
    log = out / f"{mode}-{sessions_per_s:g}.server.log"
    server = start_server(mode, args, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url, log)
        rate = sessions_per_s * 4  # 4 turns per session: the bench's rate is requests/s
        res_dir = out / f"{mode}-{sessions_per_s:g}"
        cmd = [PY, "-m", "tokenmill", "bench", "--target", url, "--workload", args.workload, "--rate", f"{rate:g}",
               "--duration", f"{args.duration:g}", "--slo", f"agent:ttft={args.ttft_ms:g},tpot={args.tpot_ms:g}",
               "--seed", str(args.seed), "--out", str(res_dir), "--no-plots", "--no-progress",
               "--request-timeout", "300"]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
        if done.returncode:
            raise SystemExit(f"tokenmill bench failed ({mode}, {sessions_per_s:g}/s):\n{done.stderr[-2000:]}")
        fig = admission_figures(url) if mode != "vllm" else {}
        if mode != "vllm":
            import urllib.request

            state = json.loads(urllib.request.urlopen(url + "/tokenmill/state", timeout=5).read())
            fig["engine_busy_s"] = state["engine_step_seconds"]
    finally:
        stop(server)
    res = json.loads((res_dir / "result.json").read_text())
    s = res["summary"]
    records = [json.loads(line) for line in open(res_dir / "requests.jsonl")]
    accepted = [r for r in records if r["status"] == "ok"]
    good_accepted = s["good"] / s["completed"] if s["completed"] else None
    return {"mode": mode, "sessions_per_s": sessions_per_s, "sent": s["requests"], "completed": s["completed"],
            "refused": s["rejected"], "failed": s["failed"], "good": s["good"], "goodput": s["goodput"],
            "attainment": s["slo_attainment"], "attainment_accepted": good_accepted,
            "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"), "ttft_p90_ms": (s["ttft_ms"] or {}).get("p90"),
            "tpot_p90_ms": (s["tpot_ms"] or {}).get("p90"), "duration_s": s["duration_s"],
            "n_accepted": len(accepted), **fig}


def fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokenizer", help="tokenizer dir for the bench (default: --model when it is a dir)")
    ap.add_argument("--sessions", default="0.25,0.5,1,2", help="new sessions per second, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per point")
    ap.add_argument("--modes", default="leading,off", help="leading, lagging, off, vllm (comma-separated)")
    ap.add_argument("--vllm-python", default="/tmp/vllm/bin/python")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's --dtype (default: vLLM's own default)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `tokenmill serve` argument (repeatable), e.g. --serve-arg=--quantization=int8")
    ap.add_argument("--workload", default=AGENT)
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-ms", type=float, default=250.0)
    ap.add_argument("--kv-cache-bytes", default="2GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18500)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tokenizer is None:
        from tokenmill.model.loader import resolve_model_path

        args.tokenizer = str(resolve_model_path(args.model))  # exact prompt lengths (shipped names too)
    out = Path(args.out or tempfile.mkdtemp(prefix="serve-admission-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# CPU: {capabilities().summary()}")
    print(f"# model {args.model}; workload {args.workload}; SLO agent TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms;"
          f" {args.duration:g} s of arrivals per point; out {out}")
    print(f"# tokenmill serve extra args: {' '.join(args.serve_arg) or '(none)'}; vLLM --dtype: "
          f"{args.vllm_dtype or '(its default)'}")
    rows = []
    rates = [float(x) for x in args.sessions.split(",")]
    for i, r in enumerate(rates):  # the modes of one load level back to back: drifts of the machine hit both
        for j, mode in enumerate(args.modes.split(",")):
            t0 = time.time()
            row = run_point(mode, r, args, out, args.port + i * 8 + j)
            row["wall_s"] = time.time() - t0
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n| server | sessions/s | sent | done | refused | goodput req/s | % of mode max | attainment all | "
          "attainment accepted | TTFT p50/p90 ms | TPOT p90 ms | pred within ±25% | pred error p50 | deadline misses |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        top = max((r["goodput"] for r in mine), default=0) or 1
        for r in mine:
            name = {"leading": "tokenmill (admission leading)", "off": "tokenmill (admission off)",
                    "lagging": "tokenmill (admission lagging)",
                    "vllm": f"vLLM-CPU ({args.vllm_dtype or 'default dtype'})"}[mode]
            print(f"| {name} | {r['sessions_per_s']:g} | {r['sent']} | {r['completed']} | {r['refused']} | "
                  f"{r['goodput']:.2f} | {100 * r['goodput'] / top:.0f}% | {fmt(r['attainment'] and 100 * r['attainment'], '.0f')}% | "
                  f"{fmt(r['attainment_accepted'] and 100 * r['attainment_accepted'], '.0f')}% | "
                  f"{fmt(r['ttft_p50_ms'], '.0f')} / {fmt(r['ttft_p90_ms'], '.0f')} | {fmt(r['tpot_p90_ms'], '.0f')} | "
                  f"{fmt(r.get('pred_within_25') and 100 * r['pred_within_25'], '.0f')}% | "
                  f"{fmt(r.get('pred_error_p50') and 100 * r['pred_error_p50'], '+.0f')}% | "
                  f"{fmt(r.get('deadline_misses'), '.0f')} |")


if __name__ == "__main__":
    main()
