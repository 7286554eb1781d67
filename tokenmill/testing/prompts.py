"""Prompts the tests share with benchmarks/spec_decode.py."""

from __future__ import annotations


def heldout_code_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`length`-token windows, a third of the way into each stdlib file the demo models never trained on (the
    held-out split, files of at least 4 x `length` tokens), the first n such files: benchmarks/spec_decode.py's
    held-out prompts."""
    from tokenmill.model.tokenizer import stdlib_sources

    out = []
    for f in stdlib_sources(held_out_every=10, split="heldout"):
        ids = tokenizer.encode(f.read_text(errors="replace"))
        if len(ids) >= 4 * length:
            out.append(ids[len(ids) // 3:len(ids) // 3 + length])
        if len(out) == n:
            break
    return out
