"""NamedTokens: a prompt known by the names of its token blocks instead of its token ids (token-free mode).

A Mooncake trace gives each prompt as `hash_ids`: one name per 512-token block, equal names meaning equal
blocks after an equal prefix. The trace replay turns every name into 512 synthesized token ids (bench/workloads/
trace.py) -- ~7.6k ids per prompt that the simulator then converts to a list, hashes twice and digests, while
the KV manager and the router only ever compare blocks for equality. NamedTokens is a sequence the real
`Request`, `Scheduler` and `KVCacheManager` accept in place of the token-id list, with the blocks named:

    len(seq)            prompt length + tokens appended (outputs)
    seq.block(i)        block i's content as the KV manager's prefix cache compares it (BlockPool.lookup /
                        register keep `tuple(content)`: the tuple itself):
                          a full prompt block          ((NAMED, name),)
                          the prompt's partial last    ((TAIL, last name, tail length), *appended ids)
                          block + appended tokens
                          appended tokens only         their ids
                        so two blocks are equal exactly when their names (and appended ids) are
    seq.block_hashes(n) the chained KV block hashes of the first n blocks, each from its content above
                        (`hash_content`; the KV manager's `_hashes` calls it instead of hashing token ids)
    seq[a:b]            appended tokens only: their ids; a range touching the prompt: a NamedSpan, its length
                        only (a prefill chunk's `ScheduledSeq.token_ids`: only a model runner would read ids,
                        and the simulator has none)
    append / extend / copy   as a list's, for the appended tokens

Equal names give equal hashes and contents, different names different ones, as equal / different token
blocks do, so the real scheduler and prefix cache make the same decisions as on the synthesized ids -- except
where those ids would coincide by chance with the simulator's placeholder output token (a synthesized prompt
block equal to a prompt tail followed by placeholder outputs, or two tails of one block differing only in such
tokens): the token-id mode counts such a block as a hit, this mode (like the trace's own naming) does not.
tests/sim/test_token_free.py: the same records as the token-id mode on synthesized traces.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

from tokenmill.engine.kv.hashing import ROOT_HASH

NAMED = -1  # marks a full prompt block given by name, in a block's content tuple
TAIL = -2  # marks the prompt's partial last block (name, its length), in a block's content tuple
_PARENT = struct.Struct("<Q")


def hash_content(parent: int, content) -> int:
    """The KV block hash of a block's content (NamedTokens.block): blake2b(parent || bytes of content), 8 bytes,
    as engine/kv/hashing.hash_block for token ids; the marker tuple is packed as int64s before the ids."""
    h = hashlib.blake2b(_PARENT.pack(parent), digest_size=8)
    if content and type(content[0]) is tuple:
        h.update(array("q", content[0]).tobytes())
        content = content[1:]
    h.update(array("q", content).tobytes())
    return int.from_bytes(h.digest(), "little")


class NamedSpan:
    """A range of a NamedTokens sequence touching its prompt: its length only."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"NamedSpan({self.n} tokens)"


class NamedTokens:
    """A token sequence whose prompt part is `length` tokens in blocks of `block_size`, block i named names[i]
    (ceil(length / block_size) names), followed by appended token ids (module docstring)."""

    __slots__ = ("names", "length", "block_size", "appended")

    def __init__(self, names: tuple[int, ...], length: int, block_size: int, appended: list[int] | None = None):
        if block_size < 1 or length < 1:
            raise ValueError(f"NamedTokens needs block_size >= 1 and length >= 1, got {block_size}, {length}")
        if len(names) != -(-length // block_size):
            raise ValueError(f"{len(names)} block names for {length} tokens in blocks of {block_size}: "
                             f"expected {-(-length // block_size)}")
        self.names, self.length, self.block_size = names, length, block_size
        self.appended = [] if appended is None else appended

    def __len__(self) -> int:
        return self.length + len(self.appended)

    def __iter__(self):
        raise TypeError("a token-free prompt (NamedTokens) has no token ids to iterate")

    def copy(self) -> NamedTokens:
        return NamedTokens(self.names, self.length, self.block_size, list(self.appended))

    def append(self, token_id: int) -> None:
        self.appended.append(token_id)

    def extend(self, token_ids) -> None:
        self.appended.extend(token_ids)

    def block(self, i: int) -> tuple:
        """Block i's content (module docstring); i must be a full block."""
        bs, p = self.block_size, self.length
        start, stop = i * bs, (i + 1) * bs
        if i < 0 or stop > len(self):
            raise IndexError(f"block {i} is not a full block of {len(self)} tokens")
        if stop <= p:
            return ((NAMED, self.names[i]),)
        if start >= p:
            return tuple(self.appended[start - p:stop - p])
        return ((TAIL, self.names[-1], p - start), *self.appended[:stop - p])

    def block_hashes(self, n: int, start: list[int] | None = None) -> list[int]:
        """Chained hashes of the first n blocks (all full); `start`: already known hashes of the leading ones."""
        out = list(start or [])
        parent = out[-1] if out else ROOT_HASH
        for i in range(len(out), n):
            parent = hash_content(parent, self.block(i))
            out.append(parent)
        return out

    def __getitem__(self, key):
        p = self.length
        if not isinstance(key, slice):
            i = key + len(self) if key < 0 else key
            if p <= i < len(self):
                return self.appended[i - p]
            raise TypeError(f"token {key} of a token-free prompt has no id (only appended tokens have)")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("NamedTokens slices take step 1")
        if start >= p:
            return self.appended[start - p:max(start, stop) - p]
        return NamedSpan(max(0, stop - start))

    def __repr__(self) -> str:
        return f"NamedTokens({len(self.names)} blocks, {self.length} tokens + {len(self.appended)} appended)"
