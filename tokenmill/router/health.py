"""Health checks and metric scrapes of every worker, every `health_interval_s`.

A worker is healthy after one passing `GET /health`, unhealthy after `unhealthy_after` failing ones (or at
once when a proxied request finds its port closed). Each healthy worker's `/metrics` is scraped for
running/waiting/KV-usage gauges and, for `kind=auto`, to tell tokenmill, vLLM and SGLang apart;
`/v1/models` is read once. A missing or unparsable /metrics is not a health failure.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from tokenmill.router.background import BackgroundLoop
from tokenmill.router.router import Router
from tokenmill.router.worker_metrics import parse_worker_metrics
from tokenmill.router.worker_state import WorkerState

DRAINING_HEADER = "x-tokenmill-draining"  # tokenmill serve sets it on its 503s while draining

log = logging.getLogger("tokenmill.router")


class HealthChecker(BackgroundLoop):
    def __init__(self, router: Router, session: aiohttp.ClientSession):
        self.router = router
        self.session = session

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking
                log.exception("health check round failed")
            await asyncio.sleep(self.router.cfg.health_interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.router.pool))
        self.router.pool.reap()
        self.router.index.expire(self.router.clock())

    async def check(self, w: WorkerState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.router.cfg.health_timeout_s)
        try:
            async with self.session.get(w.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
                draining = resp.status == 503 and bool(resp.headers.get(DRAINING_HEADER))
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            ok = draining = False
        if draining:  # a worker shutting down: no new work from this check on
            w.failures = max(w.failures + 1, self.router.cfg.unhealthy_after)
        if not ok:
            w.failures += 1
            if w.failures >= self.router.cfg.unhealthy_after or not w.healthy:
                if w.healthy:
                    log.warning("worker %s is unhealthy", w.url)
                self.router.mark_down(w.url)
            return
        w.failures = 0
        await self._scrape(w, timeout)
        if not w.models:
            await self._models(w, timeout)
        if not w.healthy:
            log.info("worker %s is healthy (kind=%s)", w.url, w.kind)
        self.router.mark_up(w.url)

    async def _scrape(self, w: WorkerState, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(w.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                gauges = parse_worker_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError):
            return
        w.reported_running, w.reported_waiting, w.kv_usage = gauges.running, gauges.waiting, gauges.kv_usage
        w.report_queued_prefill(gauges.queued_prefill_tokens)
        if w.kind == "auto":
            w.kind = gauges.kind

    async def _models(self, w: WorkerState, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(w.url + "/v1/models", timeout=timeout) as resp:
                doc = await resp.json() if resp.status == 200 else {}
            w.models = [m["id"] for m in doc.get("data", []) if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError, AttributeError, TypeError):
            pass
