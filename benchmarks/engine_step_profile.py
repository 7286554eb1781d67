"""Where an offline run's time goes: engine phases (schedule / execute / postprocess) and, inside execute,
the time of each heavy op (oneDNN / MKL linears, SDPA, tokenmill's C++ CPU kernels); prints a table.

    python benchmarks/engine_step_profile.py --model /tmp/m/small --threads 1 2    # both, side by side

Same workload as offline_throughput.py (seed 0, 64 requests, input 32-256, output 32-128, greedy,
ignore_eos, prefix caching off). Ops are timed by wrapping their Python entry points with a wall clock
(no profiler: its per-op overhead would distort a 2-core machine), so the shares are of wall time; what is
left of `execute` is the runner's own Python and the small torch ops.

A second table splits the first thread count's run by step kind (decode-only steps by batch size, steps with a
prefill chunk): per step, the time in the linears (oneDNN, int8 GEMM, the C++ small-row kernels), attention
(C++ decode attention, KV writes, SDPA), the one-call fused decoder stack (linears and attention inside it are
not separable from Python), the other C++ ops, the lm_head (`compute_logits`), the runner's metadata (execute
minus the model), the model's own Python and dispatch (forward minus the timed ops), the sampler, the rest of
postprocess, and schedule.
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

    kind = ["?"]  # the step kind of the step in flight (set by schedule)
    by_kind: dict[tuple[str, str], float] = collections.defaultdict(float)
    steps_by_kind: collections.Counter = collections.Counter()
    tokens_by_kind: collections.Counter = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                spent[name] += dt
                calls[name] += 1
                if not in_head[0]:  # an op inside compute_logits counts in the lm_head column only
                    by_kind[(kind[0], name)] += dt
        return wrapper

    in_head = [False]

    def head_scope(fn):
        def wrapper(*a, **k):
            in_head[0] = True
            try:
                return fn(*a, **k)
            finally:
                in_head[0] = False
        return wrapper

    def schedule_with_kind(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            sched = fn(*a, **k)
            dt = time.perf_counter() - t
            kind[0] = step_kind(sched)
            spent["schedule"] += dt
            calls["schedule"] += 1
            by_kind[(kind[0], "schedule")] += dt
            if not sched.empty:
                steps_by_kind[kind[0]] += 1
                tokens_by_kind[kind[0]] += sum(s.num_logits > 0 for s in sched.seqs)
            return sched
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
    fused = getattr(eng.runner.model, "fused", None)
    if fused is not None and fused.use_handle:
        # the fused stack's per-step call goes through its C++ handle (fused_decode.py), not kernels.decoder_stack
        # (timed above, never called then): time the stack object's call under that op's name instead
        eng.runner.model.fused = _TimedStack(fused, timed("C++ decoder_stack", fused))
        if "C++ decoder_stack" not in ops:
            ops.append("C++ decoder_stack")
    eng.scheduler.schedule = schedule_with_kind(eng.scheduler.schedule)
    eng.runner.execute = timed("execute", eng.runner.execute)
    eng._postprocess = timed("postprocess", eng._postprocess)
    model = eng.runner.model
    model.forward = timed("model forward", model.forward)
    model.compute_logits = timed("lm_head (compute_logits)", head_scope(model.compute_logits))
    # an all-greedy step's head fused with the argmax (lm_head.py) counts in the same column
    model.greedy_tokens = timed("lm_head (compute_logits)", head_scope(model.greedy_tokens))
    eng.sampler.sample = timed("sampler", eng.sampler.sample)

    lo_in, hi_in = map(int, args.input_len.split(":"))
    lo_out, hi_out = map(int, args.output_len.split(":"))
    prompts, outs = workload(args.num_requests, lo_in, hi_in, lo_out, hi_out, min(eng.model_config.vocab_size, 4096), 0)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (kernel build, packing)
    columns = []  # per thread count: (wall, spent, calls)
    for threads in args.threads:
        torch.set_num_threads(threads)
        spent.clear()
        calls.clear()
        by_kind.clear()
        steps_by_kind.clear()
        tokens_by_kind.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outs])
        columns.append((time.perf_counter() - t0, dict(spent), dict(calls)))
        if len(columns) == 1:
            kinds = (dict(by_kind), dict(steps_by_kind), dict(tokens_by_kind))

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
    print_by_kind(*kinds, used, args.threads[0])
    return 0


class _TimedStack:
    """A FusedDecodeStack whose calls go through `call` (a timed wrapper of it); everything else passes through."""

    def __init__(self, inner, call):
        self._inner, self._call = inner, call

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *a, **k):
        return self._call(*a, **k)


KIND_ORDER = ["decode-only, batch 1-8", "decode-only, batch 9-32", "decode-only, batch 33-64",
              "decode-only, batch > 64", "prefill chunk(s) + decodes", "prefill chunk(s) only"]


def step_kind(sched) -> str:
    dec = sum(1 for s in sched.seqs if len(s.token_ids) == 1 and not s.num_spec_slots)
    if dec < len(sched.seqs):
        return "prefill chunk(s) + decodes" if dec else "prefill chunk(s) only"
    for hi, name in ((8, KIND_ORDER[0]), (32, KIND_ORDER[1]), (64, KIND_ORDER[2])):
        if dec <= hi:
            return name
    return KIND_ORDER[3]


def op_group(op: str) -> str:
    if op in ("oneDNN linear", "F.linear", "int8 GEMM (torch._int_mm)") or any(
            w in op for w in ("linear_small", "quantize_rows", "dequant_rows")):
        return "linears"
    if op == "SDPA (prefill attention)" or any(
            w in op for w in ("paged_decode_attention", "write_kv", "prefill_attention")):
        return "attention + KV write"
    if "decoder_stack" in op:
        return "fused decoder stack (C++)"
    return "other C++ (norms, rope, silu)"


def print_by_kind(by_kind, steps, tokens, ops, threads) -> None:
    """Per step kind, ms per step in each part (see the module docstring)."""
    groups = ["linears", "attention + KV write", "fused decoder stack (C++)", "other C++ (norms, rope, silu)"]
    cols = ["steps", "sampled tokens", "step ms"] + groups + [
        "model Python + dispatch", "lm_head", "runner metadata", "sampler", "postprocess rest", "schedule"]
    print(f"\nBy step kind ({threads} thread(s)), ms per step:\n")
    print("| step kind | " + " | ".join(cols) + " | share of run |")
    print("|---|" + "---|" * (len(cols) + 1))
    total = sum(by_kind.get((k, p), 0.0) for k in KIND_ORDER for p in ("schedule", "execute", "postprocess"))
    for k in KIND_ORDER:
        n = steps.get(k, 0)
        if not n:
            continue
        g = {x: 0.0 for x in groups}
        for op in ops:
            g[op_group(op)] += by_kind.get((k, op), 0.0)
        fwd, head = by_kind.get((k, "model forward"), 0.0), by_kind.get((k, "lm_head (compute_logits)"), 0.0)
        ex, post = by_kind.get((k, "execute"), 0.0), by_kind.get((k, "postprocess"), 0.0)
        samp, sch = by_kind.get((k, "sampler"), 0.0), by_kind.get((k, "schedule"), 0.0)
        step = sch + ex + post
        vals = [n, tokens.get(k, 0), step] + [g[x] for x in groups] + [
            fwd - sum(g.values()), head, ex - fwd - head, samp, post - samp, sch]
        cells = [str(vals[0]), str(vals[1])] + [f"{1e3 * v / n:.2f}" for v in vals[2:]]
        print(f"| {k} | " + " | ".join(cells) + f" | {step / total:.0%} |")
    print("\n(the lm_head column is compute_logits whole: its linear and the copy to fp32; the op columns are the ops "
          "inside the model's forward; `model Python + dispatch` is forward minus them)")


if __name__ == "__main__":
    raise SystemExit(main())
