"""Decisions on the worker table (router/worker_table.py, holder_index.py, table_decisions.py) are the full
snapshot's: two routers, one per RouterConfig.snapshot, get the same random event sequence (requests, holds,
first tokens, output tokens, finishes with cache reports, clock steps, workers going down, coming back, drained
and added, queued-prefill gauges) and every decision -- routing choice and reason, admission action, worker,
predicted TTFT, reason, retry-after, the request's least uncached tokens -- must be equal, bit for bit."""

import random

import numpy as np
import pytest

from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.config import RouterConfig
from tokenmill.router.holder_index import HolderIndex
from tokenmill.router.policies import POLICIES, PolicyParams
from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig, chunk_hashes
from tokenmill.router.prompt import PromptKey
from tokenmill.router.queues import Held
from tokenmill.router.rates import RatePriors
from tokenmill.router.router import Router
from tokenmill.router.worker_state import WorkerPool, WorkerSpec
from tokenmill.router.worker_table import FIELDS, WorkerTable


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Fut:
    def __init__(self, side, i):
        self.side, self.i, self._done = side, i, False

    def done(self):
        return self._done

    def set_result(self, flight):
        self._done = True
        self.side.log.append((self.i, "admit", flight.worker, flight.predicted_ttft_s))
        self.side.flights[self.i] = (self.side.held.pop(self.i)[0], flight)

    def set_exception(self, exc):
        self._done = True
        self.side.log.append((self.i, "refused", exc.reason, exc.retry_after_s))
        self.side.held.pop(self.i, None)


class Side:
    def __init__(self, cfg, clock, n_workers):
        self.r = Router(cfg, clock=clock)
        for i in range(n_workers):
            self.r.add_worker(WorkerSpec(f"http://w{i}")).healthy = True
        self.log: list = []
        self.flights: dict[int, tuple] = {}
        self.held: dict[int, tuple] = {}


def _decision(adm, ctx):
    return (adm.action, adm.worker, adm.predicted_ttft_s, adm.reason, adm.retry_after_s,
            ctx.choice.worker if ctx.choice else None, ctx.choice.reason if ctx.choice else None, ctx.uncached_tokens)


