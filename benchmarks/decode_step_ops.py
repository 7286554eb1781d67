"""Where a decode-only step at batch 9-64 goes, op by op, against each op's bytes / FLOP floor.

    python benchmarks/decode_step_ops.py --model /tmp/m/small-bf16 --threads 2 --batch 16 32 64 \
        --configs auto auto+int8 auto+int8@int8

For each tokenmill config (DTYPE[+int8][@KV] as in offline_throughput.py) the model is loaded through `LLM` (its
real weights, packed as the engine packs them) and the fused decoder stack's kernels (csrc/paged_decode.cpp
`decoder_stack`) are called one op at a time from Python, in the stack's order, on a decode step of B sequences
whose context lengths are drawn from --ctx (the offline workload: prompts of 100-500 tokens plus up to 300
generated). Each layer has its own KV cache, and the sequences' blocks are scattered over it (a random
permutation of the pool, as a pool looks after churn; --block-order sequential puts them in address order), so
the step reads its KV from DRAM as the engine's steps do, not from a warm L3.

Per op and step: median ms (all layers of that op, --reps repetitions), and its floor: the larger of bytes read /
the read bandwidth measured in the same run (`x.sum` over 256 MiB) and FLOPs / the GEMM rate measured in the same
run (oneDNN bf16 or `torch._int_mm` at a large shape). `decoder_stack` whole is timed too (the sum of the ops
includes Python dispatch per op; the whole stack does not). The head row is what the engine runs for an all-greedy
step (`LlamaModel.greedy_tokens`); where that is not the module path, the module path (logits + argmax_rows) is
timed beside it and left out of the sum.

--compare-attention also times `paged_decode_attention` and the whole `decoder_stack` with the session-9 decode
attention off (`kernels.set_decode_attention(False)`: the previous kernel, the reference) in the same process,
alternating (best of 3 medians each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps: int) -> float:
    """median seconds of fn() over reps calls (one warm-up)."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def gemm_rates() -> dict:
    """FLOP/s of oneDNN bf16 (prepacked, as PackedWeight) and torch._int_mm at a large shape, this run."""
    out = {}
    x = torch.randn(1024, 512).bfloat16()
    w = torch.randn(2816, 512).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    t = timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 10)
    out["bf16"] = 2 * 1024 * 512 * 2816 / t
    xq = torch.randint(-127, 128, (1024, 512), dtype=torch.int8)
    wq = torch.randint(-127, 128, (512, 2816), dtype=torch.int8)
    t = timed(lambda: torch._int_mm(xq, wq), 10)
    out["int8"] = 2 * 1024 * 512 * 2816 / t
    return out


