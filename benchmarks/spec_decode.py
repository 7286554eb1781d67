"""Speculative decoding benchmarks (engine level, one process, configurations interleaved).

    python benchmarks/spec_decode.py batch1      # demo + demo-draft (and ngram) vs off, batch 1, held-out code
    python benchmarks/spec_decode.py edit        # ngram on an edit workload (the prompt holds the code to repeat)
    python benchmarks/spec_decode.py sweep       # throughput by concurrency: off vs fixed k=4 vs auto
    python benchmarks/spec_decode.py overhead --base DIR   # speculation off vs a checkout without it (offline shape)

Every table prints the ISA line. Greedy outputs are checked against speculation off (identical or the run says
so). Held-out code: windows of the stdlib files the demo models never trained on
(tokenmill.model.tokenizer.stdlib_sources(held_out_every=10, split="heldout")).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.hardware import capabilities  # noqa: E402


def heldout_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    from tokenmill.testing.prompts import heldout_code_prompts  # the tests' prompts: one definition

    return heldout_code_prompts(tokenizer, n, length)


# --format of `edit`: (text before the code, the instruction line after it). "reformatted" is the original
# workload; scripts/train_demo.py --edit-frac trains on similar markers (EDIT_MARKERS there), "before-after" is
# an instruction that training never used, to show whether the target's copying generalizes.
EDIT_FORMATS = {"reformatted": ("# Original:\n", "# The same code, reformatted:"),
                "before-after": ("# Before:\n", "# After:")}


def edit_prompts(tokenizer, n: int, length: int, fmt: str = "reformatted") -> list[list[int]]:
    """Code, then an instruction to write it again, then its first line: the continuation mostly repeats."""
    if fmt not in EDIT_FORMATS:
        raise ValueError(f"unknown edit format {fmt!r}; choose from {sorted(EDIT_FORMATS)}")
    head, marker = EDIT_FORMATS[fmt]
    from tokenmill.model.tokenizer import stdlib_sources

    out = []
    for f in stdlib_sources(held_out_every=10, split="heldout"):
        text = f.read_text(errors="replace")
        lines = text.splitlines()
        body = "\n".join(lines[len(lines) // 3:])
        ids = tokenizer.encode(body)
        if len(ids) < 3 * length:
            continue
        code = tokenizer.decode(ids[:length])
        code = code[:code.rfind("\n") + 1]
        first = code.split("\n", 1)[0]
        prompt = f"{head}{code}\n{marker}\n{first}\n"
        out.append(tokenizer.encode(prompt))
        if len(out) == n:
            break
    return out


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str):
    """All prompts at once; returns (wall s, output tokens, outputs, decode s per request)."""
    first, done, toks = {}, {}, {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = now
                toks[o.request_id] = list(o.output_token_ids)
    wall = time.perf_counter() - t0
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    return wall, sum(len(toks[r]) for r in ids), [toks[r] for r in ids], {r: (first[r], done[r]) for r in ids}


def engines(configs: dict[str, dict], **common) -> dict[str, LLMEngine]:
    out = {}
    for name, kw in configs.items():
        kw = dict(kw)
        general = kw.pop("general_draft_path", False)  # the draft proposer without spec/draft_loop.py (A/B)
        if kw.get("speculative_model") == "demo-draft":
            kw["speculative_model"] = DRAFT
        out[name] = e = LLMEngine(model=MODEL, **common, **kw)
        if general:
            e.spec.proposer.loop = None
    return out


NUM_THREADS: int | None = None  # --num-threads (torch's threads are per process: one value for every engine)
MODEL, DRAFT = "demo", "demo-draft"  # --model / --draft: a candidate pair instead of the shipped one


def bench_interleaved(title: str, configs: dict[str, dict], prompts: list[list[int]], max_tokens: int,
                      batch: int, repeats: int) -> None:
    es = engines(configs, kv_cache_bytes="256MiB", num_threads=NUM_THREADS)
    for e in es.values():  # warm-up (kernels, allocator, the auto policy's first cost samples)
        run_batch(e, prompts[:batch], 16, "warm")
    wall = {n: 0.0 for n in es}
    ntok = {n: 0 for n in es}
    decode_s = {n: [] for n in es}
    outs = {n: [] for n in es}
    t_start = time.perf_counter()
    for _ in range(repeats):
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            for n, e in es.items():  # interleaved: a drift of the shared machine hits every configuration
                w, k, o, times = run_batch(e, group, max_tokens, f"{n}-{i}-{_}")
                wall[n] += w
                ntok[n] += k
                outs[n].extend(o)
                decode_s[n].extend((d - f) / (max_tokens - 1) for f, d in times.values())
    base = next(iter(es))
    print(f"\n### {title}\n")
    print(f"{len(prompts)} prompts x {repeats} repeats, batch {batch}, {max_tokens} greedy tokens each, "
          f"torch threads {torch.get_num_threads()}; {capabilities().summary()}\n")
    print("| config | output tok/s | speedup vs off | mean TPOT ms | identical to off | acceptance | tokens/verify "
          "| chosen k (seq-steps) | k switches /req/min |")
    print("|---|---:|---:|---:|---|---:|---:|---|---:|")
    for n, e in es.items():
        tps = ntok[n] / wall[n]
        s = e.stats().spec
        same = "yes" if outs[n] == outs[base] else f"NO ({sum(a != b for a, b in zip(outs[n], outs[base]))} differ)"
        req_min = sum(decode_s[n]) * (max_tokens - 1) / 60
        sw = f"{s.num_k_switches / req_min:.1f}" if s is not None and req_min else "–"
        acc = f"{s.acceptance_rate:.3f} | {s.mean_accepted_length:.2f} | {dict(sorted(s.chosen_k.items()))}" \
            if s is not None else "– | – | –"
        print(f"| {n} | {tps:.1f} | {tps / (ntok[base] / wall[base]):.2f}x | "
              f"{1000 * statistics.mean(decode_s[n]):.2f} | {same} | {acc} | {sw} |")
    for n, e in es.items():  # auto's goodput guard (engine/spec/guard.py): the cap it settled on per bucket
        g = e.spec.guard if e.spec is not None else None
        if g is not None:
            caps = {b: (st.cur, st.num_probes) for b, st in sorted(g.buckets.items())}
            rates = {b: {k: round(a.rate()) for k, a in sorted(st.arms.items())} for b, st in sorted(g.buckets.items())}
            print(f"\n{n}: guard (bucket: cap, probes) {caps}, cap switches {g.num_switches}, "
                  f"measured tok/s per cap {rates}, probe cost ms "
                  f"{ {b: round(1e3 * st.probe_cost, 2) if st.probe_cost is not None else None for b, st in sorted(g.buckets.items())} }")
            if hasattr(g, "matched_rates"):  # the content-matched rates the guard compares (session 14)
                print(f"{n}: content-matched tok/s per cap "
                      f"{ {b: {k: round(v) for k, v in g.matched_rates(b).items()} for b in sorted(g.buckets)} }")
    print(f"\n({time.perf_counter() - t_start:.0f} s)")


def cmd_batch1(a) -> None:
    e = LLMEngine(model=MODEL, kv_cache_bytes="64MiB")
    prompts = heldout_prompts(e.tokenizer, a.prompts, a.prompt_len)
    del e
    configs = {"off": {}}
    for k in a.k:
        configs[f"demo-draft k={k}"] = dict(speculative_model="demo-draft", num_speculative_tokens=k)
    for k in a.general_k:
        configs[f"demo-draft k={k} general path"] = dict(speculative_model="demo-draft", num_speculative_tokens=k,
                                                          general_draft_path=True)
    configs["demo-draft auto"] = dict(speculative_model="demo-draft", num_speculative_tokens="auto")
    for k in a.ngram_k:
        configs[f"ngram k={k}"] = dict(speculative_model="ngram", num_speculative_tokens=k)
    configs["ngram auto"] = dict(speculative_model="ngram", num_speculative_tokens="auto")
    bench_interleaved("Batch 1, held-out code prompts", configs, prompts, a.max_tokens, 1, a.repeats)


def cmd_edit(a) -> None:
    e = LLMEngine(model=MODEL, kv_cache_bytes="64MiB")
    prompts = edit_prompts(e.tokenizer, a.prompts, a.prompt_len, a.format)
    del e
    configs = {"off": {}}
    for k in a.ngram_k:
        configs[f"ngram k={k}"] = dict(speculative_model="ngram", num_speculative_tokens=k)
    configs["ngram auto"] = dict(speculative_model="ngram", num_speculative_tokens="auto")
    for k in a.draft_k:
        configs[f"demo-draft k={k}"] = dict(speculative_model="demo-draft", num_speculative_tokens=k)
    if a.draft_auto:
        configs["demo-draft auto"] = dict(speculative_model="demo-draft", num_speculative_tokens="auto")
    bench_interleaved(f"Batch 1, edit workload (ngram), format {a.format}", configs, prompts, a.max_tokens, 1, a.repeats)


def cmd_sweep(a) -> None:
    e = LLMEngine(model=MODEL, kv_cache_bytes="64MiB")
    base = heldout_prompts(e.tokenizer, 16, a.prompt_len)
    del e
    configs = {"off": {}, "demo-draft k=4": dict(speculative_model="demo-draft", num_speculative_tokens=4),
               "demo-draft auto": dict(speculative_model="demo-draft", num_speculative_tokens="auto"),
               "ngram k=4": dict(speculative_model="ngram", num_speculative_tokens=4),
               "ngram auto": dict(speculative_model="ngram", num_speculative_tokens="auto")}
    for c in a.concurrency:
        prompts = [base[i % len(base)] for i in range(c * a.groups)]
        bench_interleaved(f"Concurrency {c} (closed batches of {c})", configs, prompts, a.max_tokens, c, 1)


OVERHEAD_SCRIPT = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from tokenmill import LLM, SamplingParams
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from offline_throughput import workload
prompts, outs = workload(64, 64, 512, 64, 256, 4096, 0)
llm = LLM("demo", kv_cache_bytes="1GiB", max_num_batched_tokens=2048)
llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
t = time.perf_counter()
res = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs])
dt = time.perf_counter() - t
print("RESULT " + json.dumps({"tok_s": sum(len(r.outputs[0].token_ids) for r in res) / dt}))
'''


def cmd_overhead(a) -> None:
    """Speculation off on this checkout vs `--base` (a checkout without speculative decoding), the offline
    throughput shape (64 requests, 64-512 prompt, 64-256 output tokens, demo), alternated in subprocesses."""
    res = {"base": [], "this": []}
    for _ in range(a.repeats):
        for name, root in (("base", a.base), ("this", str(REPO))):
            env = dict(os.environ, PYTHONPATH=root)
            p = subprocess.run([sys.executable, "-c", OVERHEAD_SCRIPT, root], capture_output=True, text=True, env=env,
                               cwd=root)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"{name} failed:\n{p.stderr[-2000:]}")
            res[name].append(json.loads(line[0][7:])["tok_s"])
    print(f"\n### Speculation off vs {a.base} (offline_throughput shape: 64 requests, demo)\n")
    print(capabilities().summary() + "\n")
    print("| checkout | output tok/s (each run) | median |")
    print("|---|---|---:|")
    for n, v in res.items():
        print(f"| {n} | {', '.join(f'{x:.0f}' for x in v)} | {statistics.median(v):.0f} |")
    print(f"\nthis / base = {statistics.median(res['this']) / statistics.median(res['base']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("batch1")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--ngram-k", type=int, nargs="*", default=[4], help="fixed k of the ngram configurations")
    p.add_argument("--general-k", type=int, nargs="*", default=[4],
                   help="also these k with the draft proposer's general path (one runner.execute per draft step)")
    p.set_defaults(func=cmd_batch1)
    p = sub.add_parser("edit")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ngram-k", type=int, nargs="*", default=[4, 8], help="fixed k of the ngram configurations")
    p.add_argument("--draft-k", type=int, nargs="*", default=[3], help="fixed k of the demo-draft configurations")
    p.add_argument("--draft-auto", action="store_true", help="also demo-draft with k = auto")
    p.add_argument("--format", choices=sorted(EDIT_FORMATS), default="reformatted",
                   help="the instruction between the code and its copy (before-after: one training never used)")
    p.set_defaults(func=cmd_edit)
    p = sub.add_parser("sweep")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--groups", type=int, default=2, help="closed batches per concurrency level")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=96)
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("overhead")
    p.add_argument("--base", required=True, help="a checkout without speculative decoding (e.g. git archive of main)")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=cmd_overhead)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads for every engine (default: torch's)")
    ap.add_argument("--model", default="demo", help="target: a shipped name or an HF directory (default demo)")
    ap.add_argument("--draft", default="demo-draft",
                    help="what the 'demo-draft' rows draft with: a shipped name or an HF directory")
    a = ap.parse_args()
    global NUM_THREADS, MODEL, DRAFT
    NUM_THREADS, MODEL, DRAFT = a.num_threads, a.model, a.draft
    a.func(a)


if __name__ == "__main__":
    main()