def _run(seed: int, policy: str, mode: str, steps: int = 400) -> dict:
    rng = random.Random(seed)
    n_workers = rng.randint(3, 14)
    cfg = dict(policy=policy, admission=AdmissionConfig(mode=mode, hold=rng.choice(["all", "sheddable"]),
                                                        hold_drain=rng.choice(["fast", "expected", "slow"])),
               prefix_index=PrefixIndexConfig(chunk_tokens=4, max_entries_per_worker=rng.choice([32, 4096]),
                                              min_entries_per_worker=4, ttl_s=rng.choice([2.0, 600.0])),
               policy_params=PolicyParams(guard_abs=rng.choice([1, 4])),
               rate_priors=RatePriors(prefill_rate_tps=rng.choice([200.0, 2000.0])))
    clock = Clock()
    sides = [Side(RouterConfig(snapshot=m, **cfg), clock, n_workers) for m in ("table", "full")]
    families = [[rng.randrange(1000) for _ in range(rng.randint(4, 40))] for _ in range(rng.randint(1, 6))]
    classes = list(sides[0].r.classes.values())
    n_req = 0
    for _ in range(steps):
        op = rng.random()
        live = sorted(sides[0].flights)
        if op < 0.35:  # a request (sometimes a retry of a live one: excluded workers)
            prompt = rng.choice(families) + [rng.randrange(1000) for _ in range(rng.randint(0, 30))]
            cls, max_tokens = rng.choice(classes), rng.randint(1, 64)
            key = PromptKey(chunk_hashes(prompt, 4), True, len(prompt), 4)
            retry = {f"http://w{rng.randrange(n_workers)}" for _ in range(rng.randint(0, 2))} if rng.random() < 0.1 else set()
            outs = []
            for s in sides:
                ctx = s.r.new_request(key, cls, max_tokens)
                ctx.tried |= retry
                adm, snap, chunks = s.r.decide(ctx)
                outs.append(_decision(adm, ctx))
                if adm.action == "admit":
                    s.flights[n_req] = (ctx, s.r._dispatch(ctx, adm, snap, chunks))
                elif adm.action == "hold" and s.r.queues.room(cls) > 0:
                    fut = Fut(s, n_req)
                    s.held[n_req] = (ctx, fut)
                    s.r.queues[cls.name].append(Held(ctx, fut, clock()))
                    s.r.pump()
            assert outs[0] == outs[1], (seed, n_req, outs)
            n_req += 1
        elif op < 0.5 and live:  # a first token
            i = rng.choice(live)
            for s in sides:
                ctx, f = s.flights[i]
                if f.first_token_s is None:
                    s.r.first_token(ctx, f)
        elif op < 0.6 and live:
            i, n = rng.choice(live), rng.randint(1, 8)
            for s in sides:
                s.r.output_tokens(s.flights[i][1], n)
        elif op < 0.75 and live:  # a finish, with the worker's cache report
            i, cached = rng.choice(live), rng.choice([0, 4, 8, 16, 100])
            for s in sides:
                ctx, f = s.flights.pop(i)
                s.r.finish(ctx, f, 3, {"prompt_tokens": ctx.prompt_tokens,
                                       "prompt_tokens_details": {"cached_tokens": cached}})
        elif op < 0.86:
            clock.now += rng.expovariate(1 / 0.2)
            for s in sides:
                s.r.pump()
        elif op < 0.87:
            for s in sides:
                s.r.index.expire(clock.now)
        elif op < 0.91:
            url = f"http://w{rng.randrange(n_workers)}"
            for s in sides:
                s.r.mark_down(url)
        elif op < 0.95:
            url = f"http://w{rng.randrange(n_workers)}"
            for s in sides:
                s.r.mark_up(url)
        elif op < 0.96:
            url = f"http://w{rng.randrange(n_workers)}"
            for s in sides:
                s.r.remove_worker(url)
        elif op < 0.97:
            url = f"http://w{rng.randrange(n_workers + 2)}"
            for s in sides:
                s.r.add_worker(WorkerSpec(url)).healthy = True
        else:
            url, gauge = f"http://w{rng.randrange(n_workers)}", rng.choice([0, 50, 500])
            for s in sides:
                w = s.r.pool.get(url)
                if w is not None:
                    w.report_queued_prefill(gauge)
        assert sides[0].log == sides[1].log, seed
        assert sorted(sides[0].flights) == sorted(sides[1].flights), seed
    assert sides[1].r.decisions["table"] == 0
    # the dispatch's bookkeeping from the (reduced) table snapshot equals the full snapshot's: the decision
    # reasons with longest / shorter hit, and the hit tokens and predicted TTFT per worker
    for name in ("decisions", "prefix_hit_tokens", "predicted_ttft", "routed"):
        assert _samples(sides[0].r, name) == _samples(sides[1].r, name), (seed, name)
    return sides[0].r.decisions


def _samples(router, name: str) -> list:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for m in getattr(router.metrics, name).collect() for s in m.samples
                  if not s.name.endswith("_created"))  # (a wall-clock time)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", ["leading", "off", "lagging"])
def test_table_decides_as_the_full_snapshot(policy, mode):
    used = {"table": 0, "full": 0}
    for seed in range(6):
        for k, v in _run(seed * 7919 + sum(map(ord, policy + mode)), policy, mode).items():
            used[k] += v
    if mode == "lagging":  # lagging admission has no table form: only retries are decided on the table
        assert used["full"] > 0
    else:
        assert used["table"] > 0 and used["full"] == 0  # the table path was taken (else this checks nothing)


@pytest.mark.parametrize("mode", ["leading", "off"])
def test_table_numpy_path_decides_as_the_full_snapshot(mode, monkeypatch):
    """The numpy forms (decisions over more than SMALL workers) on the same random sequences: with SMALL = 0
    every decision takes them (the test above takes the Python-float rows for its 3-14 workers)."""
    from tokenmill.router import table_decisions

    monkeypatch.setattr(table_decisions, "SMALL", 0)
    for seed in range(4):
        used = _run(seed * 104729 + len(mode), "prefix-load", mode)
        assert used["table"] > 0 and used["full"] == 0


