"""`tokenmill generate --model M --prompt TEXT`: offline generation from the command line."""

from __future__ import annotations

import sys

from tokenmill.engine.config import KV_CACHE_DTYPES


def add_engine_args(p, default_model: str = "demo") -> None:
    """Engine options shared by `generate` and `serve`."""
    p.add_argument("--model", default=default_model,
                   help="shipped model name (demo) or an HF-format directory (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CPUs with native bf16 dot products (avx512_bf16/AMX), else fp32")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "fp8"],
                   help="int8: W8A8 (weights per output channel at load, activations per token, int8 GEMM); "
                        "fp8: the same with e4m3 values through torch._scaled_mm (native on CUDA sm89+, emulated "
                        "and far slower on CPUs)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage type (auto: the model's dtype; bfloat16 halves KV bytes; int8 and fp8 "
                        "(= fp8_e4m3) quarter fp32's: one scale per block and KV head)")
    p.add_argument("--kv-cache-bytes", default="1GiB", help="KV cache size, e.g. 512MiB, 4GiB (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off (on by default)")
    p.add_argument("--max-waiting-requests", type=int, default=4096, help="bounded waiting queue")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--kv-host-bytes", default="0",
                   help="host DRAM KV tier (files on /dev/shm shared by the workers of this host), e.g. 8GiB; 0: off")
    p.add_argument("--kv-host-dir", default=None, help="host tier directory (default /dev/shm/tokenmill-kv)")
    p.add_argument("--kv-disk-dir", default=None, help="disk KV tier directory (needs --kv-disk-bytes)")
    p.add_argument("--kv-disk-bytes", default="0", help="disk KV tier capacity, e.g. 100GiB")
    p.add_argument("--speculative-model", default=None,
                   help="speculative decoding proposer: demo-draft | a draft model directory (same tokenizer) | "
                        "ngram (prompt lookup); needs --num-speculative-tokens (default: off)")
    p.add_argument("--num-speculative-tokens", default=None,
                   help="K (drafts per step, 1..16) or auto (k per sequence per step from measured acceptance and "
                        "step cost, 0 = off)")
    p.add_argument("--speculative-max-k", type=int, default=None,
                   help="auto: the largest k (default: 8 for ngram, 6 for a draft model)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix matched")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix matched")
    p.add_argument("--kv-disk-fsync", action="store_true",
                   help="fsync every disk tier entry before renaming it into place (default: no fsync; "
                        "checksums turn entries lost to a power failure into misses)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: decode steps replayed as captured CUDA graphs, one per batch-size bucket (1, 2, 4, .. "
                        "up to min(max-num-seqs, 256, 262144 / max-model-len)): the CPU's per-op launch cost paid "
                        "once per step; not with --kv-cache-dtype int8/fp8 (default: off; not yet run on a GPU)")
    p.add_argument("--batch-invariant", choices=("auto", "on", "strict", "off"), default="auto",
                   help="every row of a linear gets the same bits whatever the step's row count, so greedy output "
                        "does not depend on batching and greedy speculation equals the output without it; auto: on "
                        "for bf16 where the engine's own any-row kernels exist (AMX, AVX-512 BF16), off for fp32; "
                        "strict: also every prompt row attended as a decode row (prefill ~0.7x); on CUDA, on/strict "
                        "compute every step by fixed tiles (slower; not with --cuda-graphs) (default: auto)")
    p.add_argument("--kv-load-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="a KV tier load still running after this long is abandoned and the request recomputes "
                        "(a hung or very slow disk); default 1.0")


def engine_config_from_args(args):
    from tokenmill.engine.config import EngineConfig, parse_bytes
    from tokenmill.cli import CLIError

    def size(flag: str, v):
        try:
            return parse_bytes(v)
        except ValueError:
            raise CLIError(f"{flag}: cannot parse {v!r} (e.g. 512MiB, 4GiB)") from None

    kv = size("--kv-cache-bytes", args.kv_cache_bytes)
    host, disk = size("--kv-host-bytes", args.kv_host_bytes), size("--kv-disk-bytes", args.kv_disk_bytes)
    tiers = dict(kv_host_bytes=host, kv_host_dir=args.kv_host_dir, kv_disk_dir=args.kv_disk_dir,
                 kv_disk_bytes=disk, kv_disk_fsync=args.kv_disk_fsync,
                 kv_load_timeout_s=args.kv_load_timeout)
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, kv_cache_bytes=kv,
                        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching,
                        max_waiting_requests=args.max_waiting_requests, num_threads=args.num_threads, **tiers,
                        speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
                        speculative_max_k=args.speculative_max_k, prompt_lookup_min=args.prompt_lookup_min,
                        prompt_lookup_max=args.prompt_lookup_max, cuda_graphs=args.cuda_graphs,
                        batch_invariant=args.batch_invariant)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline (no server)")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(config=config)
    print(llm.engine.describe(), file=sys.stderr)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompt]
    for r in llm.generate(prompts, params):
        c = r.outputs[0]
        if len(prompts) > 1:
            print(f"--- prompt: {r.prompt!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
        print((args.prompt[0] if len(prompts) == 1 and not args.chat else "") + c.text)
    return 0
