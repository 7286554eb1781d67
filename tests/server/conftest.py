"""Fixtures: servers over the fake engine (fast) and over a real tiny model (when the engine is present)."""

from __future__ import annotations

import pytest

from .fake_engine import FakeEngine
from .harness import ServerThread


@pytest.fixture
def fake_server():
    with ServerThread(FakeEngine()) as s:
        yield s


@pytest.fixture
def make_server():
    started = []

    def make(engine=None, **kw):
        s = ServerThread(engine or FakeEngine(), **kw).__enter__()
        started.append(s)
        return s

    yield make
    for s in started:
        s.__exit__(None, None, None)
