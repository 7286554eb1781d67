"""The prefix index plus which workers hold each prompt's first chunk: a decision matches a prompt only on them.

Chunk hashes are chained (prefix_index.py: h_i names the whole prefix up to chunk i), so a worker without a
prompt's first chunk hash h_0 has no hit at all for it. `HolderIndex` keeps, beside the per-worker LRU maps,

    holders[h_0] = the workers whose map holds h_0 now     (h_0 of every prompt `insert`ed)

kept exact by every change of the maps (insert, LRU eviction, correction, forget, expiry), so
`holders(h_0)` lists exactly the workers for which `match` can be > 0, and the index answers every other
question as `PrefixIndex` does (same entries, same LRU order, same evictions, the same `match`).

`match` by bisection. `PrefixIndex.match` walks the prompt's chain until the first chunk missing or older than
the TTL (~25 dict look-ups for a 1,600-character prompt, per worker holding its first chunk). In a worker's map
the chunks present and fresh always form a prefix of any chain: every `insert` writes a prompt's whole chain
with one `now`, the root last (most recent), so after it h_{i-1} is at least as recent as h_i in LRU order and
in time, and every removal (LRU eviction, correction, expiry) takes the least recent first -- a later chunk
always goes before its parent. So "h_i present and fresh" is true up to some i and false after it, and
bisection finds that length in ~log2(chunks) look-ups: the same answer. The time order needs the `now` of
successive inserts never to go back (a monotonic or virtual clock); if one ever does, the index walks
linearly from then on (`bisect` False). tests/router/test_router_table.py checks both against `PrefixIndex` on
random sequences. No clock: `now` comes in.
"""

from __future__ import annotations

from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig


class HolderIndex(PrefixIndex):
    def __init__(self, config: PrefixIndexConfig | None = None):
        super().__init__(config)
        self._holders: dict[bytes, set[str]] = {}  # first chunk hash -> workers whose map holds it
        self.bisect = True  # every insert's `now` so far >= the one before (see the module docstring)
        self._last_insert = float("-inf")

    def holders(self, first: bytes) -> set[str]:
        return self._holders.get(first, _EMPTY)

    def match(self, worker: str, hashes: tuple[bytes, ...], now: float) -> int:
        if not self.bisect:
            return super().match(worker, hashes, now)
        entries = self._entries.get(worker)
        if not entries:
            return 0
        oldest = now - self.config.ttl_s
        lo, hi = 0, len(hashes)  # hashes[:lo] present and fresh, hashes[hi:] not
        while lo < hi:
            mid = (lo + hi) >> 1
            seen = entries.get(hashes[mid])
            if seen is None or seen < oldest:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def insert(self, worker: str, hashes: tuple[bytes, ...], now: float) -> None:
        if now < self._last_insert:
            self.bisect = False
        self._last_insert = now
        if hashes:
            self._holders.setdefault(hashes[0], set()).add(worker)
        super().insert(worker, hashes, now)

    def forget(self, worker: str) -> None:
        for h in self._entries.get(worker, ()):
            self._drop(h, worker)
        super().forget(worker)

    def expire(self, now: float) -> None:
        oldest = now - self.config.ttl_s
        for worker, entries in self._entries.items():
            while entries:
                h, seen = next(iter(entries.items()))
                if seen >= oldest:
                    break
                entries.popitem(last=False)
                self._drop(h, worker)

    def _evict(self, worker: str) -> None:
        entries = self._entries[worker]
        for _ in range(max(0, len(entries) - self.capacity(worker))):
            h, _seen = entries.popitem(last=False)
            self._drop(h, worker)

    def _drop(self, h: bytes, worker: str) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(worker)
            if not s:
                del self._holders[h]


_EMPTY: frozenset = frozenset()
