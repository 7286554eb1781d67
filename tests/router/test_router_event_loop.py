"""`tokenmill route --event-loop`: auto takes uvloop when installed and falls back to asyncio without it;
an explicit uvloop without the package, or an unknown name, is an error naming it."""

import argparse
import asyncio
import sys

import pytest

from tokenmill.router import event_loop


def loop_module(factory) -> str:
    async def which():
        return type(asyncio.get_running_loop()).__module__

    return event_loop.run(which(), factory)


def test_asyncio_is_the_standard_loop_and_auto_prefers_uvloop_when_installed():
    name, factory = event_loop.loop_factory("asyncio")
    assert name == "asyncio" and loop_module(factory).startswith("asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert event_loop.loop_factory("auto")[0] == "asyncio"
    else:
        for kind in ("auto", "uvloop"):
            name, factory = event_loop.loop_factory(kind)
            assert name == "uvloop" and loop_module(factory).startswith("uvloop")


def test_without_uvloop_auto_falls_back_and_an_explicit_uvloop_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    name, factory = event_loop.loop_factory("auto")
    assert name == "asyncio" and loop_module(factory).startswith("asyncio")
    with pytest.raises(ValueError, match="pip install uvloop"):
        event_loop.loop_factory("uvloop")
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        event_loop.loop_factory("trio")


def test_the_cli_reports_a_missing_uvloop_as_a_message(monkeypatch):
    from tokenmill.cli import CLIError
    from tokenmill.router.cli import add_parser

    monkeypatch.setitem(sys.modules, "uvloop", None)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--worker", "http://127.0.0.1:9", "--event-loop", "uvloop"])
    with pytest.raises(CLIError, match="needs the uvloop package"):
        args.func(args)
    with pytest.raises(SystemExit):  # argparse: not a choice
        parser.parse_args(["route", "--worker", "http://127.0.0.1:9", "--event-loop", "trio"])
