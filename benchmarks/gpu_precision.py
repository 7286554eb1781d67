"""GPU precision check (issue 11's GPU targets), one prepared run for a lent device:

    python benchmarks/gpu_precision.py --out /tmp/gpu            # on the device machine (CUDA)
    python benchmarks/gpu_precision.py --device cpu --preset tiny --layers 2 --tokens 8   # a smoke run anywhere
    python benchmarks/gpu_precision.py --fake-cuda --preset small --tokens 4 --requests 2  # the CUDA path, no GPU

`--fake-cuda` runs this script's CUDA path on a machine without a GPU (tokenmill/testing/fake_cuda.py: every op's
shapes, dtypes and devices checked by PyTorch's fake tensors, no value computed; the bandwidth is a nominal
4.8 TB/s and every time printed is meaningless): run it before spending a lent device's minutes.

1. An 8B-shaped model (preset llama-3.1-8b, random weights; `--layers N` keeps N of its 32 layers: the ratio to
   the roofline is per layer, and fewer layers load faster) written once with `tokenmill model make`.
2. HBM read bandwidth: the best of repeated `x.sum()` passes over a buffer 4x the GPU's L2 and at least 1 GiB.
3. Batch-1 decode, bf16 and fp8 weights (`--quantization fp8`, torch._scaled_mm): ms per token (best of 3 runs of
   `--tokens` tokens after a 32-token prompt) against the roofline, the weight bytes one step reads
   (`model.decode_read_bytes`) / the measured bandwidth. Target: bf16 >= 70% of the roofline. `+graphs` configs run
   the decode steps as captured CUDA graphs (`--cuda-graphs`, engine/graphs.py; max_model_len 1024): eager PyTorch
   pays CPU time per launched kernel, ~1,500 per bf16 step of this shape (benchmarks/cuda_step_ops.py).
4. Throughput, bf16 vs fp8 weights (and fp8 KV): `--requests` requests of 512 prompt + 128 output tokens, output
   tokens/s and the fp8 / bf16 ratio.
Prints the tables with the device line; writes result.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def read_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (default: all)")
    ap.add_argument("--model-dir", default="/tmp/gpu_precision_model")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per batch-1 run")
    ap.add_argument("--requests", type=int, default=64, help="throughput: requests of 512 + 128 tokens")
    ap.add_argument("--kv-cache-bytes", default="16GiB")
    ap.add_argument("--configs", default="bf16,bf16+graphs,fp8,fp8+graphs,fp8+fp8kv",
                    help="comma list of bf16 | fp8 | fp8+fp8kv, each optionally +graphs (--cuda-graphs, max_model_len "
                         "1024)")
    ap.add_argument("--out", default="/tmp/gpu_precision")
    ap.add_argument("--fake-cuda", action="store_true", help="a dry run of the CUDA path without a GPU (fake "
                    "tensors: shapes, dtypes, devices checked; times meaningless)")
    args = ap.parse_args(argv)
    if args.fake_cuda:
        from tokenmill.testing.fake_cuda import fake_cuda

        with fake_cuda() as fc:
            rc = _run(args, fake=True)
        print(f"# fake CUDA: {fc.executed} model steps ran on the fake device; logits/tokens "
              f"{sorted({(str(d), dev) for d, dev, _ in fc.outputs})}")
        return rc
    return _run(args, fake=False)


def _run(args, fake: bool) -> int:

    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities
    from tokenmill.model.make import make_model

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    caps = capabilities()
    print(f"# device: {caps.summary()}; torch {torch.__version__}")
    mdir = Path(args.model_dir)
    if not (mdir / "config.json").exists():
        t = time.perf_counter()
        make_model(args.preset, mdir, dtype="bfloat16",
                   overrides={"num_hidden_layers": args.layers} if args.layers else None)
        print(f"# made {args.preset} ({args.layers or 'all'} layers) in {time.perf_counter() - t:.0f} s")
    if fake:
        bw = 4.8e12
        print("# read bandwidth: nominal 4800 GB/s (fake CUDA: nothing measured)")
    else:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 32 << 20
        bw = read_bandwidth(device, max(1 << 30, 4 * l2))
        print(f"# read bandwidth {bw / 1e9:.0f} GB/s (x.sum() over {max(1 << 30, 4 * l2) >> 20} MiB)")

    rows, results = [], {"device": caps.to_json(), "torch": torch.__version__, "bandwidth_bps": bw, "configs": {}}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 1000, (32,), generator=g).tolist()
    prompts = [torch.randint(1, 1000, (512,), generator=g).tolist() for _ in range(args.requests)]
    dtype = "bfloat16" if device.type == "cuda" or caps.native_bf16 else "float32"
    for name in args.configs.split(","):
        parts = name.split("+")
        if parts[0] not in ("bf16", "fp8") or not set(parts[1:]) <= {"fp8kv", "graphs"}:
            print(f"unknown config {name!r} (bf16 | fp8 | fp8+fp8kv, each optionally +graphs)", file=sys.stderr)
            return 2
        quant = "fp8" if parts[0] == "fp8" else "none"
        kv = "fp8" if "fp8kv" in parts else "auto"
        graphs = dict(cuda_graphs=True, max_model_len=1024) if "graphs" in parts else {}
        llm = LLM(str(mdir), device=args.device, dtype=dtype, quantization=quant, kv_cache_dtype=kv,
                  kv_cache_bytes=args.kv_cache_bytes, max_num_batched_tokens=8192, **graphs)
        model = llm.engine.runner.model
        one = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            llm.generate([prompt], one)
            best = min(best, (time.perf_counter() - t) / args.tokens)
        floor = model.decode_read_bytes / bw
        tp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, tp)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        r = {"ms_per_token_batch1": best * 1e3, "decode_read_bytes": model.decode_read_bytes,
             "roofline_ms": floor * 1e3, "of_roofline": floor / best, "output_tok_s": n_out / dt,
             "describe": llm.engine.describe()}
        results["configs"][name] = r
        rows.append((name, r))
        del llm, model
        if device.type == "cuda" and not fake:
            torch.cuda.empty_cache()
    base = results["configs"].get("bf16", {}).get("output_tok_s")
    print("\n| config | batch-1 ms/token | weight bytes/step | roofline ms | % of roofline | output tok/s "
          f"({args.requests} x 512+128) | vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['ms_per_token_batch1']:.2f} | {r['decode_read_bytes'] / 1e9:.2f} GB | "
              f"{r['roofline_ms']:.2f} | {100 * r['of_roofline']:.0f}% | {r['output_tok_s']:.0f} | {ratio} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
