"""KVTiers: the engine's side of the KV tiers below the pool (host DRAM on /dev/shm, local disk).

Called by LLMEngine.step() around the clock-free scheduler, never from inside it. Tier I/O runs on two
threads of its own (one reads, one writes), so neither a read nor a write ever runs inside the step:
  - `prefetch(waiting, now)` before schedule(): for the first waiting requests, the blocks after their pool
    prefix hit are looked up tier by tier (host, then disk) by key (an existence check, no read); when a run
    of them is there, its read is queued on the reader thread and the request is *parked* (set aside by the
    scheduler, which goes on scheduling everyone else: running decodes never wait for a load). Its pool
    prefix is pinned (a reference) while the load is in flight, so eviction cannot take the prefix it extends.
  - `complete(now)` before prefetch: a finished read is installed: written into free pool blocks
    (ModelRunner.write_blocks, a memcpy) and registered in the pool's prefix cache under the block hashes, so
    the scheduler's own prefix lookup finds them (and counts them in cached_tokens); the request is unparked.
    A load still running at its deadline (`load_timeout_s`: a hung or very slow disk) is abandoned: the
    request is unparked and recomputes (counted as `timeouts`); the read's time, when it ends, still counts.
    A block read from the disk tier is also written to the host tier above it (promotion).
  - `store_computed(sched, requests)` after execute: write-through. Every block that became full in this
    step is copied out of the pool (on the engine thread: the pool may reuse it next step) and queued for the
    writer thread, to each tier that lacks it; past `max_pending_writes` queued blocks, stores are dropped
    (counted), so a slow disk cannot grow memory. Chosen over write-back (write on pool eviction) because
    the host tier is shared between workers: a session that moves to another worker hits only if its blocks
    are in the tier while they are still in the first worker's pool; and write-through puts no write on the
    eviction path (allocation stays I/O-free). Its price is write bandwidth for blocks never read again
    (measured in benchmarks/kv_tiers.py).
  - `observe_step(seconds, sched)`: the prefill rate (EWMA seconds per token), against which each tier's
    measured read time per block (median of the last 8 reads, read + verify: robust to one read delayed by
    preemption, which an EWMA is not) is compared: a tier whose block loads cost more than recomputing a
    block is skipped (counted as `skipped_slower`), re-probed every PROBE_EVERY skipped lookups.
Every failure inside is a miss or a dropped store, never an exception out of here (the engine also guards,
and unparks every request of a load on any error).

Seams (the engine's behaviour is the default; the simulator, tokenmill/sim/tiers.py, supplies the others so
that every decision above is this code, run on a virtual clock):
  - `stores`: anything with FileStore's interface (name, path, capacity, stats, count, contains, get, put).
  - `reader` / `writer`: executors (`submit(fn, *args)` -> a concurrent.futures.Future-like object with
    done() and result(timeout=0); `shutdown(wait, cancel_futures)`); default one ThreadPoolExecutor thread each.
  - `io_clock`: the clock the reader times each block read on (default time.perf_counter).
  - `clock`: the engine-thread clock that times the copies into and out of the pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill.engine.tiers.keys import chain_keys
from tokenmill.engine.tiers.store import FileStore

log = logging.getLogger("tokenmill.engine.tiers")

PROBE_EVERY = 32  # a tier skipped as slower is read anyway once every PROBE_EVERY lookups (re-measured)
LOAD_WINDOW = 8  # load time per block: median of the last LOAD_WINDOW reads (one preempted read does not flip it)
MIN_LOAD_SAMPLES = 3

# /metrics series per tier (label tier="host"|"disk"): (KVTiers.stats key, metric name, help, counter?)
METRICS = [
    ("capacity_bytes", "tokenmill_kv_tier_capacity_bytes", "KV tier capacity in bytes.", False),
    ("hits", "tokenmill_kv_tier_hits", "KV blocks read back intact from the tier.", True),
    ("misses", "tokenmill_kv_tier_misses", "KV tier lookups that found no usable block.", True),
    ("corrupt", "tokenmill_kv_tier_corrupt_blocks",
     "KV tier entries rejected (checksum, size, key or tokens mismatch): misses, recomputed.", True),
    ("errors", "tokenmill_kv_tier_io_errors", "KV tier I/O errors (each a miss or a dropped store).", True),
    ("stores", "tokenmill_kv_tier_stores", "KV blocks written to the tier.", True),
    ("evictions", "tokenmill_kv_tier_evictions", "KV tier entries evicted (LRU) by this worker.", True),
    ("bytes_read", "tokenmill_kv_tier_read_bytes", "Bytes read from the KV tier.", True),
    ("bytes_written", "tokenmill_kv_tier_written_bytes", "Bytes written to the KV tier.", True),
    ("load_seconds", "tokenmill_kv_tier_load_seconds", "Seconds spent reading blocks from the KV tier.", True),
    ("store_seconds", "tokenmill_kv_tier_store_seconds", "Seconds spent writing blocks to the KV tier.", True),
    ("loaded_blocks", "tokenmill_kv_tier_loaded_blocks", "KV blocks loaded from the tier into the pool.", True),
    ("skipped_slower", "tokenmill_kv_tier_skipped_slower",
     "Tier lookups skipped because loading a block measured slower than recomputing it.", True),
    ("load_seconds_per_block", "tokenmill_kv_tier_load_seconds_per_block",
     "Measured read time per block (median of the last 8), compared with the prefill time per block (EWMA).", False),
    ("promoted", "tokenmill_kv_tier_promoted_blocks",
     "KV blocks read from this tier and written to the tiers above it (disk -> host).", True),
]
# /metrics series of the tiers as a whole (KVTiers.engine_stats): (key, metric name, help, counter?)
ENGINE_METRICS = [
    ("load_timeouts", "tokenmill_kv_tier_load_timeouts",
     "KV tier loads abandoned at their deadline (the request recomputed instead).", True),
    ("dropped_stores", "tokenmill_kv_tier_dropped_stores",
     "Write-through blocks dropped because the tier write queue was full.", True),
    ("loads_in_flight", "tokenmill_kv_tier_loads_in_flight",
     "Requests parked while their KV blocks are read from the tiers.", False),
    ("pending_writes", "tokenmill_kv_tier_pending_writes", "Blocks queued for the tier writer thread.", False),
]


@dataclass
class _Load:
    """A read in flight for one parked request: blocks start.. of its prompt."""

    request_id: str
    start: int
    hashes: list
    blocks: list  # the blocks' token ids
    keys: list[bytes]
    pinned: list  # the pool prefix it extends, referenced until installed or abandoned
    future: concurrent.futures.Future
    deadline: float


def _result(fut) -> list:
    try:
        return fut.result(timeout=0)
    except Exception:  # noqa: BLE001 - a failed read is a miss (the store counts its own errors)
        return []


class KVTiers:
    def __init__(self, stores: list[FileStore], fingerprint: bytes, runner, kv, clock=time.perf_counter,
                 max_requests_per_step: int = 8, alpha: float = 0.2, load_timeout_s: float = 1.0,
                 max_pending_writes: int = 4096, reader=None, writer=None, io_clock=time.perf_counter):
        self.stores, self.fingerprint, self.runner, self.kv, self.clock = stores, fingerprint, runner, kv, clock
        self.block_size = kv.block_size
        self.payload_len = runner.block_nbytes
        self.max_requests_per_step = max_requests_per_step
        self.alpha = alpha
        self._keys: dict[str, list[bytes]] = {}
        self.recompute_s_per_token: float | None = None
        self.load_s_per_block: dict[str, float | None] = {s.name: None for s in stores}
        self._load_samples = {s.name: collections.deque(maxlen=LOAD_WINDOW) for s in stores}
        self.loaded_blocks: dict[str, int] = {s.name: 0 for s in stores}
        self.skipped_slower: dict[str, int] = {s.name: 0 for s in stores}
        self.write_seconds = 0.0  # reading blocks out of the pool for write-through (copy)
        self.write_blocks_seconds = 0.0  # copying loaded blocks into the pool
        self.load_timeout_s = load_timeout_s
        self.max_pending_writes = max_pending_writes
        self.timeouts = 0  # loads abandoned at their deadline (the request recomputed)
        self.dropped_stores = 0  # write-through blocks dropped: the write queue was full
        self.promoted: dict[str, int] = {s.name: 0 for s in stores}  # blocks read here, written to tiers above
        self._loads: dict[str, _Load] = {}
        self._tried: set[str] = set()  # requests looked up already (loaded, abandoned, or nothing found)
        self._abandoned: list[concurrent.futures.Future] = []
        self.io_clock = io_clock
        self._reader = reader or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tier-read")
        self._writer = writer or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tier-write")
        self._wlock = threading.Lock()
        self._pending_writes = 0

    # -- keys -----------------------------------------------------------------------------------
    def keys(self, req, n_blocks: int) -> list[bytes]:
        ks = self._keys.get(req.request_id, [])
        if len(ks) < n_blocks:
            ks = chain_keys(self.fingerprint, req.all_token_ids[:n_blocks * self.block_size], self.block_size, ks)
            self._keys[req.request_id] = ks
        return ks[:n_blocks]

    def preempted(self, request_ids) -> None:
        """Preempted requests lost their pool blocks: they may load from the tiers again."""
        self._tried.difference_update(request_ids)

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted, possibly while parked): drop its keys and its load."""
        self._keys.pop(request_id, None)
        self._tried.discard(request_id)
        ld = self._loads.pop(request_id, None)
        if ld is not None:
            self.kv.pool.release(list(reversed(ld.pinned)))
            self._abandoned.append(ld.future)

    def entry_bytes(self) -> int:
        from tokenmill.engine.tiers.store import HEADER

        return HEADER.size + 8 * self.block_size + self.payload_len

    # -- cost model -----------------------------------------------------------------------------
    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_step(self, seconds: float, sched) -> None:
        prefill = sum(len(s.token_ids) for s in sched.seqs if len(s.token_ids) > 1)
        if prefill >= self.block_size and sched.num_batched_tokens:
            self.recompute_s_per_token = self._ewma(self.recompute_s_per_token, seconds / sched.num_batched_tokens)

    def _observe_load(self, name: str, seconds: float) -> None:
        w = self._load_samples[name]
        w.append(seconds)
        self.load_s_per_block[name] = statistics.median(w)

    def _worth_loading(self, store: FileStore) -> bool:
        load, rate = self.load_s_per_block[store.name], self.recompute_s_per_token
        if (len(self._load_samples[store.name]) < MIN_LOAD_SAMPLES or rate is None
                or load <= rate * self.block_size):
            return True
        self.skipped_slower[store.name] += 1
        return self.skipped_slower[store.name] % PROBE_EVERY == 0  # re-measure now and then

    # -- load (before schedule): prefetch on the reader thread ---------------------------------
    @property
    def loading(self) -> bool:
        return bool(self._loads)

    def prefetch(self, waiting, now: float) -> list[str]:
        """Queue reads of tier blocks extending the pool prefix of the first waiting requests (in admission
        order, parked ones excluded). Returns the ids of the requests to park until `complete` returns them."""
        pool, bs = self.kv.pool, self.block_size
        budget = pool.num_free - sum(len(ld.keys) for ld in self._loads.values())  # blocks loads will fill
        parked = []
        for req in waiting[:self.max_requests_per_step]:
            if budget <= 0:
                break
            if req.request_id in self._loads or req.request_id in self._tried:
                continue  # one load per request: after a timeout (or a short install) it computes the rest
            hashes = self.kv._hashes(req, req.num_tokens - 1)
            toks = req.all_token_ids
            hits = []
            for i, h in enumerate(hashes):
                b = pool.lookup(h, toks[i * bs:(i + 1) * bs])
                if b is None:
                    break
                hits.append(b)
            i0 = len(hits)
            need = -(-req.num_tokens // bs) - i0  # blocks the request still has to fill (load or compute)
            room, budget = budget, budget - need
            if i0 == len(hashes):
                continue
            stores = [st for st in self.stores if self._worth_loading(st)]
            if not stores:
                continue
            keys = self.keys(req, len(hashes))
            n = 0
            for i in range(i0, min(len(hashes), i0 + room)):  # an existence check per block, no read
                if not any(st.contains(keys[i]) for st in stores):
                    break
                n += 1
            if n == 0:  # looked up once per request, not again at every step it waits (nor counted again)
                for st in stores:
                    st.count(misses=1)
                self._tried.add(req.request_id)
                continue
            pool.touch(hits)  # pin the prefix this load extends, until the load is installed or abandoned
            blocks = [toks[i * bs:(i + 1) * bs] for i in range(i0, i0 + n)]
            fut = self._reader.submit(self._read_run, stores, keys[i0:i0 + n], blocks)
            self._loads[req.request_id] = _Load(req.request_id, i0, hashes[i0:i0 + n], blocks, keys[i0:i0 + n],
                                                hits, fut, now + self.load_timeout_s)
            self._tried.add(req.request_id)
            parked.append(req.request_id)
        return parked

    def _read_run(self, stores, keys, blocks) -> list[tuple[str, bytes, float]]:
        """Reader thread: the consecutive blocks found, each (tier, payload, read seconds); stops at a miss."""
        found = []
        for key, toks in zip(keys, blocks):
            got = None
            for st in stores:
                t0 = self.io_clock()
                payload = st.get(key, toks, self.payload_len)
                if payload is not None:
                    got = (st.name, payload, self.io_clock() - t0)
                    break
            if got is None:
                break
            found.append(got)
        return found

    def complete(self, now: float) -> list[str]:
        """Install the loads that finished; abandon those past their deadline. Returns the ids to unpark."""
        for fut in [f for f in self._abandoned if f.done()]:  # a slow read still teaches the tier's speed
            self._abandoned.remove(fut)
            for name, _, dt in _result(fut):
                self._observe_load(name, dt)
        out = []
        for rid, ld in list(self._loads.items()):
            if ld.future.done():
                del self._loads[rid]
                try:
                    self._install(ld, _result(ld.future))
                finally:
                    self.kv.pool.release(list(reversed(ld.pinned)))
                out.append(rid)
            elif now >= ld.deadline:
                del self._loads[rid]
                self.timeouts += 1
                self.kv.pool.release(list(reversed(ld.pinned)))
                self._abandoned.append(ld.future)
                out.append(rid)
        return out

    def _install(self, ld: "_Load", found: list[tuple[str, bytes, float]]) -> None:
        pool, bs = self.kv.pool, self.block_size
        for name, _, dt in found:
            self._observe_load(name, dt)
        # blocks computed meanwhile by another request are in the pool already: install after them
        skip = 0
        while skip < len(found) and pool.lookup(ld.hashes[skip], ld.blocks[skip]) is not None:
            skip += 1
        n = min(len(found) - skip, pool.num_free)
        if n <= 0:
            return
        new = pool.allocate(n)
        t0 = self.clock()
        rows = found[skip:skip + n]
        data = torch.frombuffer(bytearray(b"".join(p for _, p, _ in rows)), dtype=torch.uint8)
        self.runner.write_blocks([b.block_id for b in new], data.view(n, self.payload_len))
        self.write_blocks_seconds += self.clock() - t0
        for j, b in enumerate(new):
            pool.register(b, ld.hashes[skip + j], ld.blocks[skip + j])
            self.loaded_blocks[rows[j][0]] += 1
        pool.release(list(reversed(new)))  # free but cached, most recently used; tail evicted first
        # promotion: a block found in a lower tier is written to the tiers above it
        names = [st.name for st in self.stores]
        for j, (name, payload, _) in enumerate(rows):
            above = self.stores[:names.index(name)]
            if above:
                self._queue_write(ld.keys[skip + j], ld.blocks[skip + j], payload, above)
                self.promoted[name] += 1

    def wait(self, timeout_s: float) -> None:
        """Block until a load finishes (or timeout_s): for a step with nothing else to run."""
        if self._loads:
            concurrent.futures.wait([ld.future for ld in self._loads.values()], timeout=max(0.0, timeout_s),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def next_deadline(self) -> float | None:
        return min((ld.deadline for ld in self._loads.values()), default=None)

    def cancel_all(self) -> list[str]:
        """Abandon every load in flight (after an error): their requests recompute. Returns their ids."""
        out = list(self._loads)
        for ld in self._loads.values():
            self.kv.pool.release(list(reversed(ld.pinned)))
            self._abandoned.append(ld.future)
        self._loads.clear()
        return out

    # -- store (after execute): write-through on the writer thread --------------------------------
    def store_computed(self, sched, requests) -> int:
        """Queue every block that became full in this step for the tiers lacking it. Returns blocks queued."""
        bs = self.block_size
        block_ids, entries = [], []  # entries: (key, tokens, [stores lacking it])
        for s in sched.seqs:
            req = requests.get(s.request_id)
            if req is None:
                continue
            # blocks full of known tokens only (a speculative step's draft positions may be rejected)
            first, end = s.start_pos // bs, min(s.start_pos + len(s.token_ids), req.num_tokens) // bs
            if end <= first:
                continue
            keys = self.keys(req, end)
            for i in range(first, end):
                lacking = [st for st in self.stores if not st.contains(keys[i])]
                if lacking:
                    block_ids.append(s.block_ids[i])
                    entries.append((keys[i], req.all_token_ids[i * bs:(i + 1) * bs], lacking))
        if not block_ids:
            return 0
        t0 = self.clock()
        data = self.runner.read_blocks(block_ids).numpy()  # a copy: the pool may reuse the blocks next step
        self.write_seconds += self.clock() - t0
        n = 0
        for row, (key, toks, lacking) in zip(data, entries):
            n += self._queue_write(key, toks, row.data, lacking)
        return n

    def _queue_write(self, key: bytes, toks, payload, stores) -> int:
        with self._wlock:
            if self._pending_writes >= self.max_pending_writes:
                self.dropped_stores += 1
                return 0
            self._pending_writes += 1
        self._writer.submit(self._write, key, toks, payload, stores)
        return 1

    def _write(self, key, toks, payload, stores) -> None:
        """Writer thread."""
        try:
            for st in stores:
                st.put(key, toks, payload)
        except Exception:  # noqa: BLE001 - a store that fails is a dropped store
            log.exception("KV tier write failed")
        finally:
            with self._wlock:
                self._pending_writes -= 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the queued writes are done (tests, shutdown). True if they are."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._wlock:
                if self._pending_writes == 0:
                    return True
            time.sleep(0.001)
        return False

    def close(self) -> None:
        self.flush(5.0)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False, cancel_futures=True)

    # -- visibility -----------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, float]]:
        out = {}
        for st in self.stores:
            s = st.stats
            out[st.name] = {
                "capacity_bytes": st.capacity, "hits": s.hits, "misses": s.misses, "corrupt": s.corrupt,
                "errors": s.errors, "stores": s.stores, "evictions": s.evictions, "bytes_read": s.bytes_read,
                "bytes_written": s.bytes_written, "load_seconds": s.load_seconds, "store_seconds": s.store_seconds,
                "loaded_blocks": self.loaded_blocks[st.name], "skipped_slower": self.skipped_slower[st.name],
                "load_seconds_per_block": self.load_s_per_block[st.name] or 0.0,
                "promoted": self.promoted[st.name]}
        return out

    def engine_stats(self) -> dict[str, float]:
        """Counters of the tiers as a whole (a load spans tiers; the write queue is shared)."""
        with self._wlock:
            pending = self._pending_writes
        return {"load_timeouts": self.timeouts, "dropped_stores": self.dropped_stores,
                "loads_in_flight": len(self._loads), "pending_writes": pending}
        return out

    def describe(self) -> str:
        per = self.entry_bytes()
        return "; ".join(f"{st.name} tier {st.path} {st.capacity // per * self.block_size} tokens "
                         f"({st.capacity / 2**20:.0f} MiB)" for st in self.stores)
