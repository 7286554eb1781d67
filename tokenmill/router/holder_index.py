"""The prefix index plus which workers hold each prompt's first chunk: a decision matches a prompt only on them.

Chunk hashes are chained (prefix_index.py: h_i names the whole prefix up to chunk i), so a worker without a
prompt's first chunk hash h_0 has no hit at all for it. `HolderIndex` keeps, beside the per-worker LRU maps,

    holders[h_0] = the workers whose map holds h_0 now     (h_0 of every prompt `insert`ed)

kept exact by every change of the maps (insert, LRU eviction, correction, forget, expiry), so
`holders(h_0)` lists exactly the workers for which `match` can be > 0, and the index answers every other
question as `PrefixIndex` does (same entries, same LRU order, same evictions). No clock: `now` comes in.
"""

from __future__ import annotations

from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig


class HolderIndex(PrefixIndex):
    def __init__(self, config: PrefixIndexConfig | None = None):
        super().__init__(config)
        self._holders: dict[bytes, set[str]] = {}  # first chunk hash -> workers whose map holds it

    def holders(self, first: bytes) -> set[str]:
        return self._holders.get(first, _EMPTY)

    def insert(self, worker: str, hashes: tuple[bytes, ...], now: float) -> None:
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
