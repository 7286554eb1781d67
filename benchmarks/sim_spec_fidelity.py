"""Speculative decoding in `tokenmill sim` against the real `tokenmill serve` on this machine (demo + demo-draft).

    flock /tmp/cpu.lock python benchmarks/sim_spec_fidelity.py --profile /tmp/cpu.json --draft-profile /tmp/draft.json \\
        --ks off,4,auto --concurrency 1,4 --duration 40 --out /tmp/spec_fid

--profile: `tokenmill sim calibrate --model demo` (the target with its serving terms); --draft-profile: `tokenmill sim
calibrate --model demo-draft --no-serving` (the draft's in-process engine fit: its passes run inside the target's
steps). Per k and concurrency: a fresh `tokenmill serve --model demo --admission off [--speculative-model demo-draft
--num-speculative-tokens K]` measured by `tokenmill bench` (closed loop, its own process), the server's spec counters
from /metrics; then `tokenmill sim` with the same workload flags and --spec-acceptance set from the real run's
measured acceptance (alpha: the i.i.d. per-position acceptance whose expected kept share at the run's draft lengths
equals the measured one -- the sim takes acceptance as an input; what this checks is the step costs, the policy and
the verify/rollback path, not the draft's quality). The table: TPOT and TTFT p50, output tok/s, real vs sim, and
each k's speedup over off, real vs sim.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_common import _stop, wait_ready  # noqa: E402

from tokenmill.hardware import capabilities  # noqa: E402
from tokenmill.model.loader import resolve_model_path  # noqa: E402

PY = sys.executable


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out, per_pos = {}, {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"(vllm:spec_decode_[a-z_]+?)(_total)?(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(3) or "", float(m.group(4))
        if name.endswith("accepted_tokens_per_pos"):
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + v
        else:
            out[name] = out.get(name, 0.0) + v
    out["per_pos"] = [per_pos[k] for k in sorted(per_pos)]
    return out


def alpha_for(drafts: float, draft_tokens: float, accepted: float) -> float | None:
    """The i.i.d. alpha with E[kept] = accepted over `drafts` verifies of mean length draft_tokens / drafts."""
    if not drafts or not draft_tokens:
        return None
    k = draft_tokens / drafts
    target = accepted / drafts

    def kept(a):  # E[kept] for a verify of length k (k fractional: interpolate between floor and ceil)
        lo = int(k)
        f = k - lo
        e = lambda n: sum(a ** j for j in range(1, n + 1))  # noqa: E731
        return (1 - f) * e(lo) + f * e(lo + 1)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kept(mid) < target else (lo, mid)
    return (lo + hi) / 2


def run_sim(args, out: Path, tag: str, k: str, load: list[str], alpha, real: dict, real_acc, real_drafts) -> dict:
    c = int(tag[1:].split("-")[0])
    sim_flags = ["--model", "demo", "--hardware", args.profile, "--admission", "off", *load]
    if k != "off":
        sim_flags += ["--speculative-model", args.draft_profile, "--num-speculative-tokens", k,
                      "--spec-acceptance", f"{alpha if alpha is not None else 0.0:.4f}"]
    subprocess.run([PY, "-m", "tokenmill", "sim", *sim_flags, "--out", str(out / f"sim-{tag}")], check=True,
                   stdout=subprocess.DEVNULL)
    simj = json.loads((out / f"sim-{tag}" / "result.json").read_text())
    sim = simj["summary"]
    sim_spec = simj["sim"]["levels"][0].get("spec") or {}
    print(f"{tag}: real TPOT p50 {real['tpot_ms']['p50']:.2f} ms, sim {sim['tpot_ms']['p50']:.2f} ms", flush=True)
    return {"c": c, "k": k, "alpha": alpha, "real": real, "sim": sim, "real_acc": real_acc,
            "sim_acc": sim_spec.get("acceptance_rate"), "real_drafts": real_drafts, "sim_drafts": sim_spec.get("drafts")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--draft-profile", required=True)
    ap.add_argument("--ks", default="off,4,auto")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--workload", default="batch:prompt=128,output=96,spread=0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18491)
    ap.add_argument("--out", default="/tmp/sim_spec_fidelity")
    ap.add_argument("--sim-only", action="store_true", help="rerun only the sim on OUT's real runs (OUT/rows.json)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"ISA: {capabilities().summary()}")
    rows = []
    saved = {(r["c"], r["k"]): r for r in json.loads((out / "rows.json").read_text())} if args.sim_only else {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        for k in args.ks.split(","):
            spec = [] if k == "off" else ["--speculative-model", "demo-draft", "--num-speculative-tokens", k]
            tag = f"c{c}-k{k}"
            load = ["--workload", args.workload, "--concurrency", str(c), "--duration", f"{args.duration:g}",
                    "--seed", str(args.seed), "--no-plots"]
            if args.sim_only:
                r0 = saved[(c, k)]
                rows.append(run_sim(args, out, tag, k, load, r0["alpha"], r0["real"], r0["real_acc"], r0["real_drafts"]))
                continue
            log = out / f"server-{tag}.log"
            cmd = [PY, "-m", "tokenmill", "serve", "--model", "demo", "--port", str(args.port), "--admission", "off",
                   *spec]
            server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{args.port}"
            try:
                wait_ready(server, url, log)
                subprocess.run([PY, "-m", "tokenmill", "bench", "--target", url, "--model", "demo", "--tokenizer",
                                str(resolve_model_path("demo")), *load,
                                "--out", str(out / f"real-{tag}"), "--no-progress"], check=True,
                               stdout=subprocess.DEVNULL)
                m = scrape(url) if spec else {}
            finally:
                _stop([server])
            real = json.loads((out / f"real-{tag}" / "result.json").read_text())["summary"]
            alpha = None
            if spec:
                alpha = alpha_for(m.get("vllm:spec_decode_num_drafts", 0), m.get("vllm:spec_decode_num_draft_tokens", 0),
                                  m.get("vllm:spec_decode_num_accepted_tokens", 0))
            real_acc = (m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_draft_tokens"]
                        if spec and m.get("vllm:spec_decode_num_draft_tokens") else None)
            rows.append(run_sim(args, out, tag, k, load, alpha, real, real_acc, m.get("vllm:spec_decode_num_drafts")))
    if not args.sim_only:
        (out / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n| c | k | alpha (fit) | acceptance real / sim | TPOT p50 ms real / sim (err) | TTFT p50 ms real / sim | "
          "output tok/s real / sim (err) | speedup vs off real / sim |")
    print("|---:|---|---:|---|---|---|---|---|")
    base = {r["c"]: r for r in rows if r["k"] == "off"}
    for r in rows:
        rt, st = r["real"]["tpot_ms"]["p50"], r["sim"]["tpot_ms"]["p50"]
        ro, so = r["real"]["output_throughput"], r["sim"]["output_throughput"]
        b = base.get(r["c"])
        sp = (f"{ro / b['real']['output_throughput']:.2f} / {so / b['sim']['output_throughput']:.2f}"
              if b is not None and r["k"] != "off" else "-")
        acc = (f"{100 * r['real_acc']:.1f}% / {100 * r['sim_acc']:.1f}%" if r["real_acc"] is not None
               and r["sim_acc"] is not None else "-")
        print(f"| {r['c']} | {r['k']} | {r['alpha']:.3f} |" if r["alpha"] is not None else f"| {r['c']} | {r['k']} | - |",
              f"{acc} | {rt:.2f} / {st:.2f} ({100 * (st / rt - 1):+.1f}%) | {r['real']['ttft_ms']['p50']:.1f} / "
              f"{r['sim']['ttft_ms']['p50']:.1f} | {ro:.0f} / {so:.0f} ({100 * (so / ro - 1):+.1f}%) | {sp} |")


if __name__ == "__main__":
    main()
