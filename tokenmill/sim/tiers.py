"""The KV tiers below the pool (host DRAM, local disk) in the simulator: the engine's own KVTiers
(engine/tiers/manager.py) -- what to look up and prefetch, parking, load-vs-recompute (`_worth_loading`),
promotion disk -> host, load deadlines, write-through and its bounded queue -- run on the virtual clock.

What the sim supplies through KVTiers' seams (the decisions stay the engine's code):
  - `SimStore`: FileStore's interface without files: an LRU of entries (capacity in bytes, evicted down to the
    same low watermark), each entry the size the engine's would have (header + token ids + the block's KV
    bytes); a read or write costs `latency + bytes / bandwidth + bytes / checksum_bw` (the engine verifies a
    CRC-32 on every read and computes it on every write) on the thread that does it. One host store may be
    shared by all workers (`host_shared`: the engine's host tier on /dev/shm is shared by the workers of a host).
  - `SimExecutor` for KVTiers' reader and writer threads: a FIFO served one job at a time, on virtual time.
    A job runs when it starts (its store effects -- LRU, contents, the engine's pending-write count -- are
    applied then, before any later lookup: every tier call first runs `SimIO.advance(now)`); its future is
    done at its end. Reads and writes overlap the steps, as the engine's threads do.
  - `SimRunner`: the model runner's block copies (`read_blocks`: pool -> host for write-through,
    `write_blocks`: host -> pool for an install). The engine does those on its own thread, between the steps
    (LLMEngine._step: `_tier_loads` before schedule, `store_computed` after execute), so they lengthen the
    step: `blocks x block bytes / link_bw` (PCIe on a GPU, memcpy on a CPU). The payload the sim moves is one
    byte per block; sizes and times are the real block's.
  - the clock: loads' deadlines and the read timings (`io_clock`) are virtual; observe_step gets the cost
    model's step time, as the engine gives it its measured execute time.
The glue is the engine's too: `llm_engine.tier_loads` (complete -> unpark, prefetch -> park) before every
schedule, `preempted` after it, `observe_step` + `store_computed` after the step, `forget` when a request ends.

Not modelled: bandwidth shared between workers' readers on one shared host store, the page cache, the extra
host-side copies of an install (b"".join, bytearray) beyond the one link copy, and CPU time of the tier threads
competing with the engine thread (on a CPU engine they share cores).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
from dataclasses import dataclass, field

from tokenmill.engine.tiers.store import HEADER, StoreStats

# KVTiers, llm_engine.tier_loads and torch are imported when tiers are on (a sim without tiers loads no torch)

STORE_KEYS = ("capacity_bytes", "hits", "misses", "corrupt", "errors", "stores", "evictions", "bytes_read",
              "bytes_written", "load_seconds", "store_seconds")  # counted by the store (once if shared)
TIERS_KEYS = ("loaded_blocks", "skipped_slower", "promoted")  # counted by each worker's KVTiers


@dataclass(frozen=True)
class TierIO:
    """Bandwidths (bytes/s) and per-block latencies of the tiers (defaults: docs in sim/hardware.py)."""

    host_read_bw: float = 10e9  # /dev/shm file read by one thread (a kernel memcpy)
    host_write_bw: float = 10e9
    host_latency_s: float = 5e-6  # open + stat + close of one file on tmpfs
    disk_read_bw: float = 6e9  # one NVMe (PCIe 4/5 drives: 6-14 GB/s sequential read)
    disk_write_bw: float = 3e9
    disk_latency_s: float = 80e-6  # one NVMe read's latency (plus the file open)
    checksum_bw: float = 4e9  # CRC-32 of each entry, on read (verify) and write (store.py: "4 GB/s here")
    link_bw: float = 50e9  # pool <-> host copies on the engine thread: PCIe on a GPU, memcpy on a CPU

    def __post_init__(self):
        for k, v in self.__dict__.items():
            if not v >= 0 or (k.endswith("_bw") and v <= 0):
                raise ValueError(f"tier I/O {k} must be > 0 (latencies >= 0), not {v}")


@dataclass(frozen=True)
class TierConfig:
    kv_host_bytes: int = 0  # host tier capacity (per worker, or the cluster's if host_shared)
    kv_disk_bytes: int = 0  # disk tier capacity per worker
    host_shared: bool = False  # one host tier for all workers (the engine's /dev/shm tier shared on a host)
    load_timeout_s: float = 1.0  # the engine's kv_load_timeout_s
    block_bytes: int = 0  # KV bytes of one block (set from the model by sim/simulation.build)
    io: TierIO = field(default_factory=TierIO)

    def __post_init__(self):
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0 or not self.load_timeout_s > 0:
            raise ValueError("tier capacities must be >= 0 and the load timeout > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_host_bytes or self.kv_disk_bytes)


class SimFuture:
    """concurrent.futures.Future as KVTiers reads it: done() once the virtual clock reaches the job's end."""

    __slots__ = ("loop", "end", "value", "exc")

    def __init__(self, loop):
        self.loop, self.end, self.value, self.exc = loop, None, None, None

    def done(self) -> bool:
        return self.end is not None and self.end <= self.loop.now

    def result(self, timeout=None):
        if not self.done():
            raise concurrent.futures.TimeoutError()
        if self.exc is not None:
            raise self.exc
        return self.value


