"""Approximate prefix index: which prompt prefixes the router has sent to which worker.

A prompt is cut into fixed-size chunks (token ids when the prompt is token ids, `chunk_tokens` per chunk;
characters otherwise, `chunk_chars` per chunk; a trailing partial chunk is ignored) and each chunk gets a
chained hash h_i = blake2b(h_{i-1} || chunk_i), so h_i names the whole prefix up to chunk i. Per worker
the index keeps an LRU map hash -> last use time. The estimated prefix hit of a prompt on a worker is the
number of leading chunk hashes present there and not older than `ttl_s`.

It is approximate on purpose: it only knows what this router sent, so it is corrected by what workers
report. When a worker reports fewer cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`)
than the index predicted, the worker evicted: its LRU capacity shrinks to `shrink` x its current size;
each correct prediction grows it by one entry again, up to `max_entries_per_worker`. A worker that went
unhealthy (probably restarted) is forgotten.

No clock reads: every method takes `now` (seconds), so a simulator can drive it with a virtual clock.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixIndexConfig:
    chunk_tokens: int = 16  # chunk size for token-id prompts (match the workers' KV block size)
    chunk_chars: int = 64  # chunk size for text prompts (~16 tokens at ~4 chars/token)
    max_entries_per_worker: int = 65536  # LRU bound: chunk hashes remembered per worker
    min_entries_per_worker: int = 256  # corrections never shrink a worker's capacity below this
    ttl_s: float = 600.0  # an entry unused for this long no longer counts as cached
    shrink: float = 0.8  # on a reported miss, capacity := shrink * current size

    def __post_init__(self):
        if self.chunk_tokens < 1 or self.chunk_chars < 1:
            raise ValueError("prefix index chunk_tokens and chunk_chars must be >= 1")
        if not 1 <= self.min_entries_per_worker <= self.max_entries_per_worker:
            raise ValueError("prefix index needs 1 <= min_entries_per_worker <= max_entries_per_worker")
        if self.ttl_s <= 0:
            raise ValueError(f"prefix index ttl_s must be > 0, got {self.ttl_s}")
        if not 0 < self.shrink < 1:
            raise ValueError(f"prefix index shrink must be in (0, 1), got {self.shrink}")


_LINKS: dict[tuple[bytes, bytes], bytes] = {}  # (parent hash, chunk bytes) -> blake2b(parent || chunk), 12 bytes
MAX_LINKS = 1 << 15  # ~4 MB; cleared when full


def chunk_hashes(prompt, chunk: int) -> tuple[bytes, ...]:
    """Chained hashes of the full `chunk`-sized chunks of a prompt (text, or token ids: a list, tuple or
    1-D numpy array of ints; each id hashed as 4 bytes little-endian).

    Each link blake2b(h_{i-1} || chunk_i) is remembered by its exact input (`_LINKS`): prompts that share a
    prefix (a system prompt) look its links up (~0.3 µs) instead of hashing them again (~1 µs). The same
    bytes go in, the same hash comes out."""
    full = len(prompt) - len(prompt) % chunk
    if isinstance(prompt, str):
        if prompt.isascii():  # one encode: a chunk of ASCII characters is the same slice of the bytes
            data = prompt.encode("ascii")
            return _chain([data[start: start + chunk] for start in range(0, full, chunk)])
        return _chain([prompt[start: start + chunk].encode("utf-8", "surrogatepass")
                       for start in range(0, full, chunk)])
    data, width = _ids_bytes(prompt[:full]), 4 * chunk  # each id as 4 bytes, little-endian, signed
    return _chain([data[start: start + width] for start in range(0, 4 * full, width)])


def _chain(chunks: list[bytes]) -> tuple[bytes, ...]:
    """h_i = blake2b(h_{i-1} || chunks[i], 12 bytes), h_{-1} = b"" (each link looked up in _LINKS first)."""
    hashes: list[bytes] = []
    parent = b""
    links, blake2b = _LINKS, hashlib.blake2b
    if len(links) + len(chunks) > MAX_LINKS:
        links.clear()
    for c in chunks:
        h = links.get((parent, c))
        if h is None:
            h = links[(parent, c)] = blake2b(parent + c, digest_size=12).digest()
        hashes.append(h)
        parent = h
    return tuple(hashes)


def named_chunk_hashes(names, length: int, block: int, chunk: int) -> tuple[bytes, ...]:
    """chunk_hashes of a token-free prompt (engine/kv/named_tokens.py): `length` tokens in blocks of `block`
    tokens named `names` (a Mooncake trace's hash_ids). Chunks must be the named blocks (chunk == block): a
    chunk's hash chains its name, h_i = blake2b(h_{i-1} || name_i), so two prompts' chunk hashes are equal
    exactly where their names are, as token-id chunks' are where their ids are."""
    if chunk != block:
        raise ValueError(f"a token-free prompt's chunks are its {block}-token named blocks, not {chunk} tokens "
                         "(set the router's prefix_index.chunk_tokens to the block size)")
    hashes: list[bytes] = []
    parent = b""
    for name in names[:length // chunk]:
        parent = hashlib.blake2b(parent + _NAME.pack(b"name", name), digest_size=12).digest()
        hashes.append(parent)
    return tuple(hashes)


_NAME = struct.Struct("<4sq")  # a named chunk's bytes: a marker, then the name as int64


def _ids_bytes(ids) -> bytes:
    if hasattr(ids, "astype"):  # a numpy array of ids (the simulator's prompts): the same bytes, ~10x faster
        return ids.astype("<i4").tobytes()
    return struct.pack(f"<{len(ids)}i", *ids)


class PrefixIndex:
    """Per-worker LRU maps of chained chunk hashes (see module docstring)."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        self.config = config or PrefixIndexConfig()
        self._entries: dict[str, OrderedDict[bytes, float]] = {}  # worker -> hash -> last use (s)
        self._capacity: dict[str, int] = {}

    def workers(self) -> list[str]:
        return list(self._entries)

    def size(self, worker: str) -> int:
        return len(self._entries.get(worker, ()))

    def capacity(self, worker: str) -> int:
        return self._capacity.get(worker, self.config.max_entries_per_worker)

    def match(self, worker: str, hashes: tuple[bytes, ...], now: float) -> int:
        """Number of leading chunks of `hashes` this worker probably has cached."""
        entries = self._entries.get(worker)
        if not entries:
            return 0
        oldest = now - self.config.ttl_s
        n = 0
        for h in hashes:
            seen = entries.get(h)
            if seen is None or seen < oldest:
                break
            n += 1
        return n

    def insert(self, worker: str, hashes: tuple[bytes, ...], now: float) -> None:
        """Record that `worker` was sent this prompt (it will hold these chunks once it prefills)."""
        entries = self._entries.setdefault(worker, OrderedDict())
        for h in reversed(hashes):  # the root ends most recent: LRU evicts leaves first, like a radix cache
            entries[h] = now
            entries.move_to_end(h)
        self._evict(worker)

    def correct(self, worker: str, predicted_chunks: int, reported_chunks: int) -> None:
        """Worker-reported cache hit for a request: shrink on a miss, grow back on a correct guess."""
        if worker not in self._entries:
            return
        if reported_chunks < predicted_chunks:
            floor = self.config.min_entries_per_worker
            self._capacity[worker] = max(floor, int(self.config.shrink * self.size(worker)))
            self._evict(worker)
        elif predicted_chunks > 0:
            self._capacity[worker] = min(self.config.max_entries_per_worker, self.capacity(worker) + 1)

    def forget(self, worker: str) -> None:
        self._entries.pop(worker, None)
        self._capacity.pop(worker, None)

    def expire(self, now: float) -> None:
        """Drop entries older than the TTL (LRU order makes this a scan from the front)."""
        oldest = now - self.config.ttl_s
        for entries in self._entries.values():
            while entries:
                h, seen = next(iter(entries.items()))
                if seen >= oldest:
                    break
                entries.popitem(last=False)

    def _evict(self, worker: str) -> None:
        entries = self._entries[worker]
        excess = len(entries) - self.capacity(worker)
        for _ in range(max(0, excess)):
            entries.popitem(last=False)
