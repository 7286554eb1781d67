"""Where an eager CUDA engine step's time goes at N decoding sequences (needs a GPU).

    python benchmarks/cuda_step_profile.py --batch 1 8 32            # demo, bf16, eager
    python benchmarks/cuda_step_profile.py --batch 32 --cuda-graphs  # the captured decode step

Session 23 served the demo on an H200 with eager steps of ~25 ms (~0.4 ms more per decoding sequence), where a
captured forward at 32 sequences took ~2.4 ms. This splits decode-only steps into the engine's parts (each
timed with a device synchronisation around the runner): the whole `step()`, the runner's `execute` (model +
head, synchronised), the rest (scheduling, sampling, output processing), and prints the top ops of one step by
CPU time (torch.profiler): launch-bound Python, a host sync, or per-sequence work shows there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=30, help="decode-only steps timed per batch size")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (its numbers are the CPU's)")
    args = ap.parse_args(argv)

    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities
    from tokenmill.testing.prompts import heldout_code_prompts

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here (--device cpu for a dry run)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"# device: {capabilities().summary()}; torch {torch.__version__}")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
              **({"max_model_len": 512} if args.cuda_graphs else {}))
    eng = llm.engine
    runner = eng.runner
    real_execute = runner.execute
    spent = []

    def timed(*a, **k):
        sync()
        t = time.perf_counter()
        out = real_execute(*a, **k)
        sync()
        spent.append(time.perf_counter() - t)
        return out

    runner.execute = timed
    prompts = heldout_code_prompts(llm.tokenizer, max(args.batch), 100)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    print("| decoding seqs | step ms (median) | runner.execute ms | rest of the step ms | execute share |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.batch:
        for i in range(n):
            eng.add_request(f"b{n}-{i}", prompts[i], params)
        while any(r.num_tokens - r.num_computed_tokens > 1 for r in eng.scheduler.running) or eng.scheduler.num_waiting:
            eng.step()
        for _ in range(3):
            eng.step()
        steps, execs = [], []
        for _ in range(args.steps):
            spent.clear()
            sync()
            t = time.perf_counter()
            eng.step()
            sync()
            steps.append(time.perf_counter() - t)
            execs.append(sum(spent))
        s, e = statistics.median(steps) * 1e3, statistics.median(execs) * 1e3
        print(f"| {n} | {s:.2f} | {e:.2f} | {s - e:.2f} | {e / s:.0%} |", flush=True)
        if n == max(args.batch):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                eng.step()
                sync()
            print(f"\n# one step at {n} sequences, top ops by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50))
        for i in range(n):
            eng.abort_request(f"b{n}-{i}")
        while eng.has_unfinished_requests():
            eng.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
