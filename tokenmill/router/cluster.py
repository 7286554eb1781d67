"""The router's cluster-facing services, attached to its aiohttp app: live worker discovery (discovery.py)
and the Endpoint Picker gRPC server (epp.py). Both start after the app's own startup (the HTTP session and
the health checker exist then) and stop before its cleanup.

    app = create_app(router); attach(app)          # what `tokenmill route` does
    attach(app, resolver=stub)                     # tests: a scripted DNS
"""

from __future__ import annotations

import logging

from aiohttp import web

from tokenmill.router.app import HEALTH, ROUTER
from tokenmill.router.discovery import Resolver, WorkerDiscovery, dns_resolver
from tokenmill.router.router import Router

log = logging.getLogger("tokenmill.router")
DISCOVERY = web.AppKey("discovery", WorkerDiscovery)
EPP = web.AppKey("epp", object)


def attach(app: web.Application, resolver: Resolver = dns_resolver) -> None:
    router: Router = app[ROUTER]

    async def start(app: web.Application) -> None:
        cfg = router.cfg
        if cfg.worker_dns:
            d = app[DISCOVERY] = WorkerDiscovery(router, cfg.worker_dns, resolver, probe=app[HEALTH].check)
            await d.resolve_once()  # workers known (and probed) before the first request
            d.start()
        if cfg.epp_port is not None:
            from tokenmill.router.epp import EppServer

            server = app[EPP] = EppServer(router, cfg.host, cfg.epp_port, cfg.epp_transport, cfg.epp_trace)
            await server.start(ready=True)  # discovery (if any) has completed a round: the datastore is synced

    async def stop(app: web.Application) -> None:
        if EPP in app:
            await app[EPP].set_ready(False)
            await app[EPP].stop()
        if DISCOVERY in app:
            await app[DISCOVERY].stop()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
