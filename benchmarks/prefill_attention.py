"""Prefill attention alone, at a prefill step's shapes: the C++ varlen kernel (one call for all sequences,
csrc/prefill_attention.cpp) beside the PyTorch path (per-sequence SDPA, TOKENMILL_PREFILL_ATTN=0), same inputs.

    python benchmarks/prefill_attention.py --threads 2 --lens 300,250,400,180,350,280,288 --cached 0
    python benchmarks/prefill_attention.py --threads 2 --lens 512,512 --cached 1024   # chunks over a prefix hit

Prints ms per layer call and effective GFLOP/s (causal: 4 * heads * head_dim * attended pairs), per dtype.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill.model import attention
from tokenmill.model.attention import AttentionMetadata, Int8KVCache, SeqSpan, paged_attention


def build(lens, cached, nh, kvh, hd, dtype, kv_dtype, bs=16):
    g = torch.Generator().manual_seed(0)
    total_blocks = sum(-(-(cached + n) // bs) for n in lens) + 1
    if kv_dtype == torch.int8:
        cache = Int8KVCache.empty(total_blocks, kvh, bs, hd, "cpu")
    else:
        cache = torch.zeros(2, total_blocks, kvh, bs, hd, dtype=kv_dtype)
    perm = torch.randperm(total_blocks, generator=g).tolist()
    spans, slots, prev, q0 = [], [], [], 0
    for n in lens:
        t = [perm.pop() for _ in range(-(-(cached + n) // bs))]
        prev += [t[p // bs] * bs + p % bs for p in range(cached)]
        slots += [t[p // bs] * bs + p % bs for p in range(cached, cached + n)]
        spans.append(SeqSpan(q0, n, cached + n, torch.tensor(t)))
        q0 += n
    if prev:
        kp, vp = (torch.randn(len(prev), kvh, hd, generator=g).to(dtype) for _ in range(2))
        w = attention.write_kv_scaled if kv_dtype == torch.int8 else attention.write_kv
        w(cache, kp, vp, torch.tensor(prev))
    q = torch.randn(q0, nh, hd, generator=g).to(dtype)
    k, v = (torch.randn(q0, kvh, hd, generator=g).to(dtype) for _ in range(2))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), spans=spans, decode_token_idx=None,
                             decode_block_tables=None, decode_ctx_lens=None)
    return q, k, v, cache, meta


def timed(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lens", default="300,250,400,180,350,280,288", help="new tokens per sequence")
    ap.add_argument("--cached", type=int, default=0, help="tokens already cached per sequence")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill.hardware import capabilities
    from tokenmill.model.cpu_kernels import get_kernels

    if get_kernels() is None:
        raise SystemExit("the C++ CPU kernels are unavailable here (TOKENMILL_CPU_KERNELS=0 or no compiler)")
    lens = [int(x) for x in args.lens.split(",")]
    pairs = sum(n * args.cached + n * (n + 1) // 2 for n in lens)
    flop = 4 * args.heads * args.head_dim * pairs
    print(f"# CPU: {capabilities().summary()}; {args.threads} thread(s); lens {lens}, cached {args.cached}, "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}")
    print("| q dtype | KV cache | PyTorch per-sequence SDPA ms | C++ varlen ms | speedup | C++ GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for dtype, kv in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8), (torch.float32, torch.float32)):
        q, k, v, cache, meta = build(lens, args.cached, args.heads, args.kv_heads, args.head_dim, dtype, kv)
        scale = args.head_dim ** -0.5
        res = {}
        for on in ("0", "1"):
            os.environ["TOKENMILL_PREFILL_ATTN"] = on

            def call():
                meta.prefill_args = None
                paged_attention(q, k, v, cache, meta, scale)
            res[on] = timed(call, args.reps)
        name = lambda t: str(t).replace("torch.", "")  # noqa: E731
        print(f"| {name(dtype)} | {name(kv)} | {res['0'] * 1e3:.2f} | {res['1'] * 1e3:.2f} | "
              f"{res['0'] / res['1']:.2f}x | {flop / res['1'] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