class SimExecutor:
    """One I/O thread on virtual time: jobs in submission order, one at a time; `t` is the thread's clock
    while a job runs (the SimStore a job calls adds its read / write time to it)."""

    def __init__(self, io: "SimIO", name: str):
        self.io, self.name = io, name
        self.queue: collections.deque = collections.deque()  # (submitted at, fn, args, future)
        self.free_at = 0.0
        self.t = 0.0
        self.inflight: collections.deque = collections.deque()  # futures run, in end order
        self.busy_s = 0.0

    def submit(self, fn, *args) -> SimFuture:
        fut = SimFuture(self.io.loop)
        self.queue.append((self.io.submit_time(), fn, args, fut))
        self.io.active.add(self)
        self.io.advance(self.io.loop.now)
        return fut

    def next_start(self) -> float | None:
        return max(self.free_at, self.queue[0][0]) if self.queue else None

    def run_one(self) -> None:
        t0, fn, args, fut = self.queue.popleft()
        self.t = start = max(self.free_at, t0)
        prev, self.io.current = self.io.current, self
        try:
            fut.value = fn(*args)
        except Exception as e:  # noqa: BLE001 - the future carries it, as a thread pool's does
            fut.exc = e
        finally:
            self.io.current = prev
        fut.end = self.free_at = self.t
        self.busy_s += self.t - start
        self.inflight.append(fut)

    def next_end(self, now: float) -> float | None:
        """The next time a job of this thread ends (after now): a finished one, or the next queued one starting."""
        while self.inflight and self.inflight[0].end <= now:
            self.inflight.popleft()
        if self.inflight:
            return self.inflight[0].end
        return self.next_start()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.queue.clear()


class SimIO:
    """The cluster's I/O threads on one virtual clock. `advance(now)` runs every job that starts by now, in
    start order across threads, so a lookup at `now` sees exactly the writes started before it."""

    def __init__(self, loop):
        self.loop = loop
        self.active: set[SimExecutor] = set()
        self.current: SimExecutor | None = None
        self.offset = 0.0  # jobs submitted now are submitted at loop.now + offset (after the step's execute)

    def submit_time(self) -> float:
        return self.loop.now + self.offset

    def advance(self, now: float) -> None:
        if self.current is not None:  # a job submitting another (a store that queues): it runs when pumped
            return
        while True:
            best, bt = None, None
            for e in list(self.active):
                t = e.next_start()
                if t is None:
                    self.active.discard(e)
                elif best is None or (t, e.name) < (bt, best.name):
                    best, bt = e, t
            if best is None or bt > now:
                return
            best.run_one()

    def spend(self, seconds: float) -> None:
        if self.current is not None:
            self.current.t += seconds

    def clock(self) -> float:
        """KVTiers' io_clock: the I/O thread's own time while it runs a job."""
        return self.current.t if self.current is not None else self.loop.now


