"""Block pool and prefix cache: hash chain, eviction order, ref counts, same-step sharing, freeing."""

from collections import Counter

from tokenmill.engine.kv.block_pool import BlockPool
from tokenmill.engine.kv.hashing import ROOT_HASH, block_hashes, hash_block
from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

BS = 4


def req(rid, ids):
    return Request(rid, list(ids), SamplingParams(max_tokens=4))


def check_invariants(kv: KVCacheManager):
    """ref_cnt of every block == number of block tables holding it; free <=> ref 0; cached map consistent."""
    holders = Counter(b.block_id for table in kv.tables.values() for b in table)
    for b in kv.pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0)
        assert (b.block_id in kv.pool.free) == (b.ref_cnt == 0)
    for h, b in kv.pool.cached.items():
        assert b.block_hash == h
    for table in kv.tables.values():  # a block appears at most once per table
        assert len({b.block_id for b in table}) == len(table)


def test_hash_chain_depends_on_parent_and_content():
    a = block_hashes(list(range(12)), BS)
    assert len(a) == 3
    assert a[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    # same block content after a different prefix -> different hash
    b = block_hashes([9, 1, 2, 3, 4, 5, 6, 7], BS)
    assert b[1] != a[1] and b[0] != a[0]
    # incremental continuation equals the full computation; partial block not hashed
    assert block_hashes(list(range(14)), BS, start=a[:1]) == a
    assert hash_block(1, [1]) != hash_block(1, [1, 0])


def test_prefix_hit_refcounts_and_last_token_recomputed():
    kv = KVCacheManager(16, BS)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 0, 10)
    a.num_computed_tokens = 10
    check_invariants(kv)
    # same prompt again: 2 full blocks cached, the 3rd block is partial -> 8 tokens hit
    b = req("b", range(10))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.block_ids(a)[:2]
    # a fully cached prompt (length multiple of the block size) still recomputes its last token
    c = req("c", range(8))
    blocks_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 4
    assert kv.allocate_slots(b, n, 2, blocks)
    assert [x.ref_cnt for x in blocks] == [2, 2]
    check_invariants(kv)
    kv.free(a)
    assert [x.ref_cnt for x in blocks] == [1, 1]
    check_invariants(kv)
    kv.free(b)
    check_invariants(kv)
    assert kv.pool.num_free == 16
    # after freeing, content is still cached and can be revived
    d = req("d", range(10))
    blocks_d, n_d = kv.get_computed_blocks(d)
    assert n_d == 8
    assert kv.blocks_needed(d, n_d, 2, blocks_d) == 3  # 2 revived + 1 new
    assert kv.allocate_slots(d, n_d, 2, blocks_d)
    check_invariants(kv)


def test_collision_check_compares_tokens():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.register(b, 1234, (1, 2, 3, 4))
    assert pool.lookup(1234, [1, 2, 3, 4]) is b
    assert pool.lookup(1234, [1, 2, 3, 5]) is None  # same hash, other tokens: no hit


def test_lru_eviction_order_tail_blocks_first():
    kv = KVCacheManager(6, BS)
    a = req("a", range(100, 112))  # 3 full blocks
    assert kv.allocate_slots(a, 0, 12)
    ids_a = kv.block_ids(a)
    kv.free(a)  # released last block first -> evicted first
    b = req("b", range(200, 212))
    assert kv.allocate_slots(b, 0, 12)  # takes the 3 never-used blocks first (no cached content)
    assert set(kv.block_ids(b)).isdisjoint(ids_a)
    kv.free(b)
    c = req("c", range(300, 304))
    assert kv.allocate_slots(c, 0, 4)
    # the LRU order is now [a3, a2, a1, b3, b2, b1]: a's tail block is evicted first
    assert kv.block_ids(c) == [ids_a[2]]
    hits, n = kv.get_computed_blocks(req("a2", list(range(100, 112)) + [1]))
    assert n == 8  # a's first two blocks are still cached
    check_invariants(kv)


def test_uncached_blocks_reused_before_cached_ones():
    kv = KVCacheManager(4, BS)
    a = req("a", range(8))
    assert kv.allocate_slots(a, 0, 8)  # 2 full, cached blocks
    kv.free(a)
    b = req("b", range(50, 53))  # partial block: never registered
    assert kv.allocate_slots(b, 0, 3)
    kv.free(b)
    c = req("c", range(60, 63))
    assert kv.allocate_slots(c, 0, 3)
    assert kv.block_ids(c) == kv.block_ids(c)  # noqa
    assert kv.get_computed_blocks(req("a", list(range(8)) + [0]))[1] == 8  # a's cache survived


