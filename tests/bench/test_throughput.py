"""The bench must not be the bottleneck: it drives >= 200 req/s of a zero-latency server.

The server runs in its own process; the assertion is on the bench's own CPU time per request (a shared
2-core machine makes wall-clock rates noisy), i.e. the rate one core of this machine can drive."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

import tokenmill.bench.benchmark  # noqa: F401  (imports are not part of the measurement)

from .helpers import run_bench

N = 600


@pytest.mark.slow
def test_drives_200_requests_per_second(tmp_path):
    server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fake_server.py")],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().split()[1])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        rc, result, rows = run_bench(f"http://127.0.0.1:{port}", tmp_path, "--workload",
                                     "batch:prompt=16,output=4,spread=0", "--rate", "300", "--arrival", "constant",
                                     "--num-requests", str(N))
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        server.terminate()
        server.wait(10)
    s = result["summary"]
    assert rc == 0 and s["completed"] == N and s["failed"] == 0
    capacity = N / cpu_s
    print(f"bench CPU {1000 * cpu_s / N:.2f} ms/request -> {capacity:.0f} req/s per core; "
          f"wall {s['request_throughput']:.0f} req/s achieved, send lag p99 {s['send_lag_ms']['p99']:.1f} ms, "
          f"{wall_s:.1f} s")
    assert capacity >= 200
