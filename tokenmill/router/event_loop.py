"""Which asyncio event loop `tokenmill route` runs on (`--event-loop`).

    auto      uvloop when it is installed (the `k8s` extra brings it), else asyncio's own loop
    uvloop    uvloop; an error naming the missing package if it is not installed
    asyncio   the standard library's selector loop

The router's proxy, health checks, scrapes and the EPP's gRPC server (grpc.aio) all run on this one loop;
uvloop makes each loop wake-up cheaper (docs/benchmarks/kubernetes.md measures it under the EPP).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine

EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory(kind: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """(the loop's name, a factory for it) for an --event-loop choice."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {kind!r}; choose from {', '.join(EVENT_LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ValueError("--event-loop uvloop needs the uvloop package: pip install uvloop "
                                 "(or 'tokenmill[k8s]')") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine, factory: Callable[[], asyncio.AbstractEventLoop]):
    """asyncio.run(main) on a loop from `factory`."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    loop = factory()  # Python 3.10: no Runner
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
