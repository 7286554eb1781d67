"""Quality of each precision, in one run: held-out loss and greedy agreement with fp32 on the shipped demo
model (teacher-forced through the serving path; weights, activations and KV cache), and bf16 logits error
against HF transformers beside HF's own bf16 error.

    python benchmarks/precision_quality.py --windows 12
    python benchmarks/precision_quality.py --rows "fp8 W8A8, fp32 activations" "fp32, fp8 KV cache" --presets
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=12, help="held-out windows of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--presets", nargs="*", default=["tiny", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"])
    ap.add_argument("--rows", nargs="*", default=None, help="only these precision rows (their names as printed)")
    args = ap.parse_args()
    from tokenmill.engine.scoring import Scorer, heldout_quality
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)
    spec = importlib.util.spec_from_file_location("train_demo", REPO / "scripts" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    held = td.windows(td.load_stream("heldout"), args.seq_len)
    held = held[torch.linspace(0, len(held) - 1, args.windows).long()]
    ref = Scorer("demo", torch.float32)
    print(f"\ndemo model, {args.windows} held-out windows x {args.seq_len} tokens\n")
    print("KV-cache rows are scored one token at a time (decode order: every earlier token's K/V is read back from")
    print("the cache, the worst case for a quantized cache); the others prefill each window at once.\n")
    print("| precision | held-out loss | vs fp32 | greedy agreement with fp32 (first 64 positions) |")
    print("|---|---|---|---|")
    base = heldout_quality(ref, held)["loss"]
    print(f"| fp32 | {base:.4f} | — | — |")
    rows = [("bf16", torch.bfloat16, "none", None), ("int8 W8A8, bf16 activations", torch.bfloat16, "int8", None),
            ("int8 W8A8, fp32 activations", torch.float32, "int8", None),
            ("fp32, bf16 KV cache", torch.float32, "none", torch.bfloat16),
            ("fp32, int8 KV cache", torch.float32, "none", torch.int8),
            ("bf16, int8 KV cache", torch.bfloat16, "none", torch.int8),
            ("bf16 + int8 W8A8, int8 KV cache", torch.bfloat16, "int8", torch.int8),
            ("fp8 W8A8, fp32 activations", torch.float32, "fp8", None),  # emulated on CPUs: the same numbers
            ("fp32, fp8 KV cache", torch.float32, "none", torch.float8_e4m3fn)]
    unknown = set(args.rows or ()) - {r[0] for r in rows}
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; choose from {[r[0] for r in rows]}")
    for name, dtype, quant, kv in rows:
        if args.rows is not None and name not in args.rows:
            continue
        q = heldout_quality(Scorer("demo", dtype, quantization=quant, kv_dtype=kv), held, reference=ref,
                            chunk=512 if kv is None else 1)
        print(f"| {name} | {q['loss']:.4f} | {100 * (q['loss'] / base - 1):+.3f}% | {100 * q['agreement']:.1f}% |")

    import transformers

    from tokenmill.model.make import make_model

    print("\n| preset | tokenmill bf16 vs HF fp32 (rel. L2 of logits) | HF bf16 vs HF fp32 |")
    print("|---|---|---|")
    ids = torch.randint(1, 4096, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with tempfile.TemporaryDirectory() as d:
        for preset in args.presets:
            path = make_model(preset, Path(d) / preset)
            logits = {}
            for dtype in (torch.float32, torch.bfloat16):
                hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
                with torch.no_grad():
                    logits[dtype] = hf(torch.tensor([ids])).logits[0].float()
            ours = Scorer(path, torch.bfloat16).logits(ids)
            err = lambda a: ((a - logits[torch.float32]).norm() / logits[torch.float32].norm()).item()  # noqa: E731
            print(f"| {preset} | {err(ours):.4f} | {err(logits[torch.bfloat16]):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
