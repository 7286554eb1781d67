"""The `tokenmill` command line.

    tokenmill generate --model demo --prompt "def fib(n):"
    tokenmill model make tiny --out /tmp/tiny --seed 0
    tokenmill serve [--model demo] [--port 8000]
    tokenmill bench --target http://127.0.0.1:8000 --workload chat --rate 4 --out results/
    tokenmill route --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002
    tokenmill sim --model demo --hardware profile.json --workers 4 --workload chat --rate 8 --out results/sim

Each subcommand lives in its own module, which exposes `add_parser(subparsers)`; the parser's
`func(args) -> int` runs it. Modules are imported lazily so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_parser(subparsers)
SUBCOMMANDS = {
    "generate": "tokenmill.engine.cli",
    "model": "tokenmill.model.cli",
    "serve": "tokenmill.server.cli",
    "bench": "tokenmill.bench.cli",
    "route": "tokenmill.router.cli",
    "sim": "tokenmill.sim.cli",
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no stack trace."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, module in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            try:
                importlib.import_module(module).add_parser(sub)
            except ModuleNotFoundError as e:  # only our own module may be missing
                if not (e.name or "").startswith("tokenmill"):
                    raise
                sub.add_parser(name, help="(not available in this build)")
        else:
            sub.add_parser(name, help=f"see `tokenmill {name} --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except CLIError as e:
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # user-facing errors from loaders etc. carry a clear message
        from tokenmill.errors import TokenmillError

        if isinstance(e, TokenmillError):
            print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
