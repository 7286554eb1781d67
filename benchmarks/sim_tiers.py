"""Scenario: cache hit rate vs throughput, with and without KV tiers (device pool -> host DRAM -> local disk).

    flock /tmp/cpu.lock python benchmarks/sim_tiers.py --rates 4,8,12 --duration 300

Llama-3.1-8B on one catalog H100 (roofline, bf16) with a deliberately small KV pool (--kv-cache-bytes,
default 4 GiB = 32k tokens) under multi-turn chat: every turn resends the conversation so far, users think
between turns, so the live conversations' contexts exceed the pool and an idle conversation's prefix is
evicted before its next turn. Three configurations per load: device pool only; + a host DRAM tier
(--kv-host-bytes); + host + a local disk tier (--kv-disk-bytes; the host tier then smaller than the working
set). The tiers are the engine's KVTiers (engine/tiers/manager.py) run by the simulator (sim/tiers.py):
lookups, parking, load vs recompute, promotion, write-through; tier I/O at the sim's default bandwidths
(sim/hardware.py docstring) unless given; a fourth, what-if row reads the host tier at 25 GB/s with
its CRC at 25 GB/s (FAST below). Hit rate = cached prompt tokens / prompt tokens (bench summary).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenmill.bench.runner import LoadConfig
from tokenmill.engine.config import parse_bytes
from tokenmill.hardware import capabilities
from tokenmill.sim.simulation import SimConfig, run_simulation

# a what-if, not the engine as built: host tier read and CRC both at 25 GB/s (e.g. several reader threads, or a
# hardware CRC); the engine's one reader thread verifying CRC-32 at ~4 GB/s is the default
FAST = {"host_read_bw": 25e9, "host_write_bw": 25e9, "checksum_bw": 25e9}
WORKLOAD = "chat:turns_min=4,turns_max=8,prompt=400,output=200,system=1000,think_s=10"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--rates", default="4,8,12")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--kv-cache-bytes", default="4GiB")
    ap.add_argument("--host", default="64GiB", help="host tier of the +host configuration")
    ap.add_argument("--host-small", default="8GiB", help="host tier of the +host+disk configuration")
    ap.add_argument("--disk", default="256GiB")
    ap.add_argument("--slo", default="ttft=2000,tpot=100")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    configs = [("device only", {}),
               (f"+host {args.host}", {"kv_host_bytes": parse_bytes(args.host)}),
               (f"+host {args.host_small} +disk {args.disk}", {"kv_host_bytes": parse_bytes(args.host_small),
                                                               "kv_disk_bytes": parse_bytes(args.disk)}),
               (f"+host {args.host}, fast reads*", {"kv_host_bytes": parse_bytes(args.host), "tier_io": FAST})]
    print(f"ISA: {capabilities().summary()}")
    base = (f"tokenmill sim --model {args.model} --hardware {args.hardware} --kv-cache-bytes {args.kv_cache_bytes} "
            f"--workload {args.workload} --duration {args.duration:g} --slo {args.slo} --seed {args.seed} --rate R")
    print(f"\n`{base}` [--kv-host-bytes H] [--kv-disk-bytes D]\n")
    print("| rate req/s | tiers | hit rate | TTFT p50 ms | TTFT p90 ms | output tok/s | goodput req/s | "
          "SLO att. | loaded blocks host / disk | skipped slower | parked | engine copy s | sim wall s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate in [float(r) for r in args.rates.split(",")]:
        for name, kw in configs:
            cfg = SimConfig(model=args.model, hardware=args.hardware, out=Path("/tmp/sim_tiers"),
                            workloads=(args.workload,), load=LoadConfig("rate", rate=rate, duration_s=args.duration),
                            slos=(args.slo,), seed=args.seed, plots=False, record_chunks=False,
                            kv_cache_bytes=parse_bytes(args.kv_cache_bytes), **kw)
            t0 = time.perf_counter()
            result, sj = run_simulation(cfg)
            wall = time.perf_counter() - t0
            s, lv = result.runs[0].summary, sj["levels"][0]
            kt = lv.get("kv_tiers")
            if kt:
                t = kt["tiers"]
                loaded = " / ".join(str(t[n]["loaded_blocks"]) if n in t else "-" for n in ("host", "disk"))
                skipped = sum(x["skipped_slower"] for x in t.values())
                parked, copy_s = kt["engine"]["parked"], f"{kt['engine']['engine_copy_s']:.2f}"
            else:
                loaded, skipped, parked, copy_s = "-", "-", "-", "-"
            print(f"| {rate:g} | {name} | {s.prefix_cache_hit_rate:.3f} | {s.ttft_ms.p50:.0f} | {s.ttft_ms.p90:.0f} | "
                  f"{s.output_throughput:.0f} | {s.goodput:.2f} | {100 * (s.slo_attainment or 0):.1f}% | {loaded} | "
                  f"{skipped} | {parked} | {copy_s} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
