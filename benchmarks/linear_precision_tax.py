"""The dequant tax per linear, on this CPU: the engine's own `Linear` modules in fp32 (oneDNN-packed, small-row kernel
at <= 8 rows), bf16 and int8 W8A8 (`Int8LinearMethod`) and fp8 W8A8 (`Fp8LinearMethod`: no CPU has fp8 instructions, so torch's CPU
`_scaled_mm` converts to fp32 on every call), on the 40M Llama's shapes, per row count.

    python benchmarks/linear_precision_tax.py

Each (shape, rows) times the four precisions in interleaved rounds in one process (best of 3 rounds), and prints
each as a ratio of fp32's time (> 1: slower than fp32), with the int8 path that ran. On a CPU without native bf16 /
int8 dot products (AVX2-only) this is the table of what the formats cost where the hardware lacks them.
"""

from __future__ import annotations

import time

import torch

from tokenmill.hardware import capabilities
from tokenmill.model.linear import Fp8LinearMethod, Int8LinearMethod, Linear

SHAPES = [("gate_up", 512, 2816), ("down", 1408, 512), ("lm_head", 512, 32000)]  # (name, K, N) of the 40M Llama
ROWS = [1, 8, 16, 64]


def make(k: int, n: int, dtype: torch.dtype, int8: bool = False, fp8: bool = False) -> Linear:
    lin = Linear(k, n, dtype=dtype, method=Int8LinearMethod() if int8 else Fp8LinearMethod() if fp8 else None)
    lin.weight.data.copy_(torch.randn(n, k) * 0.05)
    lin.method.process_weights_after_loading(lin)
    return lin


def int8_path(lin: Linear, m: int) -> str:
    """The path Int8LinearMethod.apply takes for m rows (the same tests, in its order)."""
    if getattr(lin, "avx2_panels", None) is not None:  # AVX2 without int8 dot products: csrc/int8_gemm.cpp
        return "AVX2 int8 GEMV (vpmaddubsw)" if m <= Int8LinearMethod.SMALL_ROWS else "AVX2 exact int8 GEMM (vpmaddwd)"
    if m <= Int8LinearMethod.SMALL_ROWS:
        return "small-row int8 kernel"
    return "int8 GEMM (torch._int_mm)" if lin.int8_gemm else "fp32 matmul on the int8 weight converted per call"


def main():
    torch.set_num_threads(2)
    print(f"# CPU: {capabilities().summary()} | torch threads {torch.get_num_threads()}")
    print("| shape (K->N) | rows | fp32 ms | bf16 / fp32 | int8 W8A8 / fp32 | fp8 W8A8 / fp32 | int8 path |")
    print("|---|---|---|---|---|---|---|")
    for name, k, n in SHAPES:
        lins = {"fp32": make(k, n, torch.float32), "bf16": make(k, n, torch.bfloat16),
                "int8": make(k, n, torch.float32, int8=True), "fp8": make(k, n, torch.float32, fp8=True)}
        for m in ROWS:
            xs = {"fp32": torch.randn(m, k), "bf16": torch.randn(m, k).bfloat16(), "int8": torch.randn(m, k), "fp8": torch.randn(m, k)}
            best = dict.fromkeys(lins, float("inf"))
            reps = 3 if n > 10000 else 8
            for _ in range(3):
                for c, lin in lins.items():
                    lin(xs[c])
                    t = time.perf_counter()
                    for _ in range(reps):
                        lin(xs[c])
                    best[c] = min(best[c], (time.perf_counter() - t) / reps)
            f = best["fp32"]
            print(f"| {name} {k}->{n} | {m} | {f * 1e3:.3f} | {best['bf16'] / f:.2f}x | {best['int8'] / f:.2f}x | {best['fp8'] / f:.2f}x | "
                  f"{int8_path(lins['int8'], m)} |", flush=True)


if __name__ == "__main__":
    main()
