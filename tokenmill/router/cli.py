"""`tokenmill route`: an OpenAI-compatible gateway over N workers (tokenmill, vLLM, SGLang).

    tokenmill route --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002
    tokenmill route --worker vllm=http://10.0.0.2:8000 --policy least-load --port 9000
    tokenmill route --config router.json --admission lagging
    tokenmill route --worker-dns tokenmill-workers.default.svc.cluster.local:8000 --host 0.0.0.0
    tokenmill route --worker-dns tokenmill-workers.default.svc.cluster.local:8000 --epp-port 9002
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from tokenmill.router.admission import MODES
from tokenmill.router.event_loop import EVENT_LOOPS
from tokenmill.router.policies import POLICIES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("route", help="gateway over N workers: cache/load-aware routing, admission control",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="append", default=[], metavar="[KIND=]URL",
                   help="worker base URL; KIND is auto (default), tokenmill, vllm, sglang or openai. Repeatable")
    p.add_argument("--worker-dns", action="append", default=[], metavar="[KIND=]NAME:PORT",
                   help="live discovery: every A/AAAA record of NAME (e.g. a Kubernetes headless Service) is a "
                        "worker at PORT, re-resolved every --dns-interval seconds; vanished ones drain. Repeatable")
    p.add_argument("--dns-interval", type=float, metavar="SECONDS", help="re-resolve --worker-dns this often (default 5)")
    p.add_argument("--epp-port", type=int, metavar="PORT",
                   help="also serve Envoy ext_proc (a Gateway API Inference Extension endpoint picker) on this port")
    p.add_argument("--epp-transport", choices=("frames", "h2", "grpcio"), help="the EPP's gRPC server: frames "
                   "(tokenmill's own gRPC server with its own HTTP/2 framing, the default: the least CPU per request), "
                   "h2 (the same server on the h2 library) or grpcio (grpc.aio)")
    p.add_argument("--epp-trace", metavar="FILE", help="diagnostics: write every EPP stream's hop time stamps "
                   "(socket read, decision start/end, answer written; CLOCK_MONOTONIC ns) as CSV to FILE at shutdown "
                   "(--epp-transport frames)")
    p.add_argument("--policy", choices=sorted(POLICIES), help="routing policy (default prefix-load)")
    p.add_argument("--admission", choices=MODES, help="admission control (default leading)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--config", metavar="FILE", help="router config, JSON or TOML (see tokenmill/router/config.py)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: 503 to new requests, in-flight ones get this long (default: %(default)s)")
    p.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                   help="asyncio event loop: uvloop if installed (auto, the default), uvloop, or asyncio")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
    return p


def build_config(args: argparse.Namespace):
    from tokenmill.cli import CLIError
    from tokenmill.router.config import RouterConfig, load_config
    from tokenmill.router.discovery import DnsTarget
    from tokenmill.router.worker_state import WorkerSpec

    try:
        cfg = load_config(args.config) if args.config else RouterConfig()
        changes = {k: getattr(args, k) for k in ("policy", "host", "port") if getattr(args, k) is not None}
        if args.worker:
            changes["workers"] = tuple(WorkerSpec.parse(w) for w in args.worker)
        # getattr: callers that build the Namespace by hand (tests, scripts) may predate these flags
        if getattr(args, "worker_dns", None):
            changes["worker_dns"] = tuple(DnsTarget.parse(t) for t in args.worker_dns)
        if getattr(args, "dns_interval", None) is not None:
            changes["dns_interval_s"] = args.dns_interval
        if getattr(args, "epp_port", None) is not None:
            changes["epp_port"] = args.epp_port
        if getattr(args, "epp_transport", None) is not None:
            changes["epp_transport"] = args.epp_transport
        if getattr(args, "epp_trace", None) is not None:
            changes["epp_trace"] = args.epp_trace
        if args.admission:
            changes["admission"] = dataclasses.replace(cfg.admission, mode=args.admission)
        cfg = dataclasses.replace(cfg, **changes)
    except OSError as e:
        raise CLIError(f"cannot read --config: {e}") from None
    except ValueError as e:  # includes JSON/TOML syntax errors
        raise CLIError(str(e)) from None
    if cfg.epp_port is not None:
        try:
            import grpc  # noqa: F401
            from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
            from grpc_health.v1 import health  # noqa: F401
            if cfg.epp_transport in ("h2", "frames"):
                import h2  # noqa: F401  (grpc_h2 is on it; frames uses its hpack)
        except ImportError as e:
            raise CLIError(f"--epp-port needs gRPC and Envoy's protos ({e.name} is missing): "
                           "pip install 'tokenmill[k8s]'") from None
    if not cfg.workers and not cfg.worker_dns:
        raise CLIError("give at least one --worker URL or --worker-dns NAME:PORT (or `workers`/`worker_dns` in --config)")
    return cfg


def run(args: argparse.Namespace) -> int:
    from tokenmill.cli import CLIError
    from tokenmill.router import event_loop
    from tokenmill.router.app import create_app
    from tokenmill.router.app import run as run_app
    from tokenmill.router.cluster import attach
    from tokenmill.router.router import Router

    cfg = build_config(args)
    if not args.drain_timeout >= 0:
        raise CLIError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    try:
        loop_name, new_loop = event_loop.loop_factory(getattr(args, "event_loop", "auto"))
    except ValueError as e:
        raise CLIError(str(e)) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(Router(cfg))
    attach(app)
    workers = ", ".join([w.url for w in cfg.workers] + [f"dns:{t}" for t in cfg.worker_dns])
    epp = f" epp=grpc://{cfg.host}:{cfg.epp_port} ({cfg.epp_transport})" if cfg.epp_port is not None else ""
    print(f"tokenmill route: http://{cfg.host}:{cfg.port}{epp} policy={cfg.policy} admission={cfg.admission.mode} "
          f"loop={loop_name} workers={workers}", flush=True)
    try:
        return event_loop.run(run_app(app, cfg.host, cfg.port, args.drain_timeout), new_loop)
    except OSError as e:  # address in use, permission denied
        raise CLIError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
