"""Does a demo target copy from its prompt? Teacher-forced checks of candidate demo models (issue 13, item 6).

    python benchmarks/demo_copy.py                                  # the shipped demo target
    python benchmarks/demo_copy.py --model tokenmill/model/demo/demo --model /tmp/cand/demo

Per model (HF transformers, fp32, the saved bf16 weights), one row:
  * `[r, r]` repeat CE: 16 rows of 64 random token ids (>= 100) shown twice; cross entropy (nats per token) on
    the second showing. ~10.6 = no induction at all (the first showing scores the same); near 0 = copies.
  * copy test, per edit format of `benchmarks/spec_decode.py edit` (`reformatted`: the training markers'
    style; `before-after`: a format no training marker holds): held-out code, the format's marker, then the
    same code again; cross entropy and argmax accuracy on the second occurrence (the tokens a perfect copier
    predicts exactly). A model that ignores its prompt scores as on fresh code (~4 nats, ~30%).
  * held-out loss: cross entropy on 64 evenly spaced 512-token windows of the held-out stdlib files.
  * greedy distinct-4: the mean distinct 4-gram share of 64 greedy tokens from scripts/train_demo.py's sample
    prompts (the repetition check of docs/demo_model.md; 1.0 = no 4-gram repeats).
Deterministic: no timing, so no CPU lock is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from spec_decode import EDIT_FORMATS  # noqa: E402

SHIPPED = ROOT / "tokenmill" / "model" / "demo" / "demo"


def repeat_ce(model, vocab: int, rows: int = 16, length: int = 64, seed: int = 20261203) -> float:
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(100, vocab, (rows, length), generator=g)
    seq = torch.cat([r, r], dim=1)
    logits = model(input_ids=seq[:, :-1]).logits[:, length - 1 :]
    return F.cross_entropy(logits.reshape(-1, vocab).float(), seq[:, length:].reshape(-1)).item()


def copy_rows(tok, fmt: str, n: int, length: int = 160) -> list[tuple[list[int], int]]:
    """(token ids, start of the copy span) for n held-out files: HEAD code MARKER code (as spec_decode.py's edit
    prompts build them, with the whole code again instead of its first line)."""
    from tokenmill.model.tokenizer import stdlib_sources

    head, marker = EDIT_FORMATS[fmt]
    out = []
    for f in stdlib_sources(held_out_every=10, split="heldout"):
        lines = f.read_text(errors="replace").splitlines()
        ids = tok.encode("\n".join(lines[len(lines) // 3 :]))
        if len(ids) < 3 * length:
            continue
        code = tok.decode(ids[:length])
        code = code[: code.rfind("\n") + 1]
        prefix = tok.encode(f"{head}{code}\n{marker}\n")
        full = tok.encode(f"{head}{code}\n{marker}\n{code}")
        if full[: len(prefix)] != prefix:  # a BPE merge across the boundary: skip the file
            continue
        out.append((full, len(prefix)))
        if len(out) == n:
            break
    return out


def copy_test(model, rows) -> tuple[float, float]:
    nll = hit = n = 0.0
    for ids, start in rows:
        x = torch.tensor([ids])
        logits = model(input_ids=x[:, :-1]).logits[0, start - 1 :].float()
        y = x[0, start:]
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        hit += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    return nll / n, hit / n


def heldout_loss(model, windows: torch.Tensor) -> float:
    nll = n = 0.0
    for i in range(0, len(windows), 8):
        b = windows[i : i + 8]
        logits = model(input_ids=b[:, :-1]).logits.float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        n += b[:, 1:].numel()
    return nll / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="demo target directories (default: the shipped one)")
    ap.add_argument("--files", type=int, default=16, help="held-out files per copy test")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    import train_demo
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}")
    held = train_demo.windows(train_demo.load_stream("heldout"), 512)
    held = held[torch.linspace(0, len(held) - 1, 64).long()]
    print("| model | [r, r] repeat CE | copy CE / acc (reformatted) | copy CE / acc (before-after) | held-out loss | greedy distinct-4 |")
    print("|---|---:|---|---|---:|---:|")
    for d in args.model or [str(SHIPPED)]:
        tok = Tokenizer.from_file(str(Path(d) / "tokenizer.json"))

        class _Tok:
            def encode(self, s):
                return tok.encode(s, add_special_tokens=False).ids

            def decode(self, ids):
                return tok.decode(ids, skip_special_tokens=False)

        t = _Tok()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            rr = repeat_ce(model, model.config.vocab_size)
            cols = [copy_test(model, copy_rows(t, fmt, args.files)) for fmt in ("reformatted", "before-after")]
            hl = heldout_loss(model, held)
        distinct = [s["distinct_4gram"] for s in train_demo.samples(Path(d))]
        print(f"| {d} | {rr:.2f} | {cols[0][0]:.2f} / {cols[0][1]:.2f} | {cols[1][0]:.2f} / {cols[1][1]:.2f} | "
              f"{hl:.3f} | {sum(distinct) / len(distinct):.3f} ({', '.join(f'{x:.2f}' for x in distinct)}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
