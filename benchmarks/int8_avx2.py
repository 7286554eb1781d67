"""Per-shape linear timings on this CPU: fp32 (what `--dtype auto` runs here: linear_small for <= 8 rows, oneDNN's
prepacked GEMM above), the int8 path before session 10 on a CPU without int8 dot products (linear_small_int8 with
float activations for <= 8 rows; above, the W8A8 fallback that converts the whole int8 weight to fp32 on every call
and runs an fp32 matmul), and the AVX2 exact W8A8 kernels (csrc/int8_gemm.cpp: avx2_int8_gemv <= 8 rows,
avx2_int8_gemm above); for <= 8 rows also the GEMV's two inner kernels (session 11: vpmaddubsw on |w| and
x * sign(w), 32 products per instruction; before it: vpmovsxbw + vpmaddwd, 16; the same bits, switched with
`set_avx2_int8_u8`). Shapes: the linears of the 40M demo Llama (hidden 512, intermediate 1408, 8 heads, 4 KV heads); then its int8 lm_head (32000 x 512): the module path's
GEMV + argmax_rows against the fused `avx2_int8_head_argmax` (no logits written).

All variants run interleaved in one process, best of --repeats rounds (memory bandwidth on shared VMs moves
between minutes). GOP/s-eq = 2*M*N*K / time. Batch-1 rows also show the weight-bytes floor from a read-bandwidth
probe (the offline_throughput probe: torch sum over a buffer of that weight's size and over 256 MiB).

  flock /tmp/cpu.lock python benchmarks/int8_avx2.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (768, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408)}


def _best(fn, reps, inner):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activation dtype")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill.hardware import capabilities
    from tokenmill.model.cpu_kernels import get_kernels
    from tokenmill.model.linear import PackedWeight

    k = get_kernels()
    assert k is not None and k.has_avx2_int8(), "needs the compiled CPU kernels with AVX2"
    dt = getattr(torch, args.dtype)
    print(f"# CPU: {capabilities().summary()}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, activations {args.dtype}; "
          f"best of {args.repeats} interleaved rounds; times in us")
    from offline_throughput import _best_sum_rate  # noqa: E402  (benchmarks/ on sys.path when run as a script)

    dram = max(_best_sum_rate(256 << 20, 5) for _ in range(3))
    print(f"# read-bandwidth probe: 256 MiB sum {dram / 1e9:.1f} GB/s")
    print("| shape (N x K) | rows | fp32 us | int8 before us | int8 AVX2 us | AVX2 gemv i16 us | fp32 GOP/s | "
          "int8 AVX2 GOP/s-eq | AVX2 vs fp32 | AVX2 vs before | u8 vs i16 gemv | batch-1: int8 bytes floor us (probe GB/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, kk) in SHAPES.items():
        w = torch.randn(n, kk, generator=gen) * 0.05
        sw = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        w8 = torch.round(w / sw[:, None]).clamp_(-127, 127).to(torch.int8)
        w8_t = w8.t().contiguous()
        panels = k.avx2_int8_pack(w8)
        pw = PackedWeight(w.to(dt))
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, kk, generator=gen).to(dt)
            out = torch.empty(m, n, dtype=dt)

            def fp32():
                pw(x)

            def before():
                if m <= 8:
                    k.linear_small_int8(out, x, w8, sw, None)
                else:
                    xf = x.float()
                    sx = xf.abs().amax(dim=1, keepdim=True) / 127.0
                    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
                    q = torch.round(xf / sx).clamp_(-127, 127)
                    ((q @ w8_t.float()) * sx * sw).to(dt)

            def avx2():
                if m > 8 or not k.avx2_int8_gemv(out, x, w8, sw, None):
                    k.avx2_int8_gemm(out, x, panels, sw, None)

            def avx2_i16():  # the GEMV's vpmovsxbw + vpmaddwd kernel (same bits)
                prev = k.set_avx2_int8_u8(False)
                try:
                    avx2()
                finally:
                    k.set_avx2_int8_u8(prev)

            inner = max(1, int(2e6 / (m * n * kk) * 20))
            fns = {"fp32": fp32, "before": before, "avx2": avx2}
            if m <= 8:
                fns["i16"] = avx2_i16
            for f in fns.values():
                f()
            best = {key: float("inf") for key in fns}
            for _ in range(args.repeats):
                for key, f in fns.items():
                    best[key] = min(best[key], _best(f, 1, inner))
            ops = 2 * m * n * kk
            floor = ""
            if m == 1:
                wb = max(_best_sum_rate(n * kk, 20) for _ in range(3))
                floor = f"{n * kk / max(wb, dram) * 1e6:.1f} ({max(wb, dram) / 1e9:.0f})"
            i16 = f"{best['i16'] * 1e6:.1f}" if "i16" in best else ""
            ratio = f"{best['i16'] / best['avx2']:.2f}x" if "i16" in best else ""
            print(f"| {name} ({n} x {kk}) | {m} | {best['fp32'] * 1e6:.1f} | {best['before'] * 1e6:.1f} | "
                  f"{best['avx2'] * 1e6:.1f} | {i16} | {ops / best['fp32'] / 1e9:.0f} | {ops / best['avx2'] / 1e9:.0f} | "
                  f"{best['fp32'] / best['avx2']:.2f}x | {best['before'] / best['avx2']:.2f}x | {ratio} | {floor} |")

    # the int8 lm_head (tied 32000 x 512): logits + argmax (the module path) vs the fused greedy kernel
    v, kk = 32000, 512
    w = torch.randn(v, kk, generator=gen) * 0.05
    sw = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    w8 = torch.round(w / sw[:, None]).clamp_(-127, 127).to(torch.int8)
    wb = max(_best_sum_rate(v * kk, 20) for _ in range(3))
    print(f"\n| int8 lm_head ({v} x {kk}) | rows | i16 gemv + argmax us | u8 gemv + argmax us | fused u8 greedy us | "
          f"fused vs i16 path | GB/s (fused) | floor us (probe GB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (1, 4, 8):
        x = torch.randn(m, kk, generator=gen).to(dt)
        out = torch.empty(m, v, dtype=dt)
        tok = torch.empty(m, dtype=torch.long)

        def path(u8):
            def f():
                prev = k.set_avx2_int8_u8(u8)
                try:
                    k.avx2_int8_gemv(out, x, w8, sw, None)
                finally:
                    k.set_avx2_int8_u8(prev)
                k.argmax_rows(tok, out)
            return f

        def fused():
            k.avx2_int8_head_argmax(tok, x, w8, sw)

        fns = {"i16": path(False), "u8": path(True), "fused": fused}
        best = {key: float("inf") for key in fns}
        for _ in range(args.repeats):
            for key, f in fns.items():
                best[key] = min(best[key], _best(f, 1, 5))
        floor = v * kk / max(wb, dram)
        print(f"| head | {m} | {best['i16'] * 1e6:.1f} | {best['u8'] * 1e6:.1f} | {best['fused'] * 1e6:.1f} | "
              f"{best['i16'] / best['fused']:.2f}x | {v * kk / best['fused'] / 1e9:.1f} | "
              f"{floor * 1e6:.1f} ({max(wb, dram) / 1e9:.0f}) |")


if __name__ == "__main__":
    main()
