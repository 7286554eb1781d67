"""The CUDA path on a real GPU, one prepared run for a lent device (numbers, not only shapes):

    python scripts/cuda_check.py --out /tmp/cc                 # on the device machine
    python scripts/cuda_check.py --fake-cuda --out /tmp/cc     # a dry run of the same code path without a GPU

1. Logits vs HF transformers on the same GPU (the independent reference), fp32 (TF32 off) and bf16, per
   architecture preset (random weights) and the shipped demo model: a 100-token prefill, 3 decode steps and a
   chunked prefill batched with a decode, through engine/scoring.py's Scorer (the real KV manager + runner).
2. Greedy output of the demo pair with speculation (n-gram k = 4, draft k = 4, both `auto`) and with
   `--cuda-graphs`, each against the plain engine on the GPU, 48 held-out code prompts at once in a KV cache
   small enough to preempt: sequences that differ from the plain run, per dtype.
3. Batch-1 decode speed of those configs (the demo models on a GPU are launch-bound: a step's cost is its
   kernel launches, so tokens accepted per step is the lever), and output tokens/s with `--batch` requests at once.
Prints tables with the device line; writes result.json under --out. Exit status 1 if a parity check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def parity(path: str, device: str, dtype: torch.dtype, fake: bool) -> dict:
    """tokenmill vs HF logits on one device and dtype, the worst relative error of each phase: against HF in the
    same dtype, and (bf16) against HF in fp32 beside HF bf16's own error against fp32 — two bf16 implementations
    round differently, so the fair test of ours is that it is no further from the fp32 logits than HF's is."""
    from tokenmill.engine.scoring import Scorer, make_request

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (120,), generator=g).tolist()
    h = Scorer(path, dtype=dtype, device=device)
    a = make_request("a", ids)
    (pre,) = h.run([(a, 100)])
    dec = [h.run([(a, 1)])[0] for _ in range(3)]
    b = make_request("b", ids[:90] + [5, 6, 7])
    chunks = [h.run([(b, n), (a, 1)])[0] for n in (7, 30, 41, 15)]
    ours = {"prefill": pre, "decode": torch.cat(dec), "chunked": torch.cat(chunks)}
    if fake:
        return {k: None for k in ours}
    import transformers

    def refs(dt):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="eager").to(device)
        with torch.no_grad():
            ra = hf(torch.tensor([ids], device=device)).logits[0].float()
            rb = hf(torch.tensor([b.all_token_ids], device=device)).logits[0].float()
        return {"prefill": ra[:100], "decode": ra[100:103], "chunked": rb}

    same = refs(dtype)
    out = {k: rel_err(ours[k], same[k]) for k in ours}
    if dtype != torch.float32:
        f32 = refs(torch.float32)
        out["ours_vs_fp32"] = max(rel_err(ours[k], f32[k]) for k in ours)
        out["hf_vs_fp32"] = max(rel_err(same[k], f32[k]) for k in ours)
    return out


def run_all(llm, prompts, params):
    """Token ids per prompt, and how many requests ended other than by length or stop (a failed step)."""
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], sum(o.outputs[0].finish_reason not in ("length", "stop") for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/cuda_check")
    ap.add_argument("--fake-cuda", action="store_true", help="dry run without a GPU (tokenmill/testing/fake_cuda.py)")
    ap.add_argument("--sections", default="parity,lossless,speed,batch")
    ap.add_argument("--batch", type=int, default=32, help="requests at once in the batch section")
    ap.add_argument("--presets", default="tiny,tiny-llama3,tiny-mistral,tiny-qwen2,tiny-qwen3")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speed-configs", default=None,
                    help="comma-separated config names for the speed and batch sections (default: every config "
                         "without '+ invariant'); e.g. 'plain,plain + invariant,ngram auto + invariant'")
    args = ap.parse_args(argv)
    if args.fake_cuda:
        from tokenmill.testing.fake_cuda import fake_cuda

        with fake_cuda() as fc:
            rc = run(args, fake=True)
        print(f"# fake CUDA: {fc.executed} model steps ran on the fake device (times and numbers meaningless)")
        return rc
    if not torch.cuda.is_available():
        print("no CUDA device here (--fake-cuda for a dry run)", file=sys.stderr)
        return 2
    return run(args, fake=False)


