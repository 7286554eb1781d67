"""The C++ ext_proc load generator (benchmarks/epp_loadgen.cpp, `epp_latency.py --client cpp`) against the real
Endpoint Picker on each transport (grpc.aio's C-core server, and tokenmill's own HTTP/2 framings): every
request answered and classified (a pick naming a pool endpoint, or an ImmediateResponse's status), the
whole response path played (the picker's load view back to zero), and its time stamps consistent."""

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
pytest.importorskip("h2")
if shutil.which("g++") is None:
    pytest.skip("the load generator needs g++", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from epp_latency import drive_cpp  # noqa: E402

from tokenmill.router.admission import AdmissionConfig  # noqa: E402
from tokenmill.router.config import RouterConfig  # noqa: E402
from tokenmill.router.epp import EppServer  # noqa: E402
from tokenmill.router.router import Router  # noqa: E402
from tokenmill.router.worker_state import WorkerSpec  # noqa: E402

ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def drive(transport: str, healthy: bool, n: int = 60, rate: float = 300.0, pattern_full: bool = False):
    router = Router(RouterConfig(workers=tuple(WorkerSpec("http://" + e) for e in ENDPOINTS),
                                 admission=AdmissionConfig(mode="off")))
    for w in router.pool:
        w.healthy = healthy

    async def main():
        server = EppServer(router, "127.0.0.1", 0, transport)
        await server.start(ready=True)
        try:
            r = await asyncio.to_thread(drive_cpp, server.port, rate, n / rate, 0.005, 0.02, 1, pattern_full, 1, 3)
            await asyncio.sleep(0.1)  # the picker handles the last streams' ends
            return r
        finally:
            await server.stop(0)

    return router, asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["frames", "h2", "grpcio"])
def test_every_request_is_picked_and_its_response_path_played_to_the_end(transport):
    for full in (False, True):  # resp-headers, then full (response body chunks echoed back)
        router, r = drive(transport, healthy=True, pattern_full=full)
        assert r["outcomes"] == {200: 60}, r["outcomes"]
        assert set(r["picks"]) <= set(ENDPOINTS) and sum(r["picks"].values()) == 60
        assert router.in_flight == 0 and all(w.outstanding == 0 for w in router.pool)
        for total, wire, lag in zip(r["lat"], r["wire"], r["send_lags"]):
            assert lag >= 0 and wire > 0 and abs(total - (lag + wire)) < 1e-6
        assert r["client_cpu_s"] > 0 and r["wall_s"] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["frames", "grpcio"])
def test_an_immediate_response_is_read_as_its_http_status(transport):
    router, r = drive(transport, healthy=False, n=30)  # nothing ready: 503 for every request
    assert r["outcomes"] == {503: 30} and r["picks"] == {} and len(r["lat"]) == 30