def test_same_step_shared_prefix_shares_blocks():
    """Two new requests with the same new prefix, admitted in one step: the second reuses the first's
    blocks (registered at allocation) instead of holding duplicates."""
    kv = KVCacheManager(32, BS)
    prefix = list(range(500, 516))
    a, b = req("a", prefix + [1, 2]), req("b", prefix + [3, 4, 5])
    ca, na = kv.get_computed_blocks(a)
    assert na == 0 and kv.allocate_slots(a, 0, a.num_tokens, ca)
    cb, nb = kv.get_computed_blocks(b)  # same step, before any compute
    assert nb == 16 and kv.allocate_slots(b, nb, b.num_tokens - nb, cb)
    assert kv.block_ids(a)[:4] == kv.block_ids(b)[:4]
    assert kv.pool.num_used == 4 + 1 + 1
    check_invariants(kv)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = req("a", range(8))
    assert kv.allocate_slots(a, 0, 8)
    b = req("b", range(20, 30))
    assert not kv.allocate_slots(b, 0, 10)
    assert "b" not in kv.tables and kv.pool.num_free == 1
    check_invariants(kv)


class _ReferenceKV(KVCacheManager):
    """allocate_slots and block registration as first written (no shortcut for a table that already covers the
    tokens, hashing on every call): the reference the shortcuts must match."""

    def allocate_slots(self, req, num_computed, num_new, computed=()):
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
            bs, hashes = self.block_size, self._hashes(req, num_computed + num_new)
            for i in range(req.num_registered_blocks, len(hashes)):
                self.pool.register(table[i], hashes[i], req.all_token_ids[i * bs:(i + 1) * bs])
            req.num_registered_blocks = max(req.num_registered_blocks, len(hashes))
        return True


def test_allocation_shortcuts_match_the_reference_on_random_workloads():
    """The real KVCacheManager against _ReferenceKV through the same random admissions (with prefix hits),
    prefill chunks, decode tokens, preemptions and finishes: every return value, block table, prefix-cache
    entry, free-queue order, ref count and registered-block count equal."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        bs = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(8, 60)
        kvs = [KVCacheManager(num_blocks, bs), _ReferenceKV(num_blocks, bs)]
        prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 3 * bs))] for _ in range(3)]
        live: list[list[Request]] = [[], []]
        for step in range(400):
            op = rng.random()
            if op < 0.15 or not live[0]:
                ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 3 * bs))]
                rs = [req(f"r{step}", ids) for _ in kvs]
                outs = []
                for kv, r in zip(kvs, rs):
                    computed, cached = kv.get_computed_blocks(r)
                    outs.append((cached, kv.allocate_slots(r, cached, r.num_tokens - cached, computed)))
                    if outs[-1][1]:
                        r.num_computed_tokens = r.num_tokens
                assert outs[0] == outs[1]
                if outs[0][1]:
                    for lv, r in zip(live, rs):
                        lv.append(r)
            elif op < 0.8:  # a decode token (sometimes a few: a chunk)
                k = rng.randrange(len(live[0]))
                new = [rng.randrange(50) for _ in range(1 if rng.random() < 0.8 else rng.randint(2, 2 * bs))]
                outs = []
                for kv, lv in zip(kvs, live):
                    r = lv[k]
                    for t in new:
                        r.append_output(t)
                    outs.append(kv.allocate_slots(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens))
                    if outs[-1]:
                        r.num_computed_tokens = r.num_tokens
                assert outs[0] == outs[1]
            else:  # finish or preempt: free the blocks
                k = rng.randrange(len(live[0]))
                for kv, lv in zip(kvs, live):
                    kv.free(lv.pop(k))
            a, b = kvs
            assert {k: [x.block_id for x in t] for k, t in a.tables.items()} == \
                {k: [x.block_id for x in t] for k, t in b.tables.items()}
            assert {h: x.block_id for h, x in a.pool.cached.items()} == \
                {h: x.block_id for h, x in b.pool.cached.items()}
            assert list(a.pool.free) == list(b.pool.free)
            assert [x.ref_cnt for x in a.pool.blocks] == [x.ref_cnt for x in b.pool.blocks]
            assert [r.num_registered_blocks for r in live[0]] == [r.num_registered_blocks for r in live[1]]
            check_invariants(a)


def test_block_hashes_of_a_numpy_array_equal_the_list_ones():
    import numpy as np

    from tokenmill.engine.kv.hashing import block_hashes_of_array

    rng = np.random.default_rng(1)
    for bs in (1, 3, 16, 512):
        for n in (0, 1, bs - 1, bs, 3 * bs + 2, 5 * bs):
            for dtype in (np.int64, np.int32, np.uint32):
                arr = rng.integers(0, 2**31 - 1, size=n).astype(dtype)
                assert block_hashes_of_array(arr, bs) == block_hashes(arr.tolist(), bs)
    big = rng.integers(0, 2**62, size=40)
    assert block_hashes_of_array(big, 4) == block_hashes(big.tolist(), 4)
