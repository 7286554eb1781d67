"""`tokenmill serve`: the OpenAI-compatible HTTP server.

    tokenmill serve                                  # the shipped demo model on http://127.0.0.1:8000
    tokenmill serve --model /path/to/hf-dir --port 8001 --kv-cache-size 2GiB --max-model-len 4096
    TOKENMILL_API_KEY=secret tokenmill serve         # /v1/* then requires "Authorization: Bearer secret"
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (completions, chat, SSE, /metrics)",
                       description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo", help="a shipped model name (demo) or an HF-format directory")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in `model` (repeatable; default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start-up)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENMILL_API_KEY)")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-cache-size", default="1GiB", help="KV cache bytes (e.g. 512MiB, 4GiB)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    e.add_argument("--max-num-seqs", type=int, default=256, help="running requests at most")
    e.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    e.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="bounded waiting queue: beyond it requests get 429 + Retry-After")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    e.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    e.add_argument("--num-threads", type=int, default=None, help="CPU: torch threads")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def engine_config(args):
    from tokenmill.cli import CLIError
    from tokenmill.engine.config import EngineConfig, parse_bytes
    from tokenmill.errors import TokenmillError

    try:
        kv_bytes = parse_bytes(args.kv_cache_size)
    except ValueError:
        raise CLIError(f"--kv-cache-size: cannot read {args.kv_cache_size!r} (try 512MiB or 4GiB)") from None
    try:
        return EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, kv_cache_bytes=kv_bytes,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching, max_waiting_requests=args.max_waiting_requests,
            seed=args.seed, num_threads=args.num_threads,
        )
    except TokenmillError as e:
        raise CLIError(str(e)) from None


def run(args) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise CLIError("--api-key must not be empty")
    config = engine_config(args)
    engine = LLMEngine(config)  # ModelLoadError: printed as one line by tokenmill.cli
    names = args.served_model_name or [engine.model_name]
    alias = os.path.basename(os.path.normpath(args.model))
    if not args.served_model_name and alias not in names:  # a directory: its name works too
        names.append(alias)
    app = create_app(engine, api_key=args.api_key, served_model_names=names,
                     max_pending=config.max_waiting_requests, enable_prefix_caching=config.enable_prefix_caching)
    stats = engine.stats()

    def ready(url: str) -> None:
        print(f"tokenmill serve: model {names[0]!r} (max_model_len {engine.max_model_len}) at {url}/v1", flush=True)
        print(f"tokenmill serve: KV cache {engine.kv_capacity_tokens} tokens "
              f"({stats.kv_blocks_total} blocks x {stats.block_size}), prefix caching "
              f"{'on' if config.enable_prefix_caching else 'off'}, API key {'required' if args.api_key else 'off'}",
              flush=True)

    try:
        asyncio.run(serve(app, args.host, args.port, ready))
    except OSError as e:  # address in use, permission denied
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    print("tokenmill serve: stopped", file=sys.stderr, flush=True)
    return 0
