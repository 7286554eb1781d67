"""PrefixMirror: the front-end's copy of the set of block hashes in the engine core's prefix cache.

The core ships its KV events once per step (engine/kv/block_pool.py: a stored block as its hash, an
evicted one as ~hash); applied in order, they keep this set equal to the keys of the core's
`BlockPool.cached` as of that step. The admission control asks it how much of a new prompt is cached,
hashing the prompt with the engine's own chained block hash (engine/kv/hashing.py), so it answers what the
engine's `KVCacheManager.cached_prefix_tokens` would have (up to one step of lag, and without the
token-by-token collision check: 64-bit hashes).
"""

from __future__ import annotations

from tokenmill.engine.kv.hashing import ROOT_HASH, hash_block


class PrefixMirror:
    def __init__(self, block_size: int, enabled: bool = True):
        self.block_size = block_size
        self.enabled = enabled
        self.hashes: set[int] = set()

    def apply(self, events: list[int]) -> None:
        add, remove = self.hashes.add, self.hashes.discard
        for e in events:
            if e >= 0:
                add(e)
            else:
                remove(~e)

    def cached_prefix_tokens(self, token_ids: list[int], hashes: list[int] | None = None) -> int:
        """Leading tokens of the prompt in the cache, in whole blocks, the last token excluded (the
        engine always recomputes it). `hashes`: the caller's per-prompt list of block hashes (filled as
        far as needed and reused by the next call)."""
        if not self.enabled or len(token_ids) < 2:
            return 0
        hashes = [] if hashes is None else hashes
        bs, n = self.block_size, 0
        for i in range((len(token_ids) - 1) // bs):
            if i == len(hashes):
                hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, token_ids[i * bs:(i + 1) * bs]))
            if hashes[i] not in self.hashes:
                break
            n += bs
        return n
