"""Where an offline run's time goes: engine phases (schedule / execute / postprocess) and, inside execute,
the time of each heavy op (oneDNN / MKL linears, SDPA, tokenmill's C++ CPU kernels); prints a table.

    python benchmarks/engine_step_profile.py --model /tmp/m/small --threads 1
    python benchmarks/engine_step_profile.py --model /tmp/m/small --threads 2

Same workload as offline_throughput.py (seed 0, 64 requests, input 32-256, output 32-128, greedy,
ignore_eos, prefix caching off). Ops are timed by wrapping their Python entry points with a wall clock
(no profiler: its per-op overhead would distort a 2-core machine), so the shares are of wall time; what is
left of `execute` is the runner's own Python and the small torch ops.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="32:256")
    ap.add_argument("--output-len", default="32:128")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.model.cpu_kernels import get_kernels

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, num_threads=args.threads, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                calls[name] += 1
        return wrapper

    ops = []
    kernels = get_kernels()
    if kernels is not None:
        for name in dir(kernels):
            if not name.startswith("_") and callable(getattr(kernels, name)):
                setattr(kernels, name, timed(f"C++ {name}", getattr(kernels, name)))
                ops.append(f"C++ {name}")
    F.scaled_dot_product_attention = timed("SDPA (prefill attention)", F.scaled_dot_product_attention)
    torch.ops.mkldnn._linear_pointwise = timed("oneDNN linear", torch.ops.mkldnn._linear_pointwise)
    F.linear = timed("F.linear", F.linear)
    ops += ["SDPA (prefill attention)", "oneDNN linear", "F.linear"]
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.runner.execute = timed("execute", eng.runner.execute)
    eng._postprocess = timed("postprocess", eng._postprocess)

    lo_in, hi_in = map(int, args.input_len.split(":"))
    lo_out, hi_out = map(int, args.output_len.split(":"))
    prompts, outs = workload(args.num_requests, lo_in, hi_in, lo_out, hi_out, min(eng.model_config.vocab_size, 4096), 0)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (kernel build, packing)
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outs])
    wall = time.perf_counter() - t0

    print(f"{args.model}: {args.num_requests} requests, {sum(outs)} output tokens, {args.threads} thread(s): "
          f"{wall:.2f} s, {sum(outs) / wall:.0f} output tok/s, {calls['execute']} steps\n")
    print("| part | seconds | share of wall | calls | ms per call |")
    print("|---|---|---|---|---|")
    rows = [(p, spent[p]) for p in ("schedule", "execute", "postprocess")]
    rows.append(("outside step()", wall - sum(v for _, v in rows)))
    in_ops = 0.0
    for name in sorted(ops, key=lambda n: -spent[n]):
        if calls[name]:
            rows.append((f"  execute: {name}", spent[name]))
            in_ops += spent[name]
    rows.append(("  execute: the rest (runner Python, small torch ops)", spent["execute"] - in_ops))
    for name, sec in rows:
        n = calls.get(name.replace("  execute: ", ""), 0)
        per = f"{1e3 * sec / n:.3f}" if n else ""
        print(f"| {name} | {sec:.2f} | {sec / wall:.0%} | {n or ''} | {per} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