class SimStore:
    """FileStore's interface and LRU policy, without files (module docstring)."""

    def __init__(self, name: str, capacity_bytes: int, entry_bytes: int, read_bw: float, write_bw: float,
                 latency_s: float, checksum_bw: float, io: SimIO, low_watermark: float = 0.9):
        if capacity_bytes <= 0:
            raise ValueError(f"{name} tier: capacity must be > 0 bytes")
        self.name, self.path, self.capacity = name, f"sim:{name}", int(capacity_bytes)
        self.entry_bytes, self.io, self.low_watermark = int(entry_bytes), io, low_watermark
        self.read_s = latency_s + entry_bytes / read_bw + entry_bytes / checksum_bw
        self.write_s = latency_s + entry_bytes / write_bw + entry_bytes / checksum_bw
        self.stats = StoreStats()
        self.entries: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # LRU first

    @property
    def usage(self) -> int:
        return len(self.entries) * self.entry_bytes

    def count(self, **deltas) -> None:
        for k, v in deltas.items():
            setattr(self.stats, k, getattr(self.stats, k) + v)

    def contains(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes, token_ids, payload_len: int) -> bytes | None:
        if key not in self.entries:
            self.count(misses=1)
            return None
        self.entries.move_to_end(key)  # a hit is a use
        self.io.spend(self.read_s)
        self.count(hits=1, bytes_read=self.entry_bytes, load_seconds=self.read_s)
        return b"\0" * payload_len

    def put(self, key: bytes, token_ids, payload) -> bool:
        n = self.entry_bytes
        if n > self.capacity or key in self.entries:
            return False
        if self.usage + n > self.capacity:
            target = min(self.capacity * self.low_watermark, self.capacity - n)
            while self.entries and self.usage + n > target:
                self.entries.popitem(last=False)
                self.count(evictions=1)
        self.io.spend(self.write_s)
        self.entries[key] = None
        self.count(stores=1, bytes_written=n, store_seconds=self.write_s)
        return True


class SimRunner:
    """ModelRunner's block copies for KVTiers: one byte of payload per block; the copies' time (the real
    block's bytes over the link) is added to the engine thread's step."""

    block_nbytes = 1

    def __init__(self, block_bytes: int, link_bw: float):
        self.copy_s = block_bytes / link_bw
        self.pending_s = 0.0
        self.blocks_copied = 0

    def read_blocks(self, block_ids):
        import torch

        self.pending_s += len(block_ids) * self.copy_s
        self.blocks_copied += len(block_ids)
        return torch.zeros((len(block_ids), 1), dtype=torch.uint8)

    def write_blocks(self, block_ids, data) -> None:
        self.pending_s += len(block_ids) * self.copy_s
        self.blocks_copied += len(block_ids)

    def take(self) -> float:
        s, self.pending_s = self.pending_s, 0.0
        return s


def fingerprint(model: str, block_size: int) -> bytes:
    return hashlib.blake2b(f"tokenmill-sim|{model}|{block_size}".encode(), digest_size=16).digest()


class TierCluster:
    """The tiers of a simulated cluster: one SimIO, the shared host store if any; `attach(worker)` gives a
    worker its WorkerTiers."""

    def __init__(self, cfg: TierConfig, block_size: int, loop, model: str = "sim"):
        self.cfg, self.block_size, self.loop = cfg, block_size, loop
        self.io = SimIO(loop)
        self.entry_bytes = HEADER.size + 8 * block_size + cfg.block_bytes
        self.fingerprint = fingerprint(model, block_size)
        self.shared_host = self._host() if cfg.kv_host_bytes and cfg.host_shared else None
        self.workers: list[WorkerTiers] = []

    def _host(self) -> SimStore:
        o = self.cfg.io
        return SimStore("host", self.cfg.kv_host_bytes, self.entry_bytes, o.host_read_bw, o.host_write_bw,
                        o.host_latency_s, o.checksum_bw, self.io)

    def attach(self, worker) -> "WorkerTiers":
        c, o = self.cfg, self.cfg.io
        stores = []
        if c.kv_host_bytes:
            stores.append(self.shared_host or self._host())
        if c.kv_disk_bytes:
            stores.append(SimStore("disk", c.kv_disk_bytes, self.entry_bytes, o.disk_read_bw, o.disk_write_bw,
                                   o.disk_latency_s, o.checksum_bw, self.io))
        wt = WorkerTiers(self, worker, stores)
        self.workers.append(wt)
        return wt

    def stats(self) -> dict:
        """Per tier, summed over the workers (a shared store's own counters once); plus the engine counters."""
        tiers: dict[str, dict] = {}
        seen: set[int] = set()
        for wt in self.workers:
            for name, s in wt.tiers.stats().items():
                t = tiers.setdefault(name, {k: 0 for k in (*STORE_KEYS, *TIERS_KEYS)})
                st = next(x for x in wt.tiers.stores if x.name == name)
                if id(st) not in seen:
                    seen.add(id(st))
                    for k in STORE_KEYS:
                        t[k] += s[k]
                for k in TIERS_KEYS:
                    t[k] += s[k]
        for t in tiers.values():
            t["loaded_bytes"] = t["loaded_blocks"] * self.entry_bytes
        eng = {"load_timeouts": 0, "dropped_stores": 0, "parked": 0, "engine_copy_s": 0.0, "blocks_copied": 0,
               "reader_busy_s": 0.0, "writer_busy_s": 0.0}
        for wt in self.workers:
            e = wt.tiers.engine_stats()
            eng["load_timeouts"] += e["load_timeouts"]
            eng["dropped_stores"] += e["dropped_stores"]
            eng["parked"] += wt.parked
            eng["engine_copy_s"] += wt.copy_s
            eng["blocks_copied"] += wt.runner.blocks_copied
            eng["reader_busy_s"] += wt.reader.busy_s
            eng["writer_busy_s"] += wt.writer.busy_s
        keys = ("loaded_blocks", "skipped_slower", "promoted", "load_seconds_per_block")
        per_worker = [{"worker": wt.worker.name, "recompute_s_per_token": wt.tiers.recompute_s_per_token,
                       **{n: {k: s[k] for k in keys} for n, s in wt.tiers.stats().items()}} for wt in self.workers]
        return {"entry_bytes": self.entry_bytes, "host_shared": self.shared_host is not None, "tiers": tiers,
                "engine": eng, "per_worker": per_worker}


