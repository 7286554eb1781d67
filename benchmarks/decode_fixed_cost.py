"""Small-batch decode: the fused decoder stack (one C++ call per step) against the module path, per precision.

    python benchmarks/decode_fixed_cost.py --model /tmp/m/small-bf16 --threads 2 --configs auto auto+int8

For each tokenmill config (DTYPE[+int8][@KV] as in offline_throughput.py) one engine is loaded and the same
greedy requests (batch sizes from --batch, 128 tokens each after a 32-token prompt) alternate between the fused
path (`model.fused`, see tokenmill/model/fused_decode.py) and the module path (`model.fused = None`), --rounds
times; the best round of each is printed as ms per step, with the weight-bandwidth floor of a step (the weight
bytes a decode step reads, `LlamaModel.decode_read_bytes`, over the read bandwidth measured in the same run, before
and after each config: the faster of the DRAM and weights-size probes, offline_throughput.ReadBandwidth) and
whether both paths produced the same tokens.
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", nargs="+", default=["auto", "auto+int8"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare-gemv", action="store_true",
                    help="also run the fused path with csrc/decode_gemv.cpp off (set_decode_gemv(False): "
                         "linear_small_vnni's own loop), alternating with the others, and print a second table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from offline_throughput import measure_read_bandwidth  # noqa: E402 (benchmarks/ is the script's directory)

    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}")
    print(f"# model {args.model}, torch threads {torch.get_num_threads()}, {args.tokens} tokens per request, "
          f"best of {args.rounds} alternating rounds\n")
    rows, gemv_rows = [], []
    bws = []
    for spec in args.configs:
        spec, _, kv = spec.partition("@")
        dtype, _, quant = spec.partition("+")
        llm = LLM(args.model, kv_cache_bytes="1GiB", max_model_len=2048, enable_prefix_caching=False, dtype=dtype,
                  quantization=quant or "none", kv_cache_dtype=kv or "auto")
        model = llm.engine.runner.model
        fused = model.fused
        name = f"--dtype {dtype}" + (f" --quantization {quant}" if quant else "") + (f" --kv-cache-dtype {kv}" if kv else "")
        name += f" ({str(llm.engine.dtype).replace('torch.', '')})"
        g = torch.Generator().manual_seed(0)
        bw = measure_read_bandwidth(model.decode_read_bytes)
        first = len(rows), len(gemv_rows)
        for b in args.batch:
            prompts = [torch.randint(1, min(4096, model.cfg.vocab_size), (32,), generator=g).tolist() for _ in range(b)]
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            best, toks = {}, {}
            for _ in range(args.rounds):
                paths = [("fused", fused), ("modules", None)]
                if args.compare_gemv and fused is not None:
                    paths.append(("fused, old GEMV", fused))
                for path, stack in paths:
                    if path.startswith("fused") and stack is None:
                        continue
                    model.fused = stack
                    old_gemv = path == "fused, old GEMV"
                    if old_gemv:
                        fused.kernels.set_decode_gemv(False)
                    t = time.perf_counter()
                    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
                    ms = (time.perf_counter() - t) / args.tokens * 1000
                    if old_gemv:
                        fused.kernels.set_decode_gemv(True)
                    best[path] = min(best.get(path, ms), ms)
                    toks.setdefault(path, [r.outputs[0].token_ids for r in res])
            model.fused = fused
            floor = model.decode_read_bytes  # bytes for now: divided by the bandwidth once it is measured again
            rows.append((name, b, best.get("fused"), best["modules"], floor, model.decode_read_bytes,
                         toks.get("fused") == toks["modules"] if "fused" in toks else None))
            if "fused, old GEMV" in best:
                gemv_rows.append((name, b, best["fused, old GEMV"], best["fused"], floor,
                                  toks["fused, old GEMV"] == toks["fused"]))
        # the machine's bandwidth moves: each probe takes its faster measurement, before or after this config
        bw = bw.merge(measure_read_bandwidth(model.decode_read_bytes))
        bws.append(bw)
        rows[first[0]:] = [(n, b, f, m, nb / bw.floor_bps * 1000, nb, same) for n, b, f, m, _, nb, same in rows[first[0]:]]
        gemv_rows[first[1]:] = [(n, b, o, f, nb / bw.floor_bps * 1000, same)
                                for n, b, o, f, nb, same in gemv_rows[first[1]:]]
        print(f"# {name}: {bw.describe()}")
        del llm
    print()
    print(f"| config | batch | fused ms/step | modules ms/step | fused speedup | weights read per step | "
          f"floor ms/step (at the config's faster probe) | fused / floor | modules / floor | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, b, f, m, floor, nbytes, same in rows:
        fs = f"{f:.2f}" if f is not None else "n/a"
        print(f"| {name} | {b} | {fs} | {m:.2f} | {m / f:.2f}x | {nbytes / 1e6:.1f} MB | {floor:.2f} | "
              f"{(f / floor) if f else float('nan'):.2f}x | {m / floor:.2f}x | {same} |"
              if f is not None else
              f"| {name} | {b} | n/a | {m:.2f} | n/a | {nbytes / 1e6:.1f} MB | {floor:.2f} | n/a | {m / floor:.2f}x | n/a |")

    if gemv_rows:
        print(f"\n| config | batch | fused, old GEMV ms/step | fused ms/step | speedup | floor ms/step (at the config's "
              f"faster probe) | old GEMV / floor | fused / floor | same tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, b, o, f, floor, same in gemv_rows:
            print(f"| {name} | {b} | {o:.2f} | {f:.2f} | {o / f:.2f}x | {floor:.2f} | {o / floor:.2f}x | "
                  f"{f / floor:.2f}x | {same} |")


if __name__ == "__main__":
    main()