def test_table_rows_are_the_views_and_only_changed_workers_are_reread():
    pool = WorkerPool(RatePriors())
    table = WorkerTable(pool)
    for i in range(5):
        pool.add(WorkerSpec(f"http://w{i}")).healthy = True
    table.refresh()
    reads = table.reads
    w0 = pool.get("http://w0")
    f = w0.start("a", 100, 0.1, 0.0, ttft_deadline_s=3.0)
    data = table.refresh()
    assert table.reads == reads + 1  # only w0
    v = w0.view(0, 1.0)
    for k, name in enumerate(FIELDS):
        if name == "routable":
            assert data[k, 0] == v.routable
        elif name == "deadline":
            assert data[k, 0] == 3.0 and v.pending_slack_s == 2.0
        else:
            assert data[k, 0] == getattr(v, name), name
    # the view (snapshot.new_view, no dataclass __init__) is the dataclass's own, field for field
    from dataclasses import fields

    from tokenmill.router.snapshot import WorkerView, new_view
    built = WorkerView(**{fd.name: getattr(v, fd.name) for fd in fields(WorkerView)})
    assert v == built and hash(v) == hash(built) and repr(v) == repr(built) and v.routable
    assert new_view("http://w9") == WorkerView("http://w9")
    with pytest.raises(TypeError):
        new_view("http://w9", no_such_field=1)
    assert table.rows[0] == tuple(data[:, 0].tolist())  # the Python floats are the array's
    assert all(type(x) is float for x in table.rows[0])
    w0.first_token(f, 0.5)
    pool.get("http://w1").healthy = False
    data = table.refresh()
    assert [tuple(data[:, i].tolist()) for i in range(5)] == table.rows
    assert data[FIELDS.index("outstanding"), 0] == 1 and data[FIELDS.index("decode_streams"), 0] == 1
    assert data[FIELDS.index("deadline"), 0] == np.inf and data[FIELDS.index("routable"), 1] == 0
    pool.remove("http://w2")  # nothing outstanding: reaped, the pool's order changes
    table.refresh()
    assert table.urls == ["http://w0", "http://w1", "http://w3", "http://w4"]


def test_holder_index_lists_exactly_the_workers_holding_a_first_chunk():
    rng = random.Random(1)
    cfg = PrefixIndexConfig(chunk_tokens=2, max_entries_per_worker=16, min_entries_per_worker=2, ttl_s=5.0)
    ix, ref = HolderIndex(cfg), PrefixIndex(cfg)
    firsts = set()
    now = 0.0
    for _ in range(3000):
        w = f"w{rng.randrange(6)}"
        op = rng.random()
        if op < 0.7:
            hashes = chunk_hashes([rng.randrange(8) for _ in range(rng.randint(2, 12))], 2)
            for x in (ix, ref):
                x.insert(w, hashes, now)
            firsts.add(hashes[0])
        elif op < 0.8:
            for x in (ix, ref):
                x.correct(w, 4, rng.randrange(4))
        elif op < 0.85:
            for x in (ix, ref):
                x.forget(w)
        elif op < 0.9:
            for x in (ix, ref):
                x.expire(now)
        else:
            now += rng.random()
        for h in firsts:
            assert ix.holders(h) == {u for u, e in ref._entries.items() if h in e}
    assert ix._entries == ref._entries


@pytest.mark.parametrize("time_goes_back", [False, True])
def test_holder_index_bisected_match_is_the_linear_walk(time_goes_back):
    """HolderIndex.match (bisection over the chain) answers as PrefixIndex.match (the linear walk) on random
    sequences of inserts of prompts sharing prefixes, LRU evictions, corrections, forgets, expiries and TTL
    boundaries; with a clock that once goes back the index falls back to the walk, and still answers the same."""
    rng = random.Random(16 + time_goes_back)
    cfg = PrefixIndexConfig(chunk_tokens=2, max_entries_per_worker=24, min_entries_per_worker=2, ttl_s=3.0)
    ix, ref = HolderIndex(cfg), PrefixIndex(cfg)
    families = [[rng.randrange(50) for _ in range(rng.randint(2, 16))] for _ in range(5)]
    prompts = [chunk_hashes(f + [rng.randrange(50) for _ in range(rng.randint(0, 10))], 2)
               for f in families for _ in range(4)]
    now, partial, went_back = 0.0, 0, False
    for step in range(4000):
        w = f"w{rng.randrange(4)}"
        op = rng.random()
        if op < 0.5:
            hashes = rng.choice(prompts)
            for x in (ix, ref):
                x.insert(w, hashes, now)
        elif op < 0.58:
            reported = rng.randrange(4)
            for x in (ix, ref):
                x.correct(w, 4, reported)
        elif op < 0.6:
            for x in (ix, ref):
                x.forget(w)
        elif op < 0.65:
            for x in (ix, ref):
                x.expire(now)
        elif time_goes_back and step == 2000:
            now -= 2.0
            went_back = True
        else:
            now += rng.random() * 0.5
        for hashes in rng.sample(prompts, 6):
            for u in ("w0", "w1", "w2", "w3"):
                at = now + rng.choice([0.0, 1.0, 3.0])  # (a match may look later than the last insert: TTL edges)
                got = ix.match(u, hashes, at)
                assert got == ref.match(u, hashes, at), (step, u)
                partial += 0 < got < len(hashes)
    assert partial > 1000  # prefixes matched part of the way (else bisection was not put to the test)
    assert ix.bisect is not went_back  # the bisection was used throughout, or given up after time went back


