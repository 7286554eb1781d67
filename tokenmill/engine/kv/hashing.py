"""Chained block hashes: hash(block i) = H(hash(block i-1), token ids of block i).

Stable across processes and machines (blake2b, not Python's hash), so a block can be named by its hash
to another worker (P/D transfer), a host/SSD tier or a router's prefix index.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

ROOT_HASH = 0


def hash_block(parent: int, token_ids) -> int:
    h = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain(link, root, token_ids: list[int], block_size: int, start: list | None = None) -> list:
    """link(parent, block's tokens) over every full block of token_ids, each block's value the next one's
    parent (root for the first); `start` = already known values of the leading blocks."""
    out = list(start or [])
    parent = out[-1] if out else root
    for i in range(len(out), len(token_ids) // block_size):
        parent = link(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def block_hashes(token_ids: list[int], block_size: int, start: list[int] | None = None) -> list[int]:
    """Hashes of every full block of token_ids; `start` = already known hashes of the leading blocks."""
    return chain(hash_block, ROOT_HASH, token_ids, block_size, start)


def block_hashes_of_array(tokens, block_size: int) -> list[int]:
    """block_hashes of a numpy array of token ids, hashing its int64 buffer in place: the bytes that
    hash_block packs (`array("q")`, native int64 either way), without building a list per block
    (tests/engine/test_block_pool.py: equal to block_hashes)."""
    import numpy as np

    n = len(tokens) // block_size
    buf = memoryview(np.ascontiguousarray(tokens[:n * block_size], dtype=np.int64)).cast("B")
    out, parent, step = [], ROOT_HASH, 8 * block_size
    for k in range(0, n * step, step):
        h = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
        h.update(buf[k:k + step])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
