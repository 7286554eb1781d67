"""BackgroundLoop: the router's periodic tasks (health checks, DNS discovery) share their life cycle."""

from __future__ import annotations

import asyncio


class BackgroundLoop:
    """An asyncio task (`_run`, a loop) started with the app and cancelled at its shutdown."""

    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        raise NotImplementedError
