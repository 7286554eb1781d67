"""The CUDA batch-invariant rule (model/invariant.py: fixed tiles) forced on this CPU, bf16, without the C++ kernels.

    python benchmarks/cpu_fixed_tiles.py [--prompts 24] [--max-tokens 48]

On a CPU `--batch-invariant on` uses the engine's own kernels; this forces the CUDA path's fixed tiles instead
(`TOKENMILL_CPU_KERNELS=0`, PyTorch's oneDNN bf16 GEMMs, whose kernel also depends on the row count) to see the
rule work on real numerics without a GPU: greedy output with speculation vs without, tiles off and on, a small
KV cache (preemptions). Prints sequences differing from the same mode's plain engine and the wall times.
"""

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    os.environ["TOKENMILL_CPU_KERNELS"] = "0"
    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities
    from tokenmill.testing.prompts import heldout_code_prompts

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(tiles, **kw):
        llm = LLM("demo", dtype="bfloat16", num_threads=1, kv_cache_bytes="2MiB", max_num_seqs=args.prompts,
                  batch_invariant="off", **kw)
        if tiles:  # what the engine sets for `--batch-invariant on` on CUDA
            r = llm.engine.runner
            r.batch_invariant, r.invariant_attention, r.tiles = True, "strict", True
        prompts = heldout_code_prompts(llm.tokenizer, args.prompts, 150)
        t = time.perf_counter()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return out, time.perf_counter() - t, llm.engine.scheduler.num_preemptions

    print(f"# {capabilities().summary()}")
    print("| fixed tiles | config | differing from plain (same mode) | of | preemptions plain / config | s plain / config |")
    print("|---|---|---:|---:|---|---|")
    for tiles in (False, True):
        ref, t0, p0 = run(tiles)
        for name, kw in (("ngram k4", dict(speculative_model="ngram", num_speculative_tokens=4)),
                         ("draft auto", dict(speculative_model="demo-draft", num_speculative_tokens="auto"))):
            got, t1, p1 = run(tiles, **kw)
            diff = sum(a != b for a, b in zip(got, ref))
            print(f"| {'on' if tiles else 'off'} | {name} | {diff} | {len(ref)} | {p0} / {p1} | {t0:.1f} / {t1:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
