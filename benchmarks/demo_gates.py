"""The greedy gates a demo-target candidate must pass before it ships (issue 13, item 6), as tokenmill serves it.

    python benchmarks/demo_gates.py                                   # the shipped demo target
    python benchmarks/demo_gates.py --model tokenmill/model/demo/demo --model /tmp/cand/demo

Per target (tokenmill `LLM`, its default dtype for this CPU; greedy, EOS not stopping), one row:
  * sample prompts: distinct 4-grams over 64 tokens of each of scripts/train_demo.py's SAMPLE_PROMPTS (the
    README's prompts among them); tests/model/test_demo_model.py asks mean >= 0.6 and each >= 0.35.
  * held-out continuations: the same ratio over 128 tokens after each of the 8 held-out code prompts of
    `benchmarks/spec_decode.py batch1` (128-token windows of stdlib files never trained on): a target that loops
    there makes every proposer look good (acceptance earned on loops).
  * edit copying: for each format of `spec_decode.py edit`, difflib's similarity between the greedy continuation
    (128 tokens, decoded) and the code the prompt asks to repeat (after its first line): does greedy decoding
    copy? (teacher-forced copying is benchmarks/demo_copy.py.)
Deterministic (no timing): no CPU lock needed beyond its own CPU use (~1 min per target).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from spec_decode import EDIT_FORMATS, edit_prompts, heldout_prompts  # noqa: E402

SHIPPED = ROOT / "tokenmill" / "model" / "demo" / "demo"


def gates(model: str, threads: int | None = None) -> dict:
    import torch

    import train_demo
    from tokenmill import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, kv_cache_bytes="128MiB")
    tok = llm.tokenizer

    def greedy(prompts, n):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    sample = [train_demo.distinct_ngram_ratio(t) for t in greedy(train_demo.SAMPLE_PROMPTS, 64)]
    held = [train_demo.distinct_ngram_ratio(t) for t in greedy(heldout_prompts(tok, 8, 128), 128)]
    edit = {}
    for fmt in EDIT_FORMATS:
        prompts = edit_prompts(tok, 8, 160, fmt)
        sims = []
        for p, t in zip(prompts, greedy(prompts, 128)):
            text = tok.decode(p)
            head, marker = EDIT_FORMATS[fmt]
            code = text[len(head):text.rindex("\n" + marker)]
            want = code.split("\n", 1)[1] if "\n" in code else code  # the prompt already holds the first line
            got = tok.decode(t)
            sims.append(difflib.SequenceMatcher(None, got, want[:len(got)], autojunk=False).ratio())
        edit[fmt] = sum(sims) / len(sims)
    return {"sample_mean": sum(sample) / len(sample), "sample_min": min(sample), "sample": sample,
            "heldout_mean": sum(held) / len(held), "heldout_min": min(held), "edit": edit}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="target HF directory or shipped name (repeatable)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    from tokenmill.hardware import capabilities

    print(f"ISA: {capabilities().summary()}")
    print("| target | sample distinct-4 mean (min) | held-out continuations distinct-4 mean (min) | "
          + " | ".join(f"edit similarity, {f}" for f in EDIT_FORMATS) + " | sample per prompt |")
    print("|---|---:|---:|" + "---:|" * len(EDIT_FORMATS) + "---|")
    for m in a.model or [str(SHIPPED)]:
        g = gates(m, a.threads)
        print(f"| {m} | {g['sample_mean']:.3f} ({g['sample_min']:.2f}) | {g['heldout_mean']:.3f} "
              f"({g['heldout_min']:.2f}) | " + " | ".join(f"{g['edit'][f]:.3f}" for f in EDIT_FORMATS)
              + " | " + ", ".join(f"{x:.2f}" for x in g["sample"]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
