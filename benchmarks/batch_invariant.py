"""Batch-invariant linears and attention (EngineConfig.batch_invariant, `--batch-invariant`): what they cost and
what they buy, in one run, on the shipped demo model in bf16.

    python benchmarks/batch_invariant.py
    TOKENMILL_AMX=0 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/batch_invariant.py   # an AVX-512 BF16 CPU
                                                                                             # without AMX, on AMX

Tables (each row measured with batch_invariant on and off in the same run, alternating, best of --reps):
  0. per linear: the invariant kernel (PackedWeight under small_row_bits: AMX tiles or linear_rows_bf16) vs oneDNN,
     ms per call at 16 / 64 / 256 / 1,200 rows, for the demo's shapes and Qwen2.5-0.5B's (skip: --no-linears);
     at or below the small-row limit (8; AMX: 256) the plain call is the small-row kernel itself;
  1. offline decode throughput: N requests x 32-token prompts x --max-tokens greedy tokens, all at once;
  2. prefill throughput: --prefill-requests prompts of --prefill-len tokens, max_tokens = 1;
  3. lossless greedy speculation at a large batch (the case that needs it): 4 x --n prompts, 24 tokens, n-gram
     k = 4 vs speculation off, with a KV cache small enough that sequences are preempted (recomputed): how many
     outputs differ.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.hardware import capabilities


def timed(llm, prompts, params):
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    return time.perf_counter() - t, out


def linears() -> None:
    from tokenmill.model.linear import PackedWeight, small_row_bits

    def per_call(f, it):
        f()
        t = time.perf_counter()
        for _ in range(it):
            f()
        return (time.perf_counter() - t) / it * 1e3

    torch.manual_seed(0)
    rows = (16, 64, 256, 1200)
    print("\n| linear (N x K) | " + " | ".join(f"{m} rows: invariant / oneDNN ms" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n, k in [(768, 256), (1408, 256), (256, 704), (4096, 256), (1152, 896), (9728, 896), (896, 4864)]:
        pw = PackedWeight((torch.randn(n, k) * 0.05).bfloat16())
        cells = []
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            it = max(3, int(2e8 / (m * n * k)))
            plain = per_call(lambda: pw(x), it)  # <= the small-row limit (8; AMX 256) this is the small kernel too

            def inv():
                with small_row_bits(True):
                    pw(x)
            t_inv = per_call(inv, it)
            cells.append(f"{t_inv:.3f} / {plain:.3f} ({t_inv / plain:.2f}x)")
        print(f"| {n} x {k} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-requests", type=int, default=16)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-linears", action="store_true")
    args = ap.parse_args()
    print(f"# ISA: {capabilities().summary()}; TOKENMILL_AMX={os.environ.get('TOKENMILL_AMX', '1')} "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}; threads {torch.get_num_threads()}")
    if not args.no_linears:
        linears()
    modes = ("on", "strict", "off")
    llms = {m: LLM(args.model, dtype="bfloat16", kv_cache_bytes="512MiB", max_num_seqs=256, batch_invariant=m,
                   enable_prefix_caching=False) for m in modes}
    for m, llm in llms.items():
        assert llm.engine.batch_invariant == (m != "off")
    g = torch.Generator().manual_seed(0)
    vocab = llms["on"].engine.model_config.vocab_size
    print("\n| workload | on (s) | strict (s) | off (s) | off tok/s | on / off | strict / off |\n|---|---|---|---|---|---|---|")
    rows = [(f"decode, {b} requests x {args.max_tokens} tokens", int(b), 32, args.max_tokens)
            for b in args.batches.split(",")]
    rows.append((f"prefill, {args.prefill_requests} x {args.prefill_len}-token prompts", args.prefill_requests,
                 args.prefill_len, 1))
    for name, n, plen, mt in rows:
        prompts = [torch.randint(3, min(vocab, 4000), (plen,), generator=g).tolist() for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        best = {}
        for m, llm in llms.items():
            timed(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm
        for _ in range(args.reps):
            for m, llm in llms.items():
                dt, _ = timed(llm, prompts, params)
                best[m] = min(best.get(m, 1e9), dt)
        toks = n * (mt if mt > 1 else plen)
        print(f"| {name} | {best['on']:.3f} | {best['strict']:.3f} | {best['off']:.3f} | {toks / best['off']:.0f} "
              f"| {best['off'] / best['on']:.3f} | {best['off'] / best['strict']:.3f} |", flush=True)
    del llms
    # 3: losslessness at a large batch with preemption, and with long prompts prefilled in small chunks
    base = [[3, 4, 5, 6] * 4, [9, 10, 11] * 5, [20, 21] * 7, [7, 8, 9, 10, 11] * 3]
    short = [[(t + i) % 200 + 3 for t in p] for i in range(args.n) for p in base]
    lens = torch.randint(100, 700, (32,), generator=g).tolist()
    long = [torch.randint(3, 4000, (k,), generator=g).tolist() for k in lens]
    print("\n| batch_invariant | workload | KV | outputs that differ (n-gram k=4 vs off) |\n|---|---|---|---|")
    cases = [(f"{len(short)} short repeats, 24 tokens", short, 24, {}),
             (f"{len(long)} prompts of 100-700 tokens, 48 tokens, 61-token chunks", long, 48,
              dict(max_num_batched_tokens=61))]
    for m in ("on", "off"):
        for name, prompts, mt, extra in cases:
            params = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
            for kv in ("32MiB", "256MiB"):
                outs = []
                for spec in ({}, dict(speculative_model="ngram", num_speculative_tokens=4)):
                    llm = LLM(args.model, dtype="bfloat16", kv_cache_bytes=kv, batch_invariant=m, **extra, **spec)
                    outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
                    del llm
                bad = sum(a != b for a, b in zip(*outs))
                print(f"| {m} | {name} | {kv} | {bad} of {len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
