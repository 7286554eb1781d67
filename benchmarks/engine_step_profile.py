"""Where an offline run's time goes: engine phases (schedule / execute / postprocess) and, inside execute,
the time of each heavy op (oneDNN / MKL linears, SDPA, tokenmill's C++ CPU kernels); prints a table.

    python benchmarks/engine_step_profile.py --model /tmp/m/small --threads 1 2    # both, side by side

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
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="torch thread counts, run one after the other in this process (one column each)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="32:256")
    ap.add_argument("--output-len", default="32:128")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto", help="tokenmill --dtype (auto: bf16 where the CPU has native bf16)")
    ap.add_argument("--quantization", default="none", help="tokenmill --quantization (none | int8)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="tokenmill --kv-cache-dtype (auto | float32 | bfloat16 | int8)")
    args = ap.parse_args()

    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.model.cpu_kernels import get_kernels

    torch.set_num_threads(args.threads[0])
    llm = LLM(model=args.model, num_threads=args.threads[0], enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
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
    torch._int_mm = timed("int8 GEMM (torch._int_mm)", torch._int_mm)
    ops += ["SDPA (prefill attention)", "oneDNN linear", "F.linear", "int8 GEMM (torch._int_mm)"]
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.runner.execute = timed("execute", eng.runner.execute)
    eng._postprocess = timed("postprocess", eng._postprocess)

    lo_in, hi_in = map(int, args.input_len.split(":"))
    lo_out, hi_out = map(int, args.output_len.split(":"))
    prompts, outs = workload(args.num_requests, lo_in, hi_in, lo_out, hi_out, min(eng.model_config.vocab_size, 4096), 0)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (kernel build, packing)
    columns = []  # per thread count: (wall, spent, calls)
    for threads in args.threads:
        torch.set_num_threads(threads)
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outs])
        columns.append((time.perf_counter() - t0, dict(spent), dict(calls)))

    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}; {str(eng.dtype).replace('torch.', '')}, "
          f"quantization {args.quantization}, KV cache {str(eng.kv_dtype).replace('torch.', '')}")
    print(f"{args.model}: {args.num_requests} requests, {sum(outs)} output tokens, {columns[0][2]['execute']} steps; "
          + ", ".join(f"{t} thread(s): {w:.2f} s, {sum(outs) / w:.0f} output tok/s" for t, (w, _, _) in
                      zip(args.threads, columns)) + "\n")
    print("| part | " + " | ".join(f"{t} thread(s): s (share) | ms per call" for t in args.threads) + " |")
    print("|---|" + "---|---|" * len(args.threads))
    used = [n for n in ops if any(c.get(n) for _, _, c in columns)]
    used.sort(key=lambda n: -columns[0][1].get(n, 0.0))
    names = ["whole run", "schedule", "execute", "postprocess", "outside step()"] + used + ["execute: the rest"]
    for name in names:
        cells = []
        for wall, sp, ca in columns:
            if name == "whole run":
                sec, n = wall, 0
            elif name == "outside step()":
                sec, n = wall - sum(sp.get(p, 0.0) for p in ("schedule", "execute", "postprocess")), 0
            elif name == "execute: the rest":  # runner Python, embedding, small torch ops, uncounted kernels
                sec, n = sp.get("execute", 0.0) - sum(sp.get(o, 0.0) for o in used), 0
            else:
                sec, n = sp.get(name, 0.0), ca.get(name, 0)
            cells.append(f"{sec:.2f} ({sec / wall:.0%}) | " + (f"{1e3 * sec / n:.3f}" if n else ""))
        label = f"execute: {name}" if name in used else name
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
