"""Small-batch decode: where a token's time goes between `LLM.generate` and the kernels, in one process.

    python benchmarks/decode_overhead.py --model /tmp/m/small-bf16 --threads 2 --configs auto+int8 --batch 1 4

For each tokenmill config (DTYPE[+int8][@KV] as in offline_throughput.py) one engine is loaded and greedy requests
(`--batch` of them at once, `--tokens` tokens each after a 32-token prompt, ignore_eos) run through `LLM.generate`
`--rounds` times, alternating the runner's decode fast path on and off (`ModelRunner.decode_fast_path`, see
runner.py; TOKENMILL_DECODE_FAST_PATH=0 turns it off for a whole process). Every part of a step is wrapped with a
wall clock (~0.3 us per wrapper: small beside the parts) and printed as ms per decode step (mean over the best
round's decode steps: a one-token round's time, the prompts' prefill, is subtracted), from the outside in:

- generate loop: `LLM.generate` minus `engine.step` (its per-output bookkeeping);
- output processor: detokenization and stop strings (`OutputProcessor.process_step`);
- schedule: `Scheduler.schedule`;
- runner inputs: `ModelRunner.execute` minus the model's forward and head (metadata, tensors);
- embedding + dispatch: the model's forward minus the fused stack;
- fused stack: the `FusedDecodeStack` call (every layer in one C++ call, with its argument passing);
- head: the packed lm_head fused with the argmax (`greedy_tokens`);
- postprocess: `LLMEngine._postprocess` (tokens to requests, stop checks, outputs);
- step rest: `LLMEngine.step` minus all of the above.

Last, `kernels alone`: the same fused stack + head called back to back on one step's inputs (no engine), the
kernels' own time in this process, and the weight-bytes floor at both read-bandwidth probes (see
`offline_throughput.measure_read_bandwidth`).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

PARTS = ["generate loop", "output processor", "schedule", "runner inputs", "embedding + dispatch", "fused stack",
         "head", "postprocess", "step rest"]


class Timers:
    def __init__(self):
        self.spent = collections.defaultdict(float)
        self.steps = 0

    def wrap(self, obj, attr, name):
        fn = getattr(obj, attr)
        spent = self.spent

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        setattr(obj, attr, wrapper)
        return fn


class TimedStack:
    """A FusedDecodeStack whose calls are timed (everything else passes through)."""

    def __init__(self, inner, spent):
        self._inner, self._spent = inner, spent

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._inner(*a, **k)
        finally:
            self._spent["fused stack"] += time.perf_counter() - t


def _timed_generate(llm, prompts, tokens, timers):
    from tokenmill import SamplingParams

    timers.spent.clear()
    steps0 = llm.engine.num_steps
    t = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    wall = time.perf_counter() - t
    return wall, llm.engine.num_steps - steps0, dict(timers.spent), [r.outputs[0].token_ids for r in res]


def run_round(llm, prompts, tokens, timers):
    """The decode steps alone: a round of `tokens` tokens minus a round of one token (the prompts' prefill step,
    which reads the same weights but runs a GEMM over the prompt, and their first token). Returns (wall, decode
    steps, parts: seconds over those steps, tokens)."""
    w1, n1, s1, _ = _timed_generate(llm, prompts, 1, timers)
    wall, steps, s, toks = _timed_generate(llm, prompts, tokens, timers)
    wall, steps = wall - w1, steps - n1
    s = {k: v - s1.get(k, 0.0) for k, v in s.items()}
    parts = {
        "generate loop": wall - s["step"],
        "output processor": s["output processor"],
        "schedule": s["schedule"],
        "runner inputs": s["execute"] - s["forward"] - s["head"],
        "embedding + dispatch": s["forward"] - s["fused stack"],
        "fused stack": s["fused stack"],
        "head": s["head"],
        "postprocess": s["postprocess"],
    }
    parts["step rest"] = s["step"] - sum(v for k, v in parts.items() if k != "generate loop")
    return wall, steps, parts, toks


def kernels_alone(llm, b, reps=200):
    """ms of one fused stack + head call on a decode step's inputs of b sequences (back to back, no engine)."""
    eng = llm.engine
    runner, model = eng.runner, eng.runner.model
    if model.fused is None:
        return None
    from tokenmill.model.attention import AttentionMetadata

    bs, ctx = runner.block_size, 41  # each sequence: 3 blocks of its own, the new token at position 40
    nblk = -(-ctx // bs)
    tables = torch.tensor([list(range(i * nblk, (i + 1) * nblk)) for i in range(b)])
    meta = AttentionMetadata(slot_mapping=tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs, spans=[],
                             decode_token_idx=torch.arange(b), decode_block_tables=tables,
                             decode_ctx_lens=torch.full((b,), ctx), decode_mask=None,
                             sliding_window=runner.sliding_window)
    pos = torch.full((b,), ctx - 1)
    x = model.embed_tokens(torch.full((b,), 5))
    times = []
    with torch.inference_mode():
        for i in range(reps + 10):
            xx = x.clone()
            t = time.perf_counter()
            h = model.fused(xx, pos, model.rope, runner.kv_caches, meta)
            model.greedy_tokens(h)
            if i >= 10:
                times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times), 1000 * min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", nargs="+", default=["auto+int8"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from offline_throughput import measure_read_bandwidth

    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}")
    print(f"# model {args.model}, torch threads {torch.get_num_threads()}, {args.tokens} tokens per request, "
          f"best of {args.rounds} rounds per path (fast path on / off alternating)\n")
    rows, kernel_rows = [], []
    for spec in args.configs:
        spec, _, kv = spec.partition("@")
        dtype, _, quant = spec.partition("+")
        llm = LLM(args.model, kv_cache_bytes="1GiB", max_model_len=2048, enable_prefix_caching=False, dtype=dtype,
                  quantization=quant or "none", kv_cache_dtype=kv or "auto")
        eng = llm.engine
        model = eng.runner.model
        name = f"--dtype {dtype}" + (f" --quantization {quant}" if quant else "") + (
            f" --kv-cache-dtype {kv}" if kv else "") + f" ({str(eng.dtype).replace('torch.', '')})"
        timers = Timers()
        # instance attributes shadow the methods for this engine only
        timers.wrap(eng, "step", "step")
        timers.wrap(eng.scheduler, "schedule", "schedule")
        timers.wrap(eng.runner, "execute", "execute")
        timers.wrap(eng, "_postprocess", "postprocess")
        timers.wrap(eng.output_processor, "process_step", "output processor")
        timers.wrap(model, "forward", "forward")
        timers.wrap(model, "greedy_tokens", "head")
        if model.fused is not None:  # the model calls the stack object: time it through a wrapper
            model.fused = TimedStack(model.fused, timers.spent)
        g = torch.Generator().manual_seed(0)
        for b in args.batch:
            prompts = [torch.randint(1, min(4096, model.cfg.vocab_size), (32,), generator=g).tolist()
                       for _ in range(b)]
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            best, toks = {}, {}
            paths = [("fast path", True), ("reference", False)] if hasattr(eng.runner, "decode_fast_path") else [
                ("reference", None)]
            for _ in range(args.rounds):
                for path, on in paths:
                    if on is not None:
                        eng.runner.decode_fast_path = on
                    r = run_round(llm, prompts, args.tokens, timers)
                    if path not in best or r[0] < best[path][0]:
                        best[path] = r
                    toks.setdefault(path, r[3])
            if hasattr(eng.runner, "decode_fast_path"):
                eng.runner.decode_fast_path = True
            same = len({str(t) for t in toks.values()}) == 1
            for path, (wall, steps, parts, _) in best.items():
                rows.append((name, b, path, 1000 * wall / steps, {k: 1000 * v / steps for k, v in parts.items()},
                             same))
            ka = kernels_alone(llm, b)
            if ka is not None:
                kernel_rows.append((name, b, ka, model.decode_read_bytes, measure_read_bandwidth(model.decode_read_bytes)))
        del llm
    print("| config | batch | path | ms per decode step (prefill round subtracted) | " + " | ".join(PARTS) +
          " | same tokens |")
    print("|---|---|---|---|" + "---|" * len(PARTS) + "---|")
    for name, b, path, ms, parts, same in rows:
        print(f"| {name} | {b} | {path} | {ms:.3f} | " + " | ".join(f"{parts[p]:.3f}" for p in PARTS) +
              f" | {same} |")
    if kernel_rows:
        print("\n| config | batch | kernels alone ms (median / best) | weights read per step | DRAM probe GB/s | "
              "weights-size probe GB/s | floor ms (faster probe) | engine step (fast path) / floor | kernels / floor |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, b, (med, lo), nbytes, bw in kernel_rows:
            floor = nbytes / bw.floor_bps * 1e3
            eng_ms = min(ms for n, bb, path, ms, _, _ in rows if n == name and bb == b and path != "reference")
            print(f"| {name} | {b} | {med:.3f} / {lo:.3f} | {nbytes / 1e6:.1f} MB | {bw.dram_gbs:.1f} | "
                  f"{bw.weights_gbs:.1f} | {floor:.3f} | {eng_ms / floor:.2f}x | {med / floor:.2f}x |")


if __name__ == "__main__":
    main()
