"""Per-step trace of speculative decoding vs off at the same load: where does `auto` lose?

    python benchmarks/spec_trace.py --mode loop --concurrency 16 --requests 64      # closed loop (the server's shape)
    python benchmarks/spec_trace.py --mode batch --concurrency 1 --requests 2       # closed batches (spec_decode sweep)

Each configuration gets its own engine and the same requests; the runs are interleaved `--rounds` times (a
drift of the shared machine hits all). Every `engine.step()` is timed from outside and classified by what
ran: decode-only or mixed (a prefill chunk in the step), the k in force (auto: the guard's cap for the step;
0 = no sequence speculated), whether the draft caught up a long gap (a prefill of the draft). The table
gives per class: steps, share of the run's time, mean step ms and tokens emitted per step, beside off's
mean step ms for the same batch sizes (n-weighted), so "k = 0 steps cost more than off's steps" and "probes
cost this much" are read off directly. `--log FILE` writes every step as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from spec_decode import heldout_prompts  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.hardware import capabilities  # noqa: E402


def run(engine: LLMEngine, prompts, max_tokens: int, c: int, mode: str, tag: str, log: list | None):
    """Closed loop (`loop`: c in flight, a new request when one finishes) or closed batches (`batch`)."""
    spec = engine.spec
    queue = list(enumerate(prompts))
    inflight = 0
    done_tokens = 0
    t_start = time.perf_counter()
    steps = []

    def add(k: int) -> None:
        nonlocal inflight
        for _ in range(k):
            if queue:
                i, p = queue.pop(0)
                engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True))
                inflight += 1

    add(c)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        toks = sum(len(o.new_token_ids) for o in outs)
        fin = sum(1 for o in outs if o.finished)
        done_tokens += toks
        gs = spec._guard_step if spec is not None else None
        catchup = getattr(spec.proposer, "last_catchup", 0) if spec is not None else 0
        n = engine.last_step_decodes
        rec = {"n": n, "prefill": engine.last_step_prefill_tokens, "s": dt, "tokens": toks,
               "k": (gs[1] if gs is not None else 0) if spec is not None else 0,
               "cur": (spec.guard.current(n) if spec is not None and spec.guard is not None else None),
               "catchup": catchup}
        steps.append(rec)
        if spec is not None:
            spec.proposer.last_catchup = 0
        inflight -= fin
        if mode == "loop":
            add(c - inflight)
        elif inflight == 0:
            add(c)
    wall = time.perf_counter() - t_start
    if log is not None:
        log.extend(dict(r, config=tag) for r in steps)
    return wall, done_tokens, steps


def classify(r) -> str:
    kind = "decode" if r["prefill"] == 0 else "mixed"
    k = r["k"]
    extra = " catch-up" if r["catchup"] > 16 else ""
    return f"{kind} k={k}{extra}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("loop", "batch"), default="loop")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["off", "demo-draft:auto", "ngram:auto"])
    ap.add_argument("--warm", type=int, default=1, help="warm-up runs per engine (the same workload)")
    ap.add_argument("--log", default=None)
    a = ap.parse_args()
    e0 = LLMEngine(model="demo", kv_cache_bytes="64MiB")
    base = heldout_prompts(e0.tokenizer, 16, a.prompt_len)
    del e0
    prompts = [base[i % len(base)] for i in range(a.requests)]
    es = {}
    for name in a.configs:
        kw = {} if name == "off" else dict(speculative_model=name.split(":")[0], num_speculative_tokens=name.split(":")[1])
        es[name] = LLMEngine(model="demo", **kw)
    for name, e in es.items():
        for w in range(a.warm):
            run(e, prompts[:max(2, a.concurrency)], 16, a.concurrency, a.mode, f"warm{w}-{name}", None)
    log = [] if a.log else None
    wall = defaultdict(float)
    ntok = defaultdict(int)
    allsteps = defaultdict(list)
    for rnd in range(a.rounds):
        for name, e in es.items():
            w, t, steps = run(e, prompts, a.max_tokens, a.concurrency, a.mode, f"{name}-r{rnd}", log)
            wall[name] += w
            ntok[name] += t
            allsteps[name].extend(steps)
    print(f"\n### Step trace: {a.mode}, concurrency {a.concurrency}, {a.requests} requests x {a.max_tokens} tokens, "
          f"{a.rounds} rounds\n\n{capabilities().summary()}\n")
    off = "off" if "off" in es else None
    off_ms = defaultdict(list)  # (kind, n) -> off's step seconds
    if off:
        for r in allsteps[off]:
            off_ms[(r["prefill"] == 0, r["n"])].append(r["s"])
    print("| config | tok/s | vs off | preemptions |")
    print("|---|---:|---:|---:|")
    for name, e in es.items():
        tps = ntok[name] / wall[name]
        print(f"| {name} | {tps:.0f} | {tps / (ntok[off] / wall[off]) if off else 1:.3f}x | "
              f"{e.stats().num_preempted_total} |")
    for name in es:
        steps = allsteps[name]
        total = sum(r["s"] for r in steps)
        groups = defaultdict(list)
        for r in steps:
            groups[classify(r)].append(r)
        print(f"\n{name}: {len(steps)} steps, {total:.2f} s in steps, {ntok[name]} tokens")
        print("| step class | steps | share of time | mean ms | tokens/step | off mean ms at same n | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for cls, rs in sorted(groups.items(), key=lambda kv: -sum(r["s"] for r in kv[1])):
            s = sum(r["s"] for r in rs)
            ref = []
            for r in rs:
                o = off_ms.get((r["prefill"] == 0, r["n"]))
                if o:
                    ref.append(sum(o) / len(o))
            refm = 1000 * sum(ref) / len(ref) if ref else float("nan")
            mean = 1000 * s / len(rs)
            print(f"| {cls} | {len(rs)} | {s / total:.1%} | {mean:.2f} | {sum(r['tokens'] for r in rs) / len(rs):.2f} "
                  f"| {refm:.2f} | {mean / refm:.2f} |")
        e = es[name]
        g = e.spec.guard if e.spec is not None else None
        if g is not None:
            st = {b: (x.cur, x.num_probes, x.steps, {k: (round(a_.rate()), a_.samples) for k, a_ in sorted(x.arms.items())})
                  for b, x in sorted(g.buckets.items())}
            print(f"guard (bucket: cur, probes, steps, {{k: (tok/s, samples)}}): {st}; switches {g.num_switches}")
    if a.log:
        Path(a.log).write_text("\n".join(json.dumps(r) for r in log))


if __name__ == "__main__":
    main()
