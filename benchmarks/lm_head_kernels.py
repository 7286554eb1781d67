"""The lm_head alone at decode batch sizes: oneDNN's prepacked bf16 GEMM (what `PackedWeight` runs for more than 8
rows), the small-row kernel (`linear_small`, at most 8 rows), the packed AVX-512 BF16 head kernel writing bf16
logits (`lm_head_bf16`, csrc/lm_head.cpp), and the same kernel fused with the greedy argmax
(`lm_head_argmax_bf16`: no logits written), against the unfused path's argmax (`argmax_rows` over the logits).

    python benchmarks/lm_head_kernels.py --threads 2 --vocab 32000 --hidden 512 --rows 1 8 33 57 64

Median of --reps calls after warm-up, per row count; GFLOP/s = 2 M K V / time. The weights are random bf16 (the
time does not depend on their values); every row checks that the fused token equals the argmax of the kernel's
own logits. A second table does the same for the int8 W8A8 head (`--quantization int8`): the Int8LinearMethod
path against the packed VNNI head (`lm_head_int8`, `lm_head_argmax_int8`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 33, 57, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenmill.hardware import capabilities
    from tokenmill.model.cpu_kernels import get_kernels
    from tokenmill.model.linear import PackedWeight

    print(f"# CPU: {capabilities().summary()}")
    print(f"# lm_head [M, {args.hidden}] x [{args.hidden}, {args.vocab}] bf16, torch threads {torch.get_num_threads()}, "
          f"median of {args.reps}\n")
    k = get_kernels()
    if k is None or not k.has_lm_head_bf16():
        raise SystemExit("the lm_head kernels need the C++ extension built with AVX-512 BF16 (this CPU lacks it)")
    torch.manual_seed(0)
    v, h = args.vocab, args.hidden
    w = (torch.randn(v, h) * 0.05).bfloat16()
    pw = PackedWeight(w)
    packed = k.lm_head_pack_bf16(w)
    print("| rows | oneDNN packed ms | linear_small ms | lm_head_bf16 ms | + argmax_rows ms | fused argmax ms | "
          "fused GFLOP/s | oneDNN + argmax / fused | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, h).bfloat16()
        out = torch.empty(m, v, dtype=torch.bfloat16)
        tok = torch.empty(m, dtype=torch.long)
        t_dnn = _median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, pw.packed, None, "none", [], ""), args.reps)
        t_small = (_median_ms(lambda: k.linear_small(out, x, w, None), args.reps) if m <= 8 else float("nan"))
        t_head = _median_ms(lambda: k.lm_head_bf16(out, x, packed, v), args.reps)
        t_arg = _median_ms(lambda: k.argmax_rows(tok, out), args.reps)
        t_fused = _median_ms(lambda: k.lm_head_argmax_bf16(tok, x, packed, v), args.reps)
        k.lm_head_bf16(out, x, packed, v)
        ref = out.argmax(dim=-1)
        k.lm_head_argmax_bf16(tok, x, packed, v)
        same = bool((tok == ref).all())
        gf = 2 * m * h * v / (t_fused * 1e-3) / 1e9
        small = f"{t_small:.2f}" if m <= 8 else "-"
        print(f"| {m} | {t_dnn:.2f} | {small} | {t_head:.2f} | {t_arg:.2f} | {t_fused:.2f} | {gf:.0f} | "
              f"{(t_dnn + t_arg) / t_fused:.2f}x | {same} |")

    if not k.has_lm_head_int8():
        print("\n(no int8 head kernel: this build lacks AVX-512 VNNI)")
        return
    from tokenmill.model.linear import Int8LinearMethod, Linear
    from tokenmill.model.lm_head import Int8PackedHead

    lin = Linear(h, v, dtype=torch.bfloat16, method=Int8LinearMethod())
    lin.weight.data.copy_(w)
    lin.method.process_weights_after_loading(lin)
    head8 = Int8PackedHead.build(lin)
    print(f"\nint8 W8A8 head (bf16 activations): the Int8LinearMethod path (linear_small_vnni for <= 8 rows, "
          f"quantize_rows + torch._int_mm + dequant_rows above) + argmax_rows, against the packed VNNI head\n")
    print("| rows | Int8Linear ms | + argmax_rows ms | packed int8 logits ms | fused argmax ms | fused TOPS | "
          "Int8Linear + argmax / fused | same logits, same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, h).bfloat16()
        out = lin(x)
        tok = torch.empty(m, dtype=torch.long)
        t_lin = _median_ms(lambda: lin(x), args.reps)
        t_arg = _median_ms(lambda: k.argmax_rows(tok, out), args.reps)
        t_head = _median_ms(lambda: head8.logits(x), args.reps)
        t_fused = _median_ms(lambda: head8.greedy(x), args.reps)
        same = bool(torch.equal(head8.logits(x), out)) and bool((head8.greedy(x) == out.argmax(dim=-1)).all())
        tops = 2 * m * h * v / (t_fused * 1e-3) / 1e12
        print(f"| {m} | {t_lin:.2f} | {t_arg:.2f} | {t_head:.2f} | {t_fused:.2f} | {tops:.2f} | "
              f"{(t_lin + t_arg) / t_fused:.2f}x | {same} |")


if __name__ == "__main__":
    main()
