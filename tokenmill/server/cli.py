"""`tokenmill serve`: the OpenAI-compatible HTTP server.

    tokenmill serve                                  # the shipped demo model on http://127.0.0.1:8000
    tokenmill serve --model /path/to/hf-dir --port 8001 --kv-cache-bytes 2GiB --max-model-len 4096
    TOKENMILL_API_KEY=secret tokenmill serve         # /v1/* then requires "Authorization: Bearer secret"
    tokenmill serve --slo agent:ttft=2000,tpot=250   # admission control: refuse (429) what would miss its SLO
    tokenmill serve --admission off                  # behind `tokenmill route` (the router admits), or to compare
    tokenmill serve --drain-timeout 60               # SIGTERM: 503 to new requests, in-flight ones get 60 s

The engine core (scheduler, model runner, KV cache) runs in its own process (--engine-process on); this
process does HTTP, tokenization, admission and streaming. SIGTERM drains (503 + Retry-After to new
requests, /health unready, in-flight requests finish, exit 0); if the engine core dies, in-flight requests
end with an error and the server exits 1.

Admission control (tokenmill/server/admission.py): each request belongs to a workload class (header
x-tokenmill-class or body field "workload_class", else --default-class) with TTFT/TPOT SLOs; a request
predicted to miss its class's TTFT SLO is held briefly or refused with 429 + Retry-After.
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
    p.add_argument("--admission", default="leading", choices=["leading", "lagging", "off"],
                   help="admission control: leading (predicted TTFT from queued uncached prefill), lagging "
                        "(observed latency; a baseline), off (default: %(default)s)")
    p.add_argument("--admission-hold-drain", default="slow", choices=["fast", "expected", "slow"],
                   help="leading admission: how fast the work in front of a request is assumed to drain when "
                        "judging whether holding it can still get it admitted before its hold deadline; slow "
                        "refuses at once what does not meet its SLO now (fast 429s under overload), fast holds "
                        "within the predictor's whole error band (default: %(default)s)")
    p.add_argument("--admission-hold", default="sheddable", choices=["sheddable", "all"],
                   help="leading admission: which classes may be held in their queue when they do not meet "
                        "their SLO now; sheddable: only batch, the others are refused at once (the engine's "
                        "deadline-ordered queue is their hold; every 429 comes at arrival), all: hold any "
                        "class up to its hold deadline (default: %(default)s)")
    p.add_argument("--slo", action="append", default=[], metavar="CLASS:ttft=MS,tpot=MS",
                   help="a workload class's SLOs (repeatable; CLASS may be * for all). Defaults: "
                        + ", ".join(f"{c.name} ttft={c.ttft_slo_s * 1000:g} tpot={c.tpot_slo_s * 1000:g}"
                                    for c in _default_classes()))
    p.add_argument("--default-class", default="interactive",
                   help="class of requests that name none (default: %(default)s)")
    p.add_argument("--engine-process", default="on", choices=["on", "off"],
                   help="on: the engine core in its own process (no GIL shared with HTTP); off: in a thread of "
                        "the server (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long in-flight requests may run before they are ended "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _default_classes():
    from tokenmill.router.classes import DEFAULT_CLASSES

    return DEFAULT_CLASSES


def admission_config_from_args(args):
    """--admission, --slo, --default-class -> ServerAdmissionConfig (CLIError on a bad value)."""
    import dataclasses

    from tokenmill.bench.slo import parse_slo
    from tokenmill.cli import CLIError
    from tokenmill.router.admission import AdmissionConfig
    from tokenmill.server.admission import ServerAdmissionConfig

    classes = {c.name: c for c in _default_classes()}
    for spec in args.slo:
        name, bounds = parse_slo(spec)
        if bounds.get("e2e_ms") is not None:
            raise CLIError(f"--slo {spec!r}: admission knows ttft and tpot only (e2e is a benchmark bound)")
        targets = list(classes) if name == "*" else [name]
        for n in targets:
            if n not in classes:
                raise CLIError(f"--slo {spec!r}: unknown workload class {n!r}; choose from {', '.join(classes)}")
            change = {}
            for key, field in (("ttft_ms", "ttft_slo_s"), ("tpot_ms", "tpot_slo_s")):
                if key in bounds:
                    if bounds[key] is None:
                        raise CLIError(f"--slo {spec!r}: admission needs a finite {key[:4]}")
                    change[field] = bounds[key] / 1000.0
            classes[n] = dataclasses.replace(classes[n], **change)
    if args.default_class not in classes:
        raise CLIError(f"--default-class {args.default_class!r}: choose from {', '.join(classes)}")
    return ServerAdmissionConfig(classes=tuple(classes.values()), default_class=args.default_class,
                                 admission=AdmissionConfig(mode=args.admission, hold_drain=args.admission_hold_drain,
                                                           hold=args.admission_hold))


def run(args) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.engine.cli import engine_config_from_args
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
    admission = admission_config_from_args(args)
    if not args.drain_timeout >= 0:
        raise CLIError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.engine_process == "on":
        from tokenmill.server.engine_process import EngineProcess

        engine = EngineProcess(config, log_level=args.log_level.upper())
        engine.start()  # ModelLoadError (the core's message): printed as one line by tokenmill.cli
    else:
        from tokenmill.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)  # ModelLoadError: printed as one line by tokenmill.cli
    names = args.served_model_name or [engine.model_name]
    alias = os.path.basename(os.path.normpath(args.model))
    if not args.served_model_name and alias not in names:  # a directory: its name works too
        names.append(alias)
    app = create_app(engine, api_key=args.api_key, served_model_names=names,
                     max_pending=config.max_waiting_requests, enable_prefix_caching=config.enable_prefix_caching,
                     stream_interval=args.stream_interval, admission=admission)

    def ready(url: str) -> None:
        print(f"tokenmill serve: model {names[0]!r} (max_model_len {engine.max_model_len}) at {url}/v1", flush=True)
        print(f"tokenmill serve: {engine.describe()}; API key {'required' if args.api_key else 'off'}", flush=True)
        slos = "; ".join(f"{c.name} ttft {c.ttft_slo_s * 1000:g} ms tpot {c.tpot_slo_s * 1000:g} ms"
                         for c in admission.classes)
        print(f"tokenmill serve: admission {admission.admission.mode} (default class {admission.default_class}; "
              f"{slos})", flush=True)

    try:
        code = asyncio.run(serve(app, args.host, args.port, ready, drain_timeout=args.drain_timeout))
    except OSError as e:  # address in use, permission denied
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    finally:
        if hasattr(engine, "close"):  # the core process, if the server never started
            engine.close()
    if code:
        print("tokenmill serve: stopped: the engine core process died (see the log above); exit 1",
              file=sys.stderr, flush=True)
        return code
    print("tokenmill serve: stopped", file=sys.stderr, flush=True)
    return 0
