"""Greedy repetition check of a demo target as tokenmill serves it (bf16 where native): distinct 4-grams over 64
greedy tokens (scripts/train_demo.py distinct_ngram_ratio; 1.0 = no 4-gram repeats, a loop of period p ~ p/61) for
the README's three prompts, two more sample prompts and 32 held-out `def`/`class` line prompts (from stdlib files no
demo model trained on). docs/demo_model.md "Session 20" and "Session 21".

    python scripts/demo_repetition.py                       # the shipped target
    python scripts/demo_repetition.py /tmp/s21/p1/demo      # a candidate directory
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo import SAMPLE_PROMPTS, distinct_ngram_ratio  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.tokenizer import stdlib_sources  # noqa: E402

README = SAMPLE_PROMPTS[:3]  # "def fibonacci(n):", "import os\n", "def add(a, b):"


def heldout_line_prompts(n: int = 32) -> list[str]:
    """A `def`/`class` line from a third of the way into each held-out file, cut after its `(`."""
    pat = re.compile(r"^( *)(def|class) (\w+)\(?([^\n]{0,30})", re.M)
    out = []
    for f in stdlib_sources(held_out_every=10, split="heldout"):
        t = f.read_text(encoding="utf-8", errors="replace")
        m = pat.search(t, len(t) // 3)
        if m:
            line = t[m.start(): t.find("\n", m.start())]
            out.append(line[: line.find("(") + 1] if "(" in line else line)
        if len(out) >= n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="demo")
    ap.add_argument("--show", type=int, default=5, help="print this many continuations")
    a = ap.parse_args()
    held = heldout_line_prompts()
    prompts = SAMPLE_PROMPTS + held
    llm = LLM(a.model, kv_cache_bytes="64MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    r = [distinct_ngram_ratio(o.outputs[0].token_ids) for o in outs]
    for p, o, x in list(zip(prompts, outs, r))[: a.show]:
        print(f"--- {p!r} {x:.3f}\n{p}{o.outputs[0].text[:260]}")
    k = len(SAMPLE_PROMPTS)
    print(f"README prompts mean {statistics.mean(r[:3]):.3f} min {min(r[:3]):.3f}; sample prompts {[round(x, 3) for x in r[:k]]}; "
          f"held-out {len(held)} mean {statistics.mean(r[k:]):.3f} min {min(r[k:]):.3f} below 0.5: "
          f"{sum(x < 0.5 for x in r[k:])}")


if __name__ == "__main__":
    main()
