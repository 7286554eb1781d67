"""KV tier loads run beside the engine's steps (engine/tiers/manager.py): a request whose blocks are being
read is parked while running decodes go on; a load past its deadline is abandoned and the request
recomputes; an abort while parked releases everything; disk hits are promoted to the host tier; the write
queue is bounded. Outputs stay identical to the engine without tiers in every case."""

import threading
import time

from tokenmill import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tests.engine.test_kv_tiers import BS, GREEDY, out, pool_bytes, prompts, same, two_rounds


def tiered(tiny_dir, tmp_path, **kw):
    return LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 24), dtype="float32", kv_host_bytes="8MiB",
               kv_host_dir=str(tmp_path / "h"), **kw)


def gated(store):
    """Make the store's reads wait for `gate` to open; `entered` is set when a read is waiting."""
    gate, entered = threading.Event(), threading.Event()
    real = store.get

    def get(*a, **kw):
        entered.set()
        gate.wait(10)
        return real(*a, **kw)

    store.get = get
    return gate, entered


def run_until_done(engine: LLMEngine, limit_s=30.0):
    outs, t0 = {}, time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - t0 < limit_s, "engine did not finish"
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_decodes_go_on_while_a_load_is_in_flight(tiny_dir, tmp_path):
    ref, _, _ = two_rounds(tiny_dir)
    llm = tiered(tiny_dir, tmp_path)
    for p in prompts():  # round 1 writes every full block to the host tier
        llm.generate([p], GREEDY)
    eng = llm.engine
    eng.tiers.flush()
    gate, entered = gated(eng.tiers.stores[0])
    ps = prompts()
    long_decode = GREEDY.__class__(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("busy", [7] * 20, long_decode)  # not in any tier: computes and decodes
    eng.step()
    eng.add_request("p0", ps[0], GREEDY)  # its blocks are in the host tier (the pool lost them)
    decoded_while_parked = 0
    for _ in range(200):
        before = len(eng.scheduler.requests["busy"].output_token_ids)
        eng.step()
        if "p0" in eng.scheduler.parked:
            decoded_while_parked += len(eng.scheduler.requests["busy"].output_token_ids) - before
        if entered.is_set() and decoded_while_parked >= 5:
            break
    assert entered.is_set() and "p0" in eng.scheduler.parked and decoded_while_parked >= 5
    gate.set()
    outs = run_until_done(eng)
    r = outs["p0"]
    assert r.num_cached_tokens == (len(ps[0]) - 1) // BS * BS  # the load landed and the prefix was reused
    assert eng.stats().kv_tiers_engine["load_timeouts"] == 0
    assert eng.kv.pool.num_used == 0  # pins released


def test_a_load_past_its_deadline_is_abandoned_and_the_request_recomputes(tiny_dir, tmp_path):
    ref, _, _ = two_rounds(tiny_dir)
    llm = tiered(tiny_dir, tmp_path, kv_load_timeout_s=0.2)
    outs = [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    llm.engine.tiers.flush()
    gate, entered = gated(llm.engine.tiers.stores[0])  # a hung disk: the read returns only when told
    t0 = time.monotonic()
    r = llm.generate([prompts()[0]], GREEDY)[0]
    took = time.monotonic() - t0
    outs.append(out(r))
    assert same(outs, ref[:6]) and entered.is_set()
    assert r.num_cached_tokens < (len(prompts()[0]) - 1) // BS * BS  # recomputed, not loaded
    assert 0.2 <= took < 5.0
    st = llm.engine.stats()
    assert st.kv_tiers_engine["load_timeouts"] == 1 and llm.engine.kv.pool.num_used == 0
    gate.set()  # the hung read ends later: nothing breaks, and its time is learned
    time.sleep(0.1)
    more = [out(llm.generate([p], GREEDY)[0]) for p in prompts()[1:]]
    assert same(outs + more, ref)


def test_abort_while_parked_releases_everything(tiny_dir, tmp_path):
    llm = tiered(tiny_dir, tmp_path)
    for p in prompts():
        llm.generate([p], GREEDY)
    eng = llm.engine
    eng.tiers.flush()
    gate, entered = gated(eng.tiers.stores[0])
    eng.add_request("p0", prompts()[0], GREEDY)
    for _ in range(50):
        eng.step()
        if entered.is_set():
            break
    assert "p0" in eng.scheduler.parked
    eng.abort_request("p0")
    assert not eng.has_unfinished_requests() and not eng.tiers.loading
    gate.set()
    time.sleep(0.05)
    eng.step()  # the abandoned read's result is collected without effect
    assert eng.kv.pool.num_used == 0
    r = llm.generate([prompts()[0]], GREEDY)[0]  # and the engine serves on, from the tier
    assert r.num_cached_tokens == (len(prompts()[0]) - 1) // BS * BS


def test_disk_hits_are_promoted_to_the_host_tier(tiny_dir, tmp_path):
    ref, _, _ = two_rounds(tiny_dir)
    llm = LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 24), dtype="float32",
              kv_host_bytes="8MiB", kv_host_dir=str(tmp_path / "h"), kv_disk_dir=str(tmp_path / "d"),
              kv_disk_bytes="8MiB")
    outs = [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    tiers = llm.engine.tiers
    tiers.flush()
    host, disk = tiers.stores
    host.clear()  # as if the host tier had evicted them (or the host restarted): only the disk has them
    outs += [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    tiers.flush()
    assert same(outs, ref)
    st = tiers.stats()
    assert st["disk"]["hits"] > 0 and st["disk"]["promoted"] == st["disk"]["loaded_blocks"] > 0
    disk.clear()  # now only the host tier has them: what was promoted serves the next round
    hits = st["host"]["hits"]
    outs += [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    assert same(outs, ref + ref[5:]) and tiers.stats()["host"]["hits"] > hits


def test_write_queue_is_bounded(tiny_dir, tmp_path):
    llm = tiered(tiny_dir, tmp_path)
    llm.engine.tiers.max_pending_writes = 0  # a disk that cannot keep up: every store is dropped, counted
    r = llm.generate([prompts()[0]], GREEDY)[0]
    st = llm.engine.stats()
    assert r.outputs[0].token_ids and st.kv_tiers_engine["dropped_stores"] > 0 and st.kv_tiers["host"]["stores"] == 0


def test_a_miss_is_looked_up_and_counted_once_per_request(tiny_dir, tmp_path):
    """A request whose blocks no tier has is looked up once, not at every step it waits."""
    llm = tiered(tiny_dir, tmp_path, max_num_batched_tokens=16)  # a 190-token prompt waits behind 12 chunks
    eng = llm.engine
    eng.add_request("busy", prompts(seed=1)[0], GREEDY)
    eng.step()
    eng.add_request("new", prompts(seed=2)[0], GREEDY)
    run_until_done(eng)
    assert eng.stats().kv_tiers["host"]["misses"] == 2  # one lookup each
