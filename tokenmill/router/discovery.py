"""Live worker discovery: a DNS name (a Kubernetes headless Service) whose every A/AAAA record is a worker.

    tokenmill route --worker-dns tokenmill-workers.default.svc.cluster.local:8000 [--dns-interval 5]

Every `dns_interval_s` each target is re-resolved and the answer compared with the workers this module
added before (`plan`, a pure function of the two sets):

    joined     a new address: added to the pool and probed at once (GET /health); routable once it passes
    left       an address no longer in the answer (pod deleted, or unready: a headless Service publishes
               only ready pods): removed -- it drains (no new requests, in-flight ones finish, then it is
               forgotten); if it comes back while draining it is simply routable again (a flap)
    unchanged  nothing happens; the health checker keeps probing every worker

A failed lookup (timeout, SERVFAIL, no resolver) changes nothing: a DNS hiccup must not drain the whole
pool. A name that exists with no records (NXDOMAIN/NODATA: a Service scaled to zero) is an empty answer.
Workers given with --worker are never touched by discovery. The resolver is injectable (tests use a stub);
nothing here reads a clock: the loop sleeps `dns_interval_s` between rounds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from tokenmill.router.background import BackgroundLoop
from tokenmill.router.worker_state import WORKER_KINDS, WorkerSpec

log = logging.getLogger("tokenmill.router")

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> IP addresses; raises LookupError


class ResolveError(LookupError):
    """The lookup failed (not an empty answer): keep the workers as they are."""


@dataclass(frozen=True)
class DnsTarget:
    name: str  # e.g. tokenmill-workers.default.svc.cluster.local
    port: int
    kind: str = "auto"  # worker kind of every address (worker_state.WORKER_KINDS)

    def __post_init__(self):
        if not self.name or "/" in self.name or ":" in self.name:
            raise ValueError(f"worker DNS name {self.name!r} must be a host name (no scheme, no port)")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"worker DNS port must be in 1..65535, got {self.port}")
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"worker kind {self.kind!r} unknown; choose from {', '.join(WORKER_KINDS)}")

    @classmethod
    def parse(cls, text: str) -> "DnsTarget":
        """`NAME:PORT` or `KIND=NAME:PORT` (e.g. `vllm=vllm-workers.ns.svc.cluster.local:8000`)."""
        kind, sep, rest = text.partition("=")
        if not sep:
            kind, rest = "auto", text
        name, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"--worker-dns {text!r}: give NAME:PORT, e.g. tokenmill-workers.default.svc:8000")
        return cls(name, int(port), kind)

    def __str__(self) -> str:
        return f"{self.name}:{self.port}"

    def url(self, address: str) -> str:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"http://{host}:{self.port}"


async def dns_resolver(name: str, port: int) -> list[str]:
    """Every A and AAAA record of `name` (the system resolver, uncached here)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []  # the name has no records: no workers
        raise ResolveError(f"{name}: {e}") from e
    return sorted({info[4][0] for info in infos})


def plan(owned: dict[str, DnsTarget], answers: dict[DnsTarget, list[str] | None]
         ) -> tuple[dict[str, DnsTarget], list[str]]:
    """({URL to add: its target}, URLs to drain): `owned` maps the URLs discovery added to their target;
    an answer of None (failed lookup) keeps that target's workers."""
    want: dict[str, DnsTarget] = {}
    for target, addresses in answers.items():
        if addresses is None:
            want.update({u: t for u, t in owned.items() if t == target})
        else:
            want.update({target.url(a): target for a in addresses})
    return {u: want[u] for u in sorted(set(want) - set(owned))}, sorted(set(owned) - set(want))


class WorkerDiscovery(BackgroundLoop):
    """Keeps the router's pool equal to the static workers plus what the DNS targets resolve to."""

    def __init__(self, router, targets: tuple[DnsTarget, ...], resolver: Resolver = dns_resolver,
                 probe: Callable[[object], Awaitable[None]] | None = None):
        self.router = router
        self.targets = targets
        self.resolver = resolver
        self.probe = probe  # HealthChecker.check: a joining worker is probed at once, not one interval later
        self.owned: dict[str, DnsTarget] = {}  # URL -> the target it came from
        self.rounds = 0  # completed resolution rounds (the EPP is ready after the first)
        r = router.metrics.registry
        self.events = Counter("tokenmill_router_discovery_events", "Workers discovery added (join) or drained "
                              "(leave), and failed lookups (error), per DNS target", ["target", "event"], registry=r)
        r.register(_DiscoveryCollector(self))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.router.cfg.dns_interval_s)
            try:
                await self.resolve_once()
            except Exception:  # a bug here must not stop discovery
                log.exception("worker discovery round failed")

    async def _lookup(self, target: DnsTarget) -> list[str] | None:
        try:
            return await asyncio.wait_for(self.resolver(target.name, target.port), self.router.cfg.health_timeout_s)
        except (LookupError, OSError, asyncio.TimeoutError) as e:
            log.warning("worker discovery: resolving %s failed (%s); keeping its workers", target, e)
            self.events.labels(str(target), "error").inc()
            return None

    async def resolve_once(self) -> tuple[list[str], list[str]]:
        """One round: resolve every target, add the new addresses (probed at once), drain the vanished."""
        answers = dict(zip(self.targets, await asyncio.gather(*(self._lookup(t) for t in self.targets))))
        join, leave = plan(self.owned, answers)
        for url in leave:
            target = self.owned.pop(url)
            self.router.remove_worker(url)
            self.events.labels(str(target), "leave").inc()
            log.info("worker discovery: %s left %s; draining it", url, target)
        added = []
        for url, target in join.items():
            w = self.router.pool.get(url)
            if w is not None and not w.draining:
                continue  # a static --worker (or one added by hand) that DNS also lists: not discovery's
            # new, or draining after it left (a flap): pool.add makes a draining worker routable again
            self.owned[url] = target
            added.append(self.router.add_worker(WorkerSpec(url, target.kind)))
            self.events.labels(str(target), "join").inc()
            log.info("worker discovery: %s joined %s", url, target)
        if self.probe is not None and added:
            await asyncio.gather(*(self.probe(w) for w in added))
        self.rounds += 1
        return list(join), leave


class _DiscoveryCollector:
    def __init__(self, discovery: WorkerDiscovery):
        self.discovery = discovery

    def collect(self):
        d = self.discovery
        g = GaugeMetricFamily("tokenmill_router_discovered_workers", "Workers a DNS target resolves to now",
                              labels=["target"])
        for t in d.targets:
            g.add_metric([str(t)], float(sum(1 for owner in d.owned.values() if owner == t)))
        yield g
        drain = GaugeMetricFamily("tokenmill_router_worker_draining", "1 while a removed worker finishes its "
                                  "in-flight requests (it gets no new ones)", labels=["worker"])
        for w in d.router.pool:
            drain.add_metric([w.url], float(w.draining))
        yield drain