def run(args, fake: bool) -> int:
    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities
    from tokenmill.model.make import make_model
    from tokenmill.model.loader import resolve_model_path
    from tokenmill.testing.prompts import heldout_code_prompts

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    result: dict = {"device": capabilities().summary(), "torch": torch.__version__}
    print(f"# device: {result['device']}; torch {torch.__version__}", flush=True)
    failed = []

    if "parity" in sections:
        rows = []
        models = {p: str(out / f"m-{p}") for p in args.presets.split(",") if p}
        for p, d in models.items():
            if not (Path(d) / "config.json").exists():
                make_model(p, d, dtype="float32")
        models["demo"] = str(resolve_model_path("demo"))
        print("| model | dtype | prefill rel err vs HF (same dtype) | decode | chunked + decode | ours vs HF fp32 | "
              "HF bf16 vs HF fp32 |\n|---|---|---:|---:|---:|---:|---:|")
        for name, path in models.items():
            for dt in (torch.float32, torch.bfloat16):
                t = time.perf_counter()
                try:
                    r = parity(path, "cuda", dt, fake)
                except Exception as e:  # one failure must not hide the rest of the run
                    r = {"error": f"{type(e).__name__}: {e}"}
                r["seconds"] = time.perf_counter() - t
                if "error" in r or fake:
                    bad = "error" in r
                elif dt == torch.float32:
                    bad = max(r[k] for k in ("prefill", "decode", "chunked")) > 1e-4
                else:  # no further from fp32 than HF's own bf16 (with a little room)
                    bad = r["ours_vs_fp32"] > 1.25 * r["hf_vs_fp32"] + 1e-3
                if bad:
                    failed.append(f"parity {name} {dt}")
                rows.append({"model": name, "dtype": str(dt), **r})
                cells = ([f"{r[k]:.2e}" if r[k] is not None else "-" for k in ("prefill", "decode", "chunked")]
                         + [f"{r[k]:.2e}" if r.get(k) is not None else "-" for k in ("ours_vs_fp32", "hf_vs_fp32")]
                         if "error" not in r else [r["error"][:80], "", "", "", ""])
                print(f"| {name} | {str(dt)[6:]} | " + " | ".join(cells) + (" FAIL" if bad else "") + " |", flush=True)
        result["parity"] = rows

    configs = {"plain": {}, "ngram k4": dict(speculative_model="ngram", num_speculative_tokens=4),
               "draft k4": dict(speculative_model="demo-draft", num_speculative_tokens=4),
               "ngram auto": dict(speculative_model="ngram", num_speculative_tokens="auto"),
               "draft auto": dict(speculative_model="demo-draft", num_speculative_tokens="auto"),
               "graphs": dict(cuda_graphs=True, max_model_len=512),
               "draft k4 + graphs": dict(speculative_model="demo-draft", num_speculative_tokens=4, cuda_graphs=True,
                                         max_model_len=512)}
    # --batch-invariant on (fixed tiles, model/invariant.py): bf16 greedy output with speculation vs the same mode's
    # plain engine (its first row is the reference of the rows after it)
    invariant = {f"{name} + invariant": dict(kw, batch_invariant="on")
                 for name, kw in configs.items() if "graphs" not in name}
    if "lossless" in sections:
        rows = []
        print("\n| dtype | config | sequences differing from plain | of | preemptions | failed requests | s |\n"
              "|---|---|---:|---:|---:|---:|---:|")
        groups = [("float32", configs), ("bfloat16", configs), ("bfloat16", invariant)]
        for dtype, group in groups:
            ref = None
            for name, kw in group.items():
                t = time.perf_counter()
                try:
                    llm = LLM("demo", device="cuda", dtype=dtype, kv_cache_bytes="6MiB", max_num_seqs=48, **kw)
                    prompts = heldout_code_prompts(llm.tokenizer, args.prompts, 200)
                    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
                    toks, errors = run_all(llm, prompts, params)
                    pre = llm.engine.scheduler.num_preemptions if hasattr(llm.engine.scheduler, "num_preemptions") else None
                    del llm
                except Exception as e:
                    failed.append(f"lossless {dtype} {name}")
                    rows.append({"dtype": dtype, "config": name, "error": f"{type(e).__name__}: {e}"})
                    print(f"| {dtype} | {name} | ERROR {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
                    continue
                if ref is None:
                    ref = toks
                diff = sum(a != b for a, b in zip(toks, ref))
                if errors:
                    failed.append(f"lossless {dtype} {name}: {errors} requests failed")
                rows.append({"dtype": dtype, "config": name, "differ": diff, "of": len(ref), "preemptions": pre,
                             "failed_requests": errors, "seconds": time.perf_counter() - t})
                print(f"| {dtype} | {name} | {diff} | {len(ref)} | {pre} | {errors} | {time.perf_counter() - t:.1f} |",
                      flush=True)
        result["lossless"] = rows

    every = {**configs, **invariant}
    if args.speed_configs:
        unknown = [n for n in args.speed_configs.split(",") if n not in every]
        if unknown:
            raise SystemExit(f"--speed-configs: unknown {unknown}; choose from {list(every)}")
        speed_configs = {n: every[n] for n in args.speed_configs.split(",")}
    else:
        speed_configs = configs
    if "speed" in sections:
        rows = []
        print("\n| config (bf16, batch 1) | ms / output token | x plain |\n|---|---:|---:|")
        base = None
        for name, kw in speed_configs.items():
            try:
                llm = LLM("demo", device="cuda", dtype="bfloat16", **kw)
                prompts = heldout_code_prompts(llm.tokenizer, 4, 200)
                params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                best = float("inf")
                for p in prompts:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    (o,) = llm.generate([p], params)
                    best = min(best, (time.perf_counter() - t) / len(o.outputs[0].token_ids))
                del llm
            except Exception as e:
                rows.append({"config": name, "error": f"{type(e).__name__}: {e}"})
                print(f"| {name} | ERROR {type(e).__name__}: {str(e)[:120]} | |", flush=True)
                continue
            base = base or best
            rows.append({"config": name, "ms_per_token": best * 1e3, "speedup": base / best})
            print(f"| {name} | {best * 1e3:.2f} | {base / best:.2f}x |", flush=True)
        result["speed"] = rows

    if "batch" in sections:  # the same configs with `--batch` requests at once: does speculation still pay?
        rows = []
        print(f"\n| config (bf16, {args.batch} requests at once) | output tok/s | x plain | differ from plain |\n"
              "|---|---:|---:|---:|")
        base = ref = None
        for name, kw in speed_configs.items():
            try:
                llm = LLM("demo", device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch, 8), **kw)
                prompts = heldout_code_prompts(llm.tokenizer, args.batch, 200)
                params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                t = time.perf_counter()
                toks, errors = run_all(llm, prompts, params)
                rate = sum(map(len, toks)) / (time.perf_counter() - t)
                del llm
            except Exception as e:
                rows.append({"config": name, "error": f"{type(e).__name__}: {e}"})
                print(f"| {name} | ERROR {type(e).__name__}: {str(e)[:120]} | | |", flush=True)
                continue
            base, ref = base or rate, ref or toks
            diff = sum(a != b for a, b in zip(toks, ref))
            rows.append({"config": name, "output_tok_s": rate, "speedup": rate / base, "differ": diff,
                         "failed_requests": errors})
            print(f"| {name} | {rate:.0f} | {rate / base:.2f}x | {diff} |", flush=True)
        result["batch"] = rows

    result["failed"] = failed
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"\n# failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