def test_chunk_hashes_of_text_are_the_chained_blake2b_of_each_chunk():
    """chunk_hashes' one-encode path for ASCII text hashes the same bytes as encoding chunk by chunk (the
    reference written out here), and non-ASCII text still chunks by characters."""
    import hashlib

    def reference(text, chunk):
        out, parent = [], b""
        for start in range(0, len(text) - len(text) % chunk, chunk):
            parent = hashlib.blake2b(parent + text[start:start + chunk].encode("utf-8", "surrogatepass"),
                                     digest_size=12).digest()
            out.append(parent)
        return tuple(out)

    rng = random.Random(3)
    for _ in range(200):
        alphabet = "abc xyz{}\"\n" if rng.random() < 0.5 else "abcé€😀 "
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        chunk = rng.choice([1, 7, 64])
        assert chunk_hashes(text, chunk) == reference(text, chunk)
        assert chunk_hashes(text, chunk) == reference(text, chunk)  # again: its links now remembered


def test_chunk_hashes_remembered_links_are_the_hashes():
    """chunk_hashes looks each link (parent hash, chunk) up before hashing it: prompts sharing a prefix, token
    ids and text, a full table of links (cleared) -- every chain equals blake2b chained by hand."""
    import hashlib
    import struct

    from tokenmill.router import prefix_index

    def reference(chunks):
        out, parent = [], b""
        for c in chunks:
            parent = hashlib.blake2b(parent + c, digest_size=12).digest()
            out.append(parent)
        return tuple(out)

    rng = random.Random(5)
    shared = [rng.randrange(-5, 50000) for _ in range(40)]
    for max_links in (1 << 15, 7):
        prefix_index._LINKS.clear()
        prefix_index.MAX_LINKS = max_links
        try:
            for _ in range(100):
                ids = shared[:rng.randint(0, 40)] + [rng.randrange(50000) for _ in range(rng.randint(0, 20))]
                full = len(ids) - len(ids) % 4
                want = reference([struct.pack("<4i", *ids[k:k + 4]) for k in range(0, full, 4)])
                assert chunk_hashes(ids, 4) == want
                text = "shared system prompt " * rng.randint(0, 5) + str(rng.random())
                full = len(text) - len(text) % 8
                assert chunk_hashes(text, 8) == reference([text[k:k + 8].encode() for k in range(0, full, 8)])
            assert len(prefix_index._LINKS) <= max(max_links, 20)
        finally:
            prefix_index.MAX_LINKS = 1 << 15


def test_a_large_idle_pool_reads_each_worker_once():
    """1,000 workers: after the first decision, a decision re-reads only the workers that changed."""
    r = Router(RouterConfig(), clock=Clock())
    for i in range(1000):
        r.add_worker(WorkerSpec(f"http://w{i}")).healthy = True
    cls = r.classes["interactive"]
    for k in range(20):
        ctx = r.new_request(PromptKey(chunk_hashes(list(range(k, k + 64)), 16), True, 64, 16), cls, 16)
        adm, snap, chunks = r.decide(ctx)
        assert adm.action == "admit" and len(snap.workers) <= 2
        r._dispatch(ctx, adm, snap, chunks)
    assert r.table.reads <= 1000 + 20 and r.decisions == {"table": 20, "full": 0}
