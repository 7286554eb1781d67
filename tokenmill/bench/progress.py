"""A one-line live progress bar on stderr."""

from __future__ import annotations

import asyncio
import sys

from tokenmill.bench.record import RequestRecord


class Progress:
    def __init__(self, total: int | None, duration_s: float | None, label: str = "", enabled: bool = True):
        self.total, self.duration_s, self.label, self.enabled = total, duration_s, label, enabled
        self.sent = self.done = self.rejected = self.failed = 0
        self._task: asyncio.Task | None = None

    def on_sent(self) -> None:
        self.sent += 1

    def on_done(self, rec: RequestRecord) -> None:
        self.done += 1
        self.rejected += rec.status == "rejected"
        self.failed += rec.status == "failed"

    def line(self, elapsed_s: float) -> str:
        if self.total:
            frac = self.done / self.total
        elif self.duration_s:
            frac = min(1.0, elapsed_s / self.duration_s)
        else:
            frac = 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        of = f"/{self.total}" if self.total else ""
        return (f"{self.label}[{bar}] {self.done}{of} done, {self.sent - self.done} in flight, "
                f"{self.rejected} rejected, {self.failed} failed, {elapsed_s:.1f} s")

    def start(self, clock) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._render(clock))

    async def _render(self, clock) -> None:
        while True:
            sys.stderr.write("\r" + self.line(clock()))
            sys.stderr.flush()
            await asyncio.sleep(0.25)

    def stop(self, clock) -> None:
        if self._task is not None:
            self._task.cancel()
            sys.stderr.write("\r" + self.line(clock()) + "\n")
            sys.stderr.flush()
