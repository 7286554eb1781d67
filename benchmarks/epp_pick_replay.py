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
    ap.add_argument("--wire", action="store_true", help="the whole server path but the socket: each request's "
                    "HTTP/2 frames fed to the frames transport (grpc_frames.FramesProtocol.data_received) as the C++ "
                    "client writes them, its answers taken by a transport that only keeps their bytes (a digest "
                    "of every stream's frames is printed: two checkouts that answer alike print the same)")
    ap.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"), help="the event loop the replay "
                    "runs in (its timers: the prefill timer, the deferred trailers; default %(default)s; the picker "
                    "runs on uvloop when it is installed)")
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
        picks, live, timers = [], [], []

        def message(ex, data):
            out = ex.step(pb.ProcessingRequest.FromString(data))
            assert isinstance(out, list), "admission held a request: not this replay's load"
            for r in out:
                wire(r)
            return out

        if not args.wire:
            metrics, wire = EppMetrics(router.metrics.registry), _Wire()
        else:  # the frames transport on a transport that keeps what is written
            from tokenmill.router import grpc_frames as gf
            from tokenmill.router.epp_h2 import H2EppServer

            class Transport:
                def __init__(self):
                    self.chunks, self.unacked = [], 0

                def write(self, b):  # (the protocol hands over its buffer and starts a new one: kept as is)
                    self.chunks.append(b)
                    self.unacked += len(b)

                def is_closing(self):
                    return False

                def get_extra_info(self, name, default=None):
                    return default

                def close(self):
                    pass

            epp = H2EppServer(router, "127.0.0.1", 0)  # (its listening socket is not used)
            epp.sock.close()
            transport, conn = Transport(), gf.FramesProtocol(epp.server)
            conn.connection_made(transport)
            # the C++ client's connection start: preface, SETTINGS (no push, its windows at 2^31-1), WINDOW_UPDATE
            conn.data_received(gf.PREFACE + gf.frame(gf.SETTINGS, 0, 0, bytes.fromhex("000200000000" "00047fffffff"))
                               + gf.frame(gf.WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65535).to_bytes(4, "big"))
                               + gf.frame(gf.SETTINGS, gf.ACK, 0))
            block = b"".join(gf._literal(k, v) for k, v in (
                (b":method", b"POST"), (b":scheme", b"http"),
                (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"), (b":authority", b"127.0.0.1:9002"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers")))

            def data(sid, msg):
                return gf.frame(gf.DATA, 0, sid, b"\0" + len(msg).to_bytes(4, "big") + msg)

            def feed(b):
                conn.data_received(b)
                if transport.unacked > 1 << 20:  # as the C++ client credits the server's DATA back (each MiB)
                    spent = gf.MAX_WINDOW - conn.send_window  # (the DATA payload sent: read off the server's count)
                    conn.data_received(gf.frame(gf.WINDOW_UPDATE, 0, 0, spent.to_bytes(4, "big")))
                    transport.unacked = 0

        t0 = time.process_time()
        for i in range(n_total):
            if i == args.warm:
                start()
                t0 = time.process_time()
            clock[0] += 0.002
            while timers and timers[0][0] <= clock[0]:
                router.end_prefill(heapq.heappop(timers)[2])
            if args.wire:
                sid = 2 * i + 1
                feed(gf.frame(gf.HEADERS, gf.END_HEADERS, sid, block) + data(sid, headers) + data(sid, bodies[i]))
                call = conn.calls.get(sid)
                assert call is not None and call.sink.task is None, f"stream {sid} not answered at once: {call and call.sink.task}"
                ex = call.sink.ex
                out = None
            else:
                ex = _Exchange(router, metrics)
                message(ex, headers)
                out = message(ex, bodies[i])
            if i >= args.warm:
                picks.append(ex.flight.worker if ex.flight else
                             str(out[0].immediate_response.status.code if out else "refused"))
            if ex.prefill_timer is not None:  # on the virtual clock instead of the loop's
                ex.prefill_timer.cancel()
                heapq.heappush(timers, (clock[0] + max(0.0, ex.flight.predicted_ttft_s), i, ex.flight))
            live.append((2 * i + 1, ex))
            if len(live) > 15:
                sid, ex = live[len(live) - 16]
                if args.wire:
                    feed(data(sid, resp_headers))
                else:
                    message(ex, resp_headers)
            if len(live) > 165:
                sid, ex = live.pop(0)
                if args.wire:  # the client half-closes: the exchange ends, the server sends its trailers
                    feed(gf.frame(gf.DATA, gf.END_STREAM, sid))
                else:
                    ex.close()
        dt = time.process_time() - t0
        stop()
        if args.wire:
            conn._flush()  # (what still waits for a write)
        written = writes = "-"
        if args.wire:  # every stream's frames in the order written (the interleaving of streams aside)
            out, streams, at = b"".join(transport.chunks), {}, 0
            while at < len(out):
                n = int.from_bytes(out[at:at + 3], "big")
                sid = int.from_bytes(out[at + 5:at + 9], "big") & 0x7FFFFFFF
                streams.setdefault(sid, []).append(out[at + 3:at + 5] + out[at + 9:at + 9 + n])
                at += 9 + n
            h = hashlib.sha256()
            for sid in sorted(streams):
                h.update(b"%d:" % sid + b"|".join(streams[sid]))
            written, writes = h.hexdigest()[:12], f"{len(transport.chunks) / n_total:.2f}"
        return dt, picks, written, writes

    if args.loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    dt, picks, written, writes = asyncio.run(run())
    if args.picks:
        with open(args.picks, "w") as f:
            f.write("\n".join(picks) + "\n")
    print(f"# CPU: {capabilities().summary()}")
    print("| requests | admission | path | loop | CPU ms/request | picks digest | frames written digest | writes/request |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.requests} | {args.admission} | {'wire (frames transport)' if args.wire else 'messages'} | {args.loop} | "
          f"{dt / args.requests * 1e3:.3f} | {hashlib.sha256(chr(10).join(picks).encode()).hexdigest()[:12]} | "
          f"{written} | {writes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
