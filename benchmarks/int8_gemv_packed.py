"""avx2_int8_gemv on the plain int8 weight [N, K] vs avx2_int8_pack8's layout [N/8, K/32, 8, 32] (session 12): the
33 linears of one decode step of the 40M Llama (8 layers x qkv, o, gate_up, down, then the 32000 x 512 head), 38.9
MB of int8, with --sets weight sets rotated so each pass reads from DRAM (beyond the L3). Checks first that both
layouts give the same bits (outputs and the head's greedy argmax), then times both, interleaved, best of --iters.

  flock /tmp/cpu.lock python benchmarks/int8_gemv_packed.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.hardware import capabilities
from tokenmill.model.cpu_kernels import get_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", type=int, default=10, help="weight sets rotated (10 x 38.9 MB: beyond any L3 here)")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    k = get_kernels()
    if k is None or not hasattr(k, "avx2_int8_pack8") or not k.has_avx2_int8():
        raise SystemExit("this build has no AVX2 int8 kernels (needs an AVX2 CPU and a compiler)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = [(768, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(32000, 512)]
    sets = []
    for _ in range(a.sets):
        ws = [torch.randint(-127, 128, (n, kk), dtype=torch.int8) for n, kk in shapes]
        sets.append([(w, k.avx2_int8_pack8(w), torch.rand(w.shape[0]) * 0.01 + 1e-4) for w in ws])
    for (n, kk), (w, p, sw) in zip(shapes[:4] + shapes[-1:], sets[0][:4] + sets[0][-1:]):
        for m in (1, 4, 8):
            x = torch.randn(m, kk)
            o1, o2 = torch.empty(m, n), torch.empty(m, n)
            assert k.avx2_int8_gemv(o1, x, w, sw, None) and k.avx2_int8_gemv(o2, x, p, sw, None)
            t1, t2 = torch.empty(m, dtype=torch.long), torch.empty(m, dtype=torch.long)
            assert k.avx2_int8_head_argmax(t1, x, w, sw) and k.avx2_int8_head_argmax(t2, x, p, sw)
            if not (torch.equal(o1, o2) and torch.equal(t1, t2)):
                raise SystemExit(f"packed and plain differ at {n}x{kk}, {m} rows")
    nbytes = sum(n * kk for n, kk in shapes)
    print(f"# CPU: {capabilities().summary()} | torch threads {a.threads}; same bits checked (1, 4, 8 rows)")
    print(f"# {len(shapes)} GEMV calls per pass, {nbytes / 1e6:.1f} MB of int8 weights, {a.sets} sets rotated\n")
    print("| rows | round | plain [N, K] ms | GB/s | packed ms | GB/s | packed speedup |")
    print("|---|---|---|---|---|---|---|")
    for rows in (1, 4):
        x = {kk: torch.randn(rows, kk) for kk in (512, 1408)}
        outs = {n: torch.empty(rows, n) for n, _ in shapes}
        for r in range(a.rounds):
            best = {}
            for name, idx in (("plain", 0), ("packed", 1)):
                b = float("inf")
                for it in range(a.iters):
                    st = sets[it % a.sets]
                    t0 = time.perf_counter()
                    for (n, kk), t in zip(shapes, st):
                        k.avx2_int8_gemv(outs[n], x[kk], t[idx], t[2], None)
                    dt = time.perf_counter() - t0
                    if it >= 2:
                        b = min(b, dt)
                best[name] = b
            pl, pk = best["plain"], best["packed"]
            print(f"| {rows} | {r + 1} | {pl * 1e3:.3f} | {nbytes / pl / 1e9:.1f} | {pk * 1e3:.3f} | "
                  f"{nbytes / pk / 1e9:.1f} | {pl / pk:.2f}x |")


if __name__ == "__main__":
    main()
