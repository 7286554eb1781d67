"""The Endpoint Picker's per-request Python, replayed without sockets: CPU per request and the picks made.

    PYTHONPATH=. python benchmarks/epp_pick_replay.py --requests 3000
    # noise-free: instructions per request over the measured requests only (callgrind's client requests,
    # from a 3-line C helper built with valgrind/callgrind.h; see docs/benchmarks/kubernetes.md)
    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \
        python benchmarks/epp_pick_replay.py --requests 300 --callgrind-ctl /tmp/libcgctl.so

Each request goes through what the frames server (epp_h2._EppCall.message) runs per message: the serialized
ProcessingRequest parsed by protobuf, stepped through epp._Exchange (body JSON, prompt chunk hashes,
Router.acquire_now: the table decision, admission, dispatch, metrics), its answers serialized (epp_h2._Wire).
The message pattern is epp_latency.py's `resp-headers` at 500/s on a virtual clock (2 ms per request): request
headers (FULL_DUPLEX_STREAMED, response_body_mode NONE) and body (a 1,472-character shared system prompt, one
of 8, plus a unique question), the response headers 30 ms later, the end of the stream 330 ms later (~165
streams open), each prefill ended at its predicted TTFT on the virtual clock (the picker's prefill timer).
8 workers, leading admission, the default policy. The picks are deterministic: `--picks FILE` writes them,
one per line, to compare two checkouts (the same decisions) with `cmp`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import random
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="measured requests")
    ap.add_argument("--warm", type=int, default=300, help="requests before the measured ones")
    ap.add_argument("--admission", default="leading")
    ap.add_argument("--picks", metavar="FILE", help="write the picked endpoint (or the refusal) per request")
    ap.add_argument("--callgrind-ctl", metavar="SO", help="a library with cg_start() / cg_stop() (callgrind "
                    "client requests) called around the measured requests")
    args = ap.parse_args(argv)

    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tokenmill.hardware import capabilities
    from tokenmill.router.admission import AdmissionConfig
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.epp import EppMetrics, _Exchange
    from tokenmill.router.epp_h2 import _Wire
    from tokenmill.router.router import Router
    from tokenmill.router.worker_state import WorkerSpec

    start = stop = lambda: None
    if args.callgrind_ctl:
        import ctypes

        lib = ctypes.CDLL(args.callgrind_ctl)
        start, stop = lib.cg_start, lib.cg_stop
    n_total = args.warm + args.requests
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
            ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=duplex,
                                                 response_body_mode=processing_mode_pb2.ProcessingMode.NONE)
    ).SerializeToString()
    resp_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")]))).SerializeToString()
    rng = random.Random(0)
    systems = [f"System prompt {k}: you are assistant number {k}. " * 32 for k in range(8)]
    bodies = [pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(
        {"prompt": rng.choice(systems) + f"question {i}: {rng.random()}", "max_tokens": 32, "stream": True}).encode(),
        end_of_stream=True)).SerializeToString() for i in range(n_total)]

    async def run() -> tuple[float, list[str]]:
        clock = [100.0]
        cfg = RouterConfig(workers=tuple(WorkerSpec(f"http://127.0.0.1:{9000 + k}", "tokenmill") for k in range(8)),
                           admission=AdmissionConfig(mode=args.admission))
        router = Router(cfg, clock=lambda: clock[0])
        for w in router.pool:
            w.healthy = True
        metrics, wire = EppMetrics(router.metrics.registry), _Wire()
        picks, live, timers = [], [], []

        def message(ex, data):
            out = ex.step(pb.ProcessingRequest.FromString(data))
            assert isinstance(out, list), "admission held a request: not this replay's load"
            for r in out:
                wire(r)
            return out

        t0 = time.process_time()
        for i in range(n_total):
            if i == args.warm:
                start()
                t0 = time.process_time()
            clock[0] += 0.002
            while timers and timers[0][0] <= clock[0]:
                router.end_prefill(heapq.heappop(timers)[2])
            ex = _Exchange(router, metrics)
            message(ex, headers)
            out = message(ex, bodies[i])
            if i >= args.warm:
                picks.append(ex.flight.worker if ex.flight else str(out[0].immediate_response.status.code))
            if ex.prefill_timer is not None:  # on the virtual clock instead of the loop's
                ex.prefill_timer.cancel()
                heapq.heappush(timers, (clock[0] + max(0.0, ex.flight.predicted_ttft_s), i, ex.flight))
            live.append(ex)
            if len(live) > 15:
                message(live[len(live) - 16], resp_headers)
            if len(live) > 165:
                live.pop(0).close()
        dt = time.process_time() - t0
        stop()
        return dt, picks

    dt, picks = asyncio.run(run())
    if args.picks:
        with open(args.picks, "w") as f:
            f.write("\n".join(picks) + "\n")
    print(f"# CPU: {capabilities().summary()}")
    print("| requests | admission | CPU ms/request | picks digest |")
    print("|---|---|---|---|")
    print(f"| {args.requests} | {args.admission} | {dt / args.requests * 1e3:.3f} | "
          f"{hashlib.sha256(chr(10).join(picks).encode()).hexdigest()[:12]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
