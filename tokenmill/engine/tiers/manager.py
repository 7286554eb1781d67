"""KVTiers: the engine's side of the KV tiers below the pool (host DRAM on /dev/shm, local disk).

Called by LLMEngine.step() around the clock-free scheduler, never from inside it:
  - `load_for_waiting(waiting)` before schedule(): for the first waiting requests, the blocks after their
    pool prefix hit are looked up tier by tier (host, then disk) by key; the consecutive run found is read,
    written into free pool blocks (ModelRunner.write_blocks) and registered in the pool's prefix cache under
    their block hashes, so the scheduler's own prefix lookup finds them (and counts them in cached_tokens).
    The request's pool hits are pinned (a reference) while the loaded blocks are allocated, so loading cannot
    evict the prefix it extends.
  - `store_computed(sched, requests)` after execute: write-through. Every block that became full in this
    step is written to each tier that lacks it. Chosen over write-back (write on pool eviction) because the
    host tier is shared between workers: a session that moves to another worker hits only if its blocks are
    in the tier while they are still in the first worker's pool; and write-through puts no write on the
    eviction path (allocation stays I/O-free). Its price is write bandwidth for blocks never read again
    (measured in benchmarks/kv_tiers.py).
  - `observe_step(seconds, sched)`: the prefill rate (EWMA seconds per token), against which each tier's
    measured read time per block (median of the last 8 reads, read + verify: robust to one read delayed by
    preemption, which an EWMA is not; the copy into the pool is a memcpy) is compared: a tier whose block loads cost more than recomputing a
    block is skipped (counted as `skipped_slower`), re-probed every PROBE_EVERY skipped lookups.
Every failure inside is a miss or a dropped store, never an exception out of here (the engine also guards).
"""

from __future__ import annotations

import collections
import logging
import statistics
import time

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
]


class KVTiers:
    def __init__(self, stores: list[FileStore], fingerprint: bytes, runner, kv, clock=time.perf_counter,
                 max_requests_per_step: int = 8, alpha: float = 0.2):
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

    # -- keys -----------------------------------------------------------------------------------
    def keys(self, req, n_blocks: int) -> list[bytes]:
        ks = self._keys.get(req.request_id, [])
        if len(ks) < n_blocks:
            ks = chain_keys(self.fingerprint, req.all_token_ids[:n_blocks * self.block_size], self.block_size, ks)
            self._keys[req.request_id] = ks
        return ks[:n_blocks]

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

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

    # -- load (before schedule) -----------------------------------------------------------------
    def load_for_waiting(self, waiting) -> int:
        """Load tier blocks extending the pool prefix of the first waiting requests. Returns blocks loaded."""
        pool, bs = self.kv.pool, self.block_size
        budget = pool.num_free  # blocks this pass may fill: each request's loads plus the rest it will compute
        total = 0
        for req in waiting[:self.max_requests_per_step]:
            if budget <= 0:
                break
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
            keys = self.keys(req, len(hashes))
            found: list[tuple[str, bytes]] = []
            for i in range(i0, min(len(hashes), i0 + room)):
                got = None
                for st in self.stores:
                    if not self._worth_loading(st):
                        continue
                    t0 = self.clock()
                    payload = st.get(keys[i], toks[i * bs:(i + 1) * bs], self.payload_len)
                    dt = self.clock() - t0
                    if payload is not None:  # measured per read, so a slow tier is noticed within one request
                        self._observe_load(st.name, dt)
                        got = (st.name, payload)
                        break
                if got is None:
                    break
                found.append(got)
            if not found:
                continue
            pool.touch(hits)  # pin the prefix this load extends
            try:
                n = min(len(found), pool.num_free)
                if n == 0:
                    continue
                new = pool.allocate(n)
                t0 = self.clock()
                data = torch.frombuffer(bytearray(b"".join(p for _, p in found[:n])), dtype=torch.uint8)
                self.runner.write_blocks([b.block_id for b in new], data.view(n, self.payload_len))
                self.write_blocks_seconds += self.clock() - t0
                for j, b in enumerate(new):
                    i = i0 + j
                    pool.register(b, hashes[i], toks[i * bs:(i + 1) * bs])
                    self.loaded_blocks[found[j][0]] += 1
                pool.release(list(reversed(new)))  # free but cached, most recently used; tail evicted first
                total += n
            finally:
                pool.release(list(reversed(hits)))
        return total

    # -- store (after execute): write-through ---------------------------------------------------
    def store_computed(self, sched, requests) -> int:
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
        data = self.runner.read_blocks(block_ids).numpy()
        self.write_seconds += self.clock() - t0
        n = 0
        for row, (key, toks, lacking) in zip(data, entries):
            for st in lacking:
                n += st.put(key, toks, row.data)
        return n

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
                "load_seconds_per_block": self.load_s_per_block[st.name] or 0.0}
        return out

    def describe(self) -> str:
        per = self.entry_bytes()
        return "; ".join(f"{st.name} tier {st.path} {st.capacity // per * self.block_size} tokens "
                         f"({st.capacity / 2**20:.0f} MiB)" for st in self.stores)
