"""Do KV tier loads stall running decodes? Decoders run while long prompts whose KV is on the disk tier arrive.

    python benchmarks/kv_tier_stall.py                        # this checkout
    python benchmarks/kv_tier_stall.py --baseline-tree /tmp/old  # also an older checkout, same run (ratios)
    python benchmarks/kv_tier_stall.py --cold                 # drop the page cache before the loads (root)

One engine, a disk tier in a fresh directory. Phase 1 computes `--prompts` prompts of `--prompt-len` tokens
(write-through puts their blocks on disk), then the pool's prefix cache is emptied (and, with --cold, the
OS page cache too, so the reads come from the device). Phase 2 starts `--decoders` short requests that
decode `--decode-tokens` tokens each; once they are all decoding, the long prompts arrive one every
`--every` steps. Measured: the time between consecutive tokens of the decoders (= the wall time of each step
they are in), split into steps while a tier load was in flight or being installed vs the rest, and the TTFT
of the long prompts; the same workload with the tiers off (recompute) is the reference. Outputs are
compared token for token with tiers off.

Each configuration runs in its own process (`--baseline-tree` runs an older tokenmill checkout there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one(args) -> dict:
    """Run the workload in this process with this process's tokenmill."""
    import torch

    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.hardware import capabilities

    d = tempfile.mkdtemp(prefix="tm-stall-")
    tiers = dict(kv_disk_dir=d, kv_disk_bytes="4GiB") if args.tiers else {}
    eng = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=args.pool_bytes, dtype=args.dtype,
                                 max_model_len=args.prompt_len + 64, **tiers))
    g = torch.Generator().manual_seed(args.seed)
    vocab = eng.model_config.vocab_size
    longs = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    short = [torch.randint(1, vocab, (16,), generator=g).tolist() for _ in range(args.decoders)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def drain():
        while eng.has_unfinished_requests():
            eng.step()

    # phase 1: compute the long prompts once (the tier gets their blocks), then forget them in the pool
    for i, p in enumerate(longs):
        eng.add_request(f"w{i}", p, greedy)
        drain()
    if eng.tiers is not None:
        if hasattr(eng.tiers, "flush"):
            eng.tiers.flush()
    eng.kv.pool.reset_prefix_cache()
    if args.cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    # phase 2: decoders first, then the long prompts arrive while they decode
    dec = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i, p in enumerate(short):
        eng.add_request(f"d{i}", p, dec)
    while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running):
        eng.step()
    arrived, first, outs = {}, {}, {}
    gaps_load, gaps_other = [], []
    step_i, next_long = 0, 0
    while eng.has_unfinished_requests():
        if next_long < len(longs) and step_i % args.every == 0:
            rid = f"L{next_long}"
            eng.add_request(rid, longs[next_long], greedy)
            arrived[rid] = time.perf_counter()
            next_long += 1
        loading = eng.tiers is not None and (getattr(eng.tiers, "loading", False) or bool(eng.scheduler.waiting))
        decoders = sum(1 for r in eng.scheduler.running if r.request_id.startswith("d"))
        t0 = time.perf_counter()
        res = eng.step()
        dt = time.perf_counter() - t0
        step_i += 1
        if decoders and any(o.request_id.startswith("d") and o.new_token_ids for o in res):
            (gaps_load if loading else gaps_other).append(dt)
        for o in res:
            if o.request_id.startswith("L") and o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - arrived[o.request_id]
            if o.finished:
                outs[o.request_id] = (list(o.output_token_ids), o.num_cached_tokens)
    st = eng.stats()
    shutil.rmtree(d, ignore_errors=True)
    gaps = gaps_load + gaps_other
    return {
        "isa": capabilities().summary(),
        "gap_p50_ms": 1e3 * pct(gaps, 0.5), "gap_p99_ms": 1e3 * pct(gaps, 0.99), "gap_max_ms": 1e3 * max(gaps),
        "gap_loading_p50_ms": 1e3 * pct(gaps_load, 0.5), "gap_loading_max_ms": 1e3 * max(gaps_load, default=0),
        "steps_loading": len(gaps_load),
        "ttft_mean_ms": 1e3 * statistics.mean(first.values()), "ttft_max_ms": 1e3 * max(first.values()),
        "cached_share": sum(c for rid, (_, c) in outs.items() if rid.startswith("L")) / (len(longs) * args.prompt_len),
        "outputs": {rid: o for rid, (o, _) in outs.items()},
        "tier": {k: v for k, v in (st.kv_tiers.get("disk") or {}).items()
                 if k in ("hits", "loaded_blocks", "bytes_read", "load_seconds")},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pool-bytes", default="64MiB")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--every", type=int, default=20, help="steps between arrivals of the long prompts")
    ap.add_argument("--cold", action="store_true", help="drop the OS page cache before phase 2 (needs root)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-tree", default=None, help="an older tokenmill checkout to run beside this one")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    args = ap.parse_args()
    if args.one is not None:
        args.tiers = args.one == "tiers"
        print("RESULT " + json.dumps(one(args)))
        return

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [("recompute (tiers off)", here, "off"), ("disk tier, this tree", here, "tiers")]
    if args.baseline_tree:
        runs.append((f"disk tier, {args.baseline_tree}", os.path.abspath(args.baseline_tree), "tiers"))
    results = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--baseline-tree")]
    if "--baseline-tree" in sys.argv:
        i = sys.argv.index("--baseline-tree")
        passthrough = sys.argv[1:i] + sys.argv[i + 2:]
    for name, tree, mode in runs:
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--one", mode],
                              capture_output=True, text=True, env=env, cwd=tree)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results.append((name, json.loads(line[7:])))
    ref = results[0][1]["outputs"]
    print(f"# CPU: {results[0][1]['isa']}")
    print(f"# model {args.model}, dtype {args.dtype}, {args.decoders} decoders x {args.decode_tokens} tokens, "
          f"{args.prompts} prompts x {args.prompt_len} tokens arriving every {args.every} steps"
          f"{', page cache dropped (cold disk)' if args.cold else ''}")
    print("| configuration | decode gap p50 / p99 / max (ms) | gap while loading p50 / max (ms) | steps loading "
          "| long-prompt TTFT mean / max (ms) | cached share | tier blocks loaded | same outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} / {r['gap_max_ms']:.1f} "
              f"| {r['gap_loading_p50_ms']:.1f} / {r['gap_loading_max_ms']:.1f} | {r['steps_loading']} "
              f"| {r['ttft_mean_ms']:.0f} / {r['ttft_max_ms']:.0f} | {r['cached_share']:.0%} "
              f"| {r['tier'].get('loaded_blocks', 0)} | {'yes' if r['outputs'] == ref else 'NO'} |")


if __name__ == "__main__":
    main()