class Step:
    """One decode step's inputs for a loaded model: B sequences, scattered blocks, per-layer caches."""

    def __init__(self, model, stack, batch: int, ctx_lo: int, ctx_hi: int, kv: str, order: str, seed: int):
        cfg = model.cfg
        g = torch.Generator().manual_seed(seed)
        self.B = batch
        self.bs = 16
        self.ctx = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=g, dtype=torch.int64)
        nblk = [(int(c) + self.bs - 1) // self.bs for c in self.ctx]
        total = sum(nblk) + 8
        perm = torch.randperm(total, generator=g) if order == "scattered" else torch.arange(total)
        mb = max(nblk)
        self.block_tables = torch.zeros(batch, mb, dtype=torch.int64)
        i = 0
        for s, n in enumerate(nblk):
            self.block_tables[s, :n] = perm[i:i + n]
            i += n
        last = self.ctx - 1
        self.slot_mapping = self.block_tables[torch.arange(batch), last // self.bs] * self.bs + last % self.bs
        self.positions = last.clone()
        nkv, hd, L = stack.nkv, stack.hd, len(model.layers)
        dtype = model.embed_tokens.weight.dtype
        self.caches = []  # per layer: K, V, K scales, V scales (the stack's list)
        self.kv_bytes = 0
        empty = torch.empty(0)
        ctx_sum = int(self.ctx.sum())
        for _ in range(L):
            if kv == "int8":
                k = torch.randint(-127, 128, (total, nkv, self.bs, hd), generator=g, dtype=torch.int8)
                v = torch.randint(-127, 128, (total, nkv, self.bs, hd), generator=g, dtype=torch.int8)
                ks = torch.rand(total, nkv, generator=g) * 0.02 + 0.001
                vs = torch.rand(total, nkv, generator=g) * 0.02 + 0.001
                self.caches += [k, v, ks, vs]
                self.kv_bytes += 2 * ctx_sum * nkv * hd
            else:
                k = torch.randn(total, nkv, self.bs, hd, generator=g).to(dtype)
                v = torch.randn(total, nkv, self.bs, hd, generator=g).to(dtype)
                self.caches += [k, v, empty, empty]
                self.kv_bytes += 2 * ctx_sum * nkv * hd * k.element_size()
        self.x0 = (torch.randn(batch, cfg.hidden_size, generator=g) * 0.5).to(dtype)


def lin_bytes_flops(w: list, base: int, kind: int, rows: int) -> tuple[int, int]:
    wt = w[base] if kind == 0 else w[base]  # plain float weight or int8 [N, K]
    n, k = wt.shape
    nbytes = wt.numel() * wt.element_size() + sum(t.numel() * t.element_size() for t in w[base + 1:base + 4])
    return nbytes, 2 * rows * n * k


def profile(model, stack, step: Step, reps: int, rates: dict, bw: float, compare_attn: bool) -> list:
    k = stack.kernels
    w, kinds = stack.weights, stack.kinds
    L = len(model.layers)
    nh, nkv, hd, inter, eps = stack.nh, stack.nkv, stack.hd, stack.inter, stack.eps
    B = step.B
    H = model.cfg.hidden_size
    dtype = step.x0.dtype
    LS, LIN = 28, 6
    rope = model.rotary if hasattr(model, "rotary") else model.rope
    cos, sin = rope.cos, rope.sin

    def lin(x, base, kind, n_out):
        bias = w[base + 3] if w[base + 3].numel() else None
        if kind == 0:
            return torch.ops.mkldnn._linear_pointwise(x, w[base + 4], bias, "none", [], "")
        q = torch.empty(x.shape[0], x.shape[1], dtype=torch.int8)
        sx = torch.empty(x.shape[0], dtype=torch.float32)
        k.quantize_rows(q, sx, x)
        out = torch.empty(x.shape[0], n_out, dtype=x.dtype)
        k.dequant_rows(out, torch._int_mm(q, w[base + 5]), sx, w[base + 2], bias)
        return out

    qkv_n = (nh + 2 * nkv) * hd
    # activations of the right shapes (the values do not change the kernels' time)
    x = step.x0.clone()
    h = torch.empty(B, H, dtype=dtype)
    k.rms_norm(h, x, None, w[0], eps)
    qkv = lin(h, 4, kinds[0], qkv_n)
    attn = torch.empty(B, nh, hd, dtype=dtype)
    act = torch.empty(B, inter, dtype=dtype)
    gu = lin(h, 4 + 2 * LIN, kinds[2], 2 * inter)
    a_out = torch.zeros(B, H, dtype=dtype)
    ctx, bt, slots, pos = step.ctx, step.block_tables, step.slot_mapping, step.positions
    c = step.caches
    rows = []

    def add(name, fn, nbytes, flops, rate_key):
        t = timed(fn, reps)
        floor = max(nbytes / bw, flops / rates[rate_key] if flops else 0.0)
        rows.append((name, t * 1e3, nbytes, flops, floor * 1e3))

    def per_layer(f):
        return lambda: [f(l) for l in range(L)]

    q = qkv.narrow(1, 0, nh * hd).view(B, nh, hd)
    kk = qkv.narrow(1, nh * hd, nkv * hd).view(B, nkv, hd)
    vv = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view(B, nkv, hd)
    rate = "bf16" if dtype == torch.bfloat16 else "bf16"
    for i, (name, n_out, xin) in enumerate((("qkv_proj", qkv_n, h), ("o_proj", H, attn.view(B, nh * hd)),
                                            ("gate_up_proj", 2 * inter, h), ("down_proj", H, act))):
        nb = fl = 0
        for l in range(L):
            b_, f_ = lin_bytes_flops(w, l * LS + 4 + i * LIN, kinds[l * 4 + i], B)
            nb, fl = nb + b_, fl + f_
        add(name, per_layer(lambda l, i=i, n_out=n_out, xin=xin: lin(xin, l * LS + 4 + i * LIN, kinds[l * 4 + i],
                                                                      n_out)),
            nb, fl, "int8" if kinds[i] != 0 else rate)
    act_bytes = B * H * dtype.itemsize
    add("rms_norm x2", per_layer(lambda l: (k.rms_norm(h, x, None, w[l * LS], eps),
                                            k.rms_norm(h, x, a_out, w[l * LS + 1], eps))), L * 6 * act_bytes, 0, rate)
    add("rope q,k", per_layer(lambda l: (k.rope_inplace(q, pos, cos, sin), k.rope_inplace(kk, pos, cos, sin))),
        L * 2 * B * (nh + nkv) * hd * dtype.itemsize, 0, rate)
    add("silu_mul", per_layer(lambda l: k.silu_mul(act, gu)), L * 3 * B * inter * dtype.itemsize, 0, rate)
    int8kv = c[0].dtype == torch.int8

    def write(l):
        if int8kv:
            k.write_kv_int8(c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3], kk, vv, slots)
        else:
            k.write_kv(c[4 * l], c[4 * l + 1], kk.to(c[4 * l].dtype), vv.to(c[4 * l].dtype), slots)

    add("write_kv", per_layer(write), L * 2 * B * nkv * hd * c[0].element_size() * (16 if int8kv else 1), 0, rate)

    def attend(l):
        if int8kv:
            k.paged_decode_attention(attn, q, c[4 * l], c[4 * l + 1], bt, ctx, stack.scale, 0, c[4 * l + 2],
                                     c[4 * l + 3])
        else:
            k.paged_decode_attention(attn, q, c[4 * l], c[4 * l + 1], bt, ctx, stack.scale, 0)

    attn_flops = L * 4 * nh * hd * int(ctx.sum())
    if compare_attn and hasattr(k, "set_decode_attention"):
        prev = k.set_decode_attention(False)
        try:
            t_old, t_new = [], []
            for _ in range(3):  # alternate, best of 3 medians
                k.set_decode_attention(False)
                t_old.append(timed(per_layer(attend), reps))
                k.set_decode_attention(True)
                t_new.append(timed(per_layer(attend), reps))
        finally:
            k.set_decode_attention(prev)
        rows.append(("attention (previous kernel)", min(t_old) * 1e3, step.kv_bytes, attn_flops,
                     step.kv_bytes / bw * 1e3))
        rows.append(("attention", min(t_new) * 1e3, step.kv_bytes, attn_flops, step.kv_bytes / bw * 1e3))
    else:
        add("attention", per_layer(attend), step.kv_bytes, attn_flops, rate)

    head = model.packed_head
    hidden = torch.randn(B, H).to(dtype)
    V = model.cfg.vocab_size
    hbytes = V * H * (1 if model.int8_head else dtype.itemsize)
    hrate = "int8" if model.int8_head else rate
    out_tok = torch.empty(B, dtype=torch.long)
    if head is None or not head.applies(hidden):  # what the engine ran for greedy steps of this size before
        add("lm_head + argmax (module path: logits, then argmax_rows)",
            lambda: k.argmax_rows(out_tok, model.compute_logits(hidden, float32=False)), hbytes, 2 * B * V * H, hrate)
    if head is not None and head.applies_greedy(hidden):  # what the engine runs now (runner: greedy_tokens)
        name = "lm_head + argmax (packed kernel)" if head.applies(hidden) else "lm_head + argmax (int8 GEMM + fused argmax)"
        add(name, lambda: head.greedy(hidden), hbytes, 2 * B * V * H, hrate)

    def whole():
        xs = step.x0.clone()
        k.decoder_stack(xs, pos, cos, sin, w, kinds, c, slots, bt, ctx, stack.final_norm, eps, stack.scale, 0,
                        nh, nkv, hd, inter)
    if compare_attn and hasattr(k, "set_decode_attention"):
        prev = k.set_decode_attention(False)
        try:
            t_old, t_new = [], []
            for _ in range(3):
                k.set_decode_attention(False)
                t_old.append(timed(whole, reps))
                k.set_decode_attention(True)
                t_new.append(timed(whole, reps))
        finally:
            k.set_decode_attention(prev)
        rows.append(("decoder_stack (whole, one call; previous attention)", min(t_old) * 1e3, 0, 0, 0.0))
        rows.append(("decoder_stack (whole, one call)", min(t_new) * 1e3, 0, 0, 0.0))
    else:
        rows.append(("decoder_stack (whole, one call)", timed(whole, reps) * 1e3, 0, 0, 0.0))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", nargs="+", default=["auto", "auto+int8", "auto+int8@int8"])
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--ctx", default="100:800", help="LO:HI context length per sequence")
    ap.add_argument("--block-order", choices=["scattered", "sequential"], default="scattered")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare-attention", action="store_true")
    ap.add_argument("--only-attention", action="store_true", help="time the attention rows only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lo, hi = (int(v) for v in args.ctx.split(":"))

    from offline_throughput import measure_read_bandwidth  # noqa: E402 (benchmarks/ is the script's directory)

    from tokenmill import LLM
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}")
    bw = measure_read_bandwidth().dram_bps  # KV scattered over per-layer caches comes from DRAM: the DRAM probe
    rates = gemm_rates()
    print(f"# model {args.model}, torch threads {torch.get_num_threads()}, ctx {args.ctx} ({args.block_order} "
          f"blocks), median of {args.reps}; read bandwidth {bw / 1e9:.1f} GB/s, oneDNN bf16 "
          f"{rates['bf16'] / 1e9:.0f} GFLOP/s, _int_mm {rates['int8'] / 1e12:.2f} TOPS\n")
    for spec in args.configs:
        spec0, _, kv = spec.partition("@")
        dtype, _, quant = spec0.partition("+")
        llm = LLM(args.model, kv_cache_bytes="64MiB", max_model_len=2048, enable_prefix_caching=False, dtype=dtype,
                  quantization=quant or "none", kv_cache_dtype=kv or "auto")
        model = llm.engine.runner.model
        stack = model.fused
        if stack is None:
            print(f"{spec}: no fused stack here; skipped")
            continue
        name = f"--dtype {dtype}" + (f" --quantization {quant}" if quant else "") + (f" --kv-cache-dtype {kv}" if kv else "")
        for b in args.batch:
            step = Step(model, stack, b, lo, hi, kv or "auto", args.block_order, seed=b)
            rows = profile(model, stack, step, args.reps, rates, bw, args.compare_attention)
            print(f"### {name}, batch {b} (ctx mean {step.ctx.float().mean():.0f}, KV read "
                  f"{step.kv_bytes / 1e6:.1f} MB per step)\n")
            print("| op (all layers) | ms | MB read | GFLOP | floor ms | ms / floor |")
            print("|---|---|---|---|---|---|")
            total = 0.0
            for op, ms, nb, fl, floor in rows:
                if args.only_attention and "attention" not in op:
                    continue
                if not op.startswith("decoder_stack") and "previous" not in op and "module path" not in op:
                    total += ms
                ratio = f"{ms / floor:.2f}" if floor else "-"
                print(f"| {op} | {ms:.3f} | {nb / 1e6:.1f} | {fl / 1e9:.3f} | {floor:.3f} | {ratio} |")
            if not args.only_attention:
                print(f"| sum of the ops above | {total:.3f} | | | | |")
            print()
        del llm


if __name__ == "__main__":
    main()
