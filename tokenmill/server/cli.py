"""`tokenmill serve`: the OpenAI-compatible HTTP server.

    tokenmill serve                                  # the shipped demo model on http://127.0.0.1:8000
    tokenmill serve --model /path/to/hf-dir --port 8001 --kv-cache-bytes 2GiB --max-model-len 4096
    TOKENMILL_API_KEY=secret tokenmill serve         # /v1/* then requires "Authorization: Bearer secret"
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def add_parser(sub) -> None:
    from tokenmill.engine.cli import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible server (completions, chat, SSE, /metrics)",
                       description=__doc__.split("\n")[0])
    add_engine_args(p)  # --model, KV cache size, batching, max_model_len, prefix caching, waiting queue, ...
    p.add_argument("--kv-cache-size", dest="kv_cache_bytes", help=argparse.SUPPRESS)  # aliases
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   help=argparse.SUPPRESS)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients use in `model` (repeatable; default: --model and its directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port, printed at start-up (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENMILL_API_KEY)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="SSE: send every N tokens (the first and the last at once); >1 trades streaming "
                        "granularity for throughput (default: %(default)s)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.engine.cli import engine_config_from_args
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.errors import TokenmillError
    from tokenmill.server.app import create_app, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.stream_interval < 1:
        raise CLIError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.api_key is not None and not args.api_key:
        raise CLIError("--api-key must not be empty")
    try:
        config = engine_config_from_args(args)
    except TokenmillError as e:
        raise CLIError(str(e)) from None
    engine = LLMEngine(config)  # ModelLoadError: printed as one line by tokenmill.cli
    names = args.served_model_name or [engine.model_name]
    alias = os.path.basename(os.path.normpath(args.model))
    if not args.served_model_name and alias not in names:  # a directory: its name works too
        names.append(alias)
    app = create_app(engine, api_key=args.api_key, served_model_names=names,
                     max_pending=config.max_waiting_requests, enable_prefix_caching=config.enable_prefix_caching,
                     stream_interval=args.stream_interval)

    def ready(url: str) -> None:
        print(f"tokenmill serve: model {names[0]!r} (max_model_len {engine.max_model_len}) at {url}/v1", flush=True)
        print(f"tokenmill serve: {engine.describe()}; API key {'required' if args.api_key else 'off'}", flush=True)

    try:
        asyncio.run(serve(app, args.host, args.port, ready))
    except OSError as e:  # address in use, permission denied
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    print("tokenmill serve: stopped", file=sys.stderr, flush=True)
    return 0
