"""KVCacheManager: per-request block tables on top of the BlockPool, and prefix-cache lookups.

No clock, no I/O: the simulator drives this same code with a virtual clock.
"""

from __future__ import annotations

from tokenmill.engine.kv.block_pool import BlockPool, KVBlock
from tokenmill.engine.kv.hashing import ROOT_HASH, block_hashes, hash_block
from tokenmill.engine.kv.named_tokens import NamedTokens, hash_content
from tokenmill.engine.request import Request


def _block_of(tokens, bs: int):
    """i -> block i's tokens as the prefix cache compares them: a slice of a token-id list, or a token-free
    prompt's block content (engine/kv/named_tokens.py)."""
    if isinstance(tokens, NamedTokens):
        return tokens.block
    return lambda i: tokens[i * bs:(i + 1) * bs]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[KVBlock]] = {}
        self.prefix_queries_tokens = 0  # cumulative, for metrics
        self.prefix_hits_tokens = 0

    # -- lookups --------------------------------------------------------------------------------
    def _hashes(self, req: Request, num_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first num_tokens tokens (cached on the request)."""
        n_full = num_tokens // self.block_size
        if len(req.block_hashes) < n_full:
            toks = req.all_token_ids
            if isinstance(toks, NamedTokens):
                req.block_hashes = toks.block_hashes(n_full, req.block_hashes)
            else:
                req.block_hashes = block_hashes(toks[: n_full * self.block_size], self.block_size,
                                                req.block_hashes)
        return req.block_hashes[:n_full]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in whole blocks; the last token is always recomputed
        (its logits are needed). Returns (blocks, num_cached_tokens); takes no reference."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        hashes = self._hashes(req, req.num_tokens - 1)
        hits: list[KVBlock] = []
        block = _block_of(req.all_token_ids, bs)
        for i, h in enumerate(hashes):
            b = self.pool.lookup(h, block(i))
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * bs

    def cached_prefix_tokens(self, token_ids: list[int], hashes: list[int] | None = None) -> int:
        """How many leading tokens of a prompt the prefix cache holds now, in whole blocks (the last token
        excluded: it is always recomputed). An estimate for admission control: it takes no reference (the
        blocks may be evicted before the request is scheduled) and only reads the cache's dict and block
        fields, so another thread may call it while the engine steps (a block changing under it is a miss).
        `hashes`: the caller's cache of the prompt's block hashes (filled as far as needed, reused next time)."""
        if not self.enable_caching or len(token_ids) < 2:
            return 0
        hashes = [] if hashes is None else hashes
        bs, n = self.block_size, 0
        block = _block_of(token_ids, bs)
        named = isinstance(token_ids, NamedTokens)
        for i in range((len(token_ids) - 1) // bs):
            toks = block(i)
            if i == len(hashes):
                hashes.append((hash_content if named else hash_block)(hashes[-1] if hashes else ROOT_HASH, toks))
            if self.pool.lookup(hashes[i], toks) is None:
                break
            n += bs
        return n

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_query_tokens
        self.prefix_hits_tokens += num_hit_tokens

    # -- allocation -----------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_computed: int, num_new: int, computed: list[KVBlock] = ()) -> int:
        """Free blocks that allocate_slots would consume (including cached free blocks it would revive)."""
        have = len(self.tables.get(req.request_id, ())) + len(computed)
        required = -(-(num_computed + num_new) // self.block_size)
        revive = sum(1 for b in computed if b.ref_cnt == 0)
        return max(0, required - have) + revive

    def allocate_slots(self, req: Request, num_computed: int, num_new: int,
                       computed: list[KVBlock] = ()) -> bool:
        """Make room for num_new tokens after num_computed (the first len(computed) blocks come from the
        prefix cache). Registers blocks that become full. False (and no change) if blocks are short."""
        table = self.tables.get(req.request_id)
        if not computed and table is not None and -(-(num_computed + num_new) // self.block_size) <= len(table):
            # the table already covers the tokens (most decode steps): blocks_needed is 0, nothing to allocate
            if self.enable_caching:
                self._register_full_blocks(req, table, num_computed + num_new)
            return True
        if self.blocks_needed(req, num_computed, num_new, computed) > self.pool.num_free:
            return False
        table = self.tables.setdefault(req.request_id, [])
        if computed:
            self.pool.touch(list(computed))
            table.extend(computed)
        required = -(-(num_computed + num_new) // self.block_size)
        if required > len(table):
            table.extend(self.pool.allocate(required - len(table)))
        if self.enable_caching:
            self._register_full_blocks(req, table, num_computed + num_new)
        return True

    def _register_full_blocks(self, req: Request, table: list[KVBlock], num_tokens: int) -> None:
        bs = self.block_size
        if num_tokens // bs <= req.num_registered_blocks:  # no block became full (most decode steps): nothing
            return  # to hash or register (the hashes of the registered blocks are already on the request)
        hashes = self._hashes(req, num_tokens)
        block = _block_of(req.all_token_ids, bs)
        for i in range(req.num_registered_blocks, len(hashes)):
            self.pool.register(table[i], hashes[i], block(i))
        req.num_registered_blocks = max(req.num_registered_blocks, len(hashes))

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks that the first num_tokens tokens need (speculative decoding's rollback of
        rejected draft positions). The blocks released were never registered: they hold no known token's
        full block."""
        table = self.tables.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if table and len(table) > keep:
            assert keep >= req.num_registered_blocks, "truncate would drop a registered block"
            tail = table[keep:]
            del table[keep:]
            self.pool.release(reversed(tail))

    def free(self, req: Request) -> None:
        """Release the request's blocks (finish, abort, preemption): last block first, so a request's
        tail is evicted before its (more shareable) prefix."""
        table = self.tables.pop(req.request_id, None)
        req.num_registered_blocks = 0
        if table:
            self.pool.release(reversed(table))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.tables.get(req.request_id, ())]

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
