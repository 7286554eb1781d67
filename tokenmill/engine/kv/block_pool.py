"""BlockPool: the fixed set of KV blocks, their reference counts, and the prefix cache (hash -> block).

A block is live while ref_cnt > 0 (owned by one or more requests: shared prefix blocks are read-only
and have one reference per request). Free blocks sit in an LRU queue; a free block may still hold a
cached prefix (its hash stays in `cached`) until it is handed out again, which evicts it.

KV events (off unless `events` is a list): every change to the prefix cache is appended in order, a stored
block as its hash (>= 0), an evicted one as ~hash (< 0). The engine core process ships them to the
server's front-end once per step, which mirrors the set of cached hashes (server/prefix_mirror.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False, slots=True)  # slots: a simulated cluster holds millions of these
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the block's tokens (hash collision check)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: evict first
        self.cached: dict[int, KVBlock] = {}  # block hash -> block
        self.num_evictions = 0
        self.events: list[int] | None = None  # KV events, when the owner collects them

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, block_hash: int, token_ids) -> KVBlock | None:
        b = self.cached.get(block_hash)
        if b is None or b.token_ids != tuple(token_ids):
            return None
        return b

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on (cached) blocks; a free one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with only {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.block_hash is not None:  # evict its cached content
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    if self.events is not None:
                        self.events.append(~b.block_hash)
                b.block_hash, b.token_ids = None, None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def release(self, blocks) -> None:
        """Drop one reference from each block, in the given order (first freed = first evicted among
        cached blocks); blocks holding no cached content go to the front (reused first)."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} released more often than taken"
            if b.ref_cnt == 0:
                self.free[b.block_id] = None
                if b.block_hash is None:
                    self.free.move_to_end(b.block_id, last=False)

    def register(self, b: KVBlock, block_hash: int, token_ids) -> None:
        """Publish a full block in the prefix cache (no-op if caching is off or the hash is taken)."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.cached:  # same content computed twice (e.g. before it was cached): keep first
            return
        b.block_hash, b.token_ids = block_hash, tuple(token_ids)
        self.cached[block_hash] = b
        if self.events is not None:
            self.events.append(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds; returns how many."""
        n = 0
        for b in self.blocks:
            if b.ref_cnt == 0 and b.block_hash is not None:
                del self.cached[b.block_hash]
                if self.events is not None:
                    self.events.append(~b.block_hash)
                b.block_hash, b.token_ids = None, None
                n += 1
        return n