class WorkerTiers:
    """One worker's KVTiers and the calls LLMEngine._step makes around the scheduler."""

    def __init__(self, cluster: TierCluster, worker, stores: list[SimStore]):
        from tokenmill.engine.tiers.manager import KVTiers

        self.cluster, self.worker, self.io = cluster, worker, cluster.io
        worker.kv.full_tables = True  # store_computed picks the step's full blocks from the block tables
        loop, c = cluster.loop, cluster.cfg
        self.runner = SimRunner(max(1, c.block_bytes), c.io.link_bw)
        self.reader = SimExecutor(self.io, f"{worker.name}/read")
        self.writer = SimExecutor(self.io, f"{worker.name}/write")
        self.tiers = KVTiers(stores, cluster.fingerprint, self.runner, worker.kv, clock=loop,
                             load_timeout_s=c.load_timeout_s, reader=self.reader, writer=self.writer,
                             io_clock=self.io.clock)
        self.parked = 0
        self.copy_s = 0.0
        self._wake_entry = None

    def before_schedule(self) -> float:
        """LLMEngine._tier_loads at now; returns the engine-thread seconds of the installs (copies into the pool)."""
        now = self.worker.loop.now
        self.io.advance(now)
        before = len(self.worker.scheduler.parked)
        from tokenmill.engine.llm_engine import tier_loads

        tier_loads(self.tiers, self.worker.scheduler, now)
        self.parked += max(0, len(self.worker.scheduler.parked) - before)
        s = self.runner.take()
        self.copy_s += s
        return s

    def after_schedule(self, sched, pre_s: float, exec_s: float) -> float:
        """preempted / observe_step / store_computed as LLMEngine._step; returns the write-through copy seconds.
        Writes are queued at the step's execute end (now + pre_s + exec_s)."""
        t = self.tiers
        if sched.preempted:
            t.preempted(sched.preempted)
        t.observe_step(exec_s, sched)
        self.io.offset = pre_s + exec_s
        try:
            t.store_computed(sched, self.worker.scheduler.requests)
        finally:
            self.io.offset = 0.0
        s = self.runner.take()
        self.copy_s += s
        return s

    def idle(self, wake) -> None:
        """Nothing to schedule: if requests are parked on loads, wake at the next load's end or deadline
        (LLMEngine waits on the read futures then)."""
        if not self.tiers.loading:
            return
        now = self.worker.loop.now
        times = [x for x in (self.reader.next_end(now), self.tiers.next_deadline()) if x is not None]
        if not times:
            return
        t = max(min(times), now)
        if self._wake_entry is not None:
            self.worker.loop.cancel(self._wake_entry)
        self._wake_entry = self.worker.loop.at(t, wake)

    def forget(self, request_id: str) -> None:
        self.tiers.forget(request_id)
