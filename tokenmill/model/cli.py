"""`tokenmill model make PRESET --out DIR [--seed N]`, `tokenmill model presets`."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="make random-init HF-format models from presets")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    mk = msub.add_parser("make", help="write a random-init model (config.json, safetensors, tokenizer)")
    mk.add_argument("preset", help="tiny, tiny-llama3, tiny-mistral, tiny-qwen2, tiny-qwen3, small, "
                                   "llama-3.1-8b, qwen3-8b")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="weight dtype (default: the preset's)")
    mk.add_argument("--max-shard-bytes", type=int, default=2 << 30,
                    help="split weights into shards with model.safetensors.index.json beyond this size")
    mk.set_defaults(func=run_make)
    ls = msub.add_parser("presets", help="list presets with their parameter counts")
    ls.set_defaults(func=run_presets)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_make(args) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.make import make_model
    from tokenmill.model.presets import PRESETS

    if args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    out = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes)
    cfg = ModelConfig.from_dir(out)
    print(f"wrote {args.preset} ({cfg.architecture}, {cfg.num_params() / 1e6:.2f}M params, "
          f"{cfg.torch_dtype}) to {out}")
    return 0


def run_presets(args) -> int:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.presets import PRESETS

    for name, raw in PRESETS.items():
        cfg = ModelConfig.from_dict(raw)
        print(f"{name:14s} {cfg.architecture:20s} {cfg.num_params() / 1e6:9.2f}M params  {cfg.torch_dtype}")
    return 0
