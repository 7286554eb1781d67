"""KV tiers (host /dev/shm-style store, disk store): keys, integrity, capacity, sharing, restart, and greedy
outputs identical to the same engine without tiers (whose outputs the HF parity tests tie to transformers)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.tiers import store as store_mod
from tokenmill.engine.tiers.keys import chain_key, chain_keys, model_fingerprint
from tokenmill.engine.tiers.store import HEADER, FileStore, decode_entry, encode_entry
from tokenmill.errors import TokenmillError
from tokenmill.model.config import ModelConfig

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


def out(r):
    """Greedy tokens and their logprobs: loaded KV must give the logits of recomputed KV, not just the argmax."""
    return r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]


def same(a, b, tol=1e-5):
    """Token for token identical, logprobs equal up to fp32 reassociation (chunk sizes differ between runs)."""
    return len(a) == len(b) and all(ta == tb and max(abs(x - y) for x, y in zip(la, lb)) < tol
                                    for (ta, la), (tb, lb) in zip(a, b))


# -- keys ---------------------------------------------------------------------------------------
def test_fingerprint_separates_models_and_precisions():
    base = dict(weights=b"w" * 32, architecture="LlamaForCausalLM", dtype="float32", kv_dtype="float32",
                block_size=16, quantization="none", layout=[["float32", 1, [2, 4, 16, 32]]])
    fp = model_fingerprint(**base)
    for k, v in [("weights", b"x" * 32), ("dtype", "bfloat16"), ("kv_dtype", "bfloat16"), ("block_size", 32),
                 ("quantization", "int8"), ("architecture", "Qwen2ForCausalLM"),
                 ("layout", [["int8", 1, [2, 4, 16, 32]]])]:
        assert model_fingerprint(**{**base, k: v}) != fp, k
    toks = list(range(48))
    ka, kb = chain_keys(fp, toks, 16), chain_keys(model_fingerprint(**{**base, "dtype": "bfloat16"}), toks, 16)
    assert len(ka) == 3 and not set(ka) & set(kb)
    assert ka[1] == chain_key(ka[0], toks[16:32])  # chained: block 1 depends on block 0
    assert chain_keys(fp, [9] + toks[1:], 16)[2] != ka[2]  # a change in block 0 changes every later key
    assert chain_keys(fp, toks + [1, 2], 16, start=ka[:1]) == ka  # incremental == full, partial block unkeyed


def test_keys_stable_across_processes():
    """No salted Python hash(): another interpreter with another PYTHONHASHSEED computes the same keys."""
    code = ("from tokenmill.engine.tiers.keys import chain_keys;"
            "print(chain_keys(bytes(16), list(range(40)), 8)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {chain_keys(bytes(16), list(range(40)), 8)[-1].hex()}


# -- the store ----------------------------------------------------------------------------------
def payload_for(key: bytes, n: int = 1000) -> bytes:
    return (key * (n // len(key) + 1))[:n]


def key_of(i: int) -> bytes:
    return chain_key(bytes(16), [i])


TOKS = list(range(BS))


def test_entry_roundtrip_and_every_mismatch_is_none():
    k = key_of(1)
    e = encode_entry(k, TOKS, payload_for(k))
    assert decode_entry(e, k, TOKS, 1000) == payload_for(k)
    assert decode_entry(e, key_of(2), TOKS, 1000) is None  # foreign key
    assert decode_entry(e, k, TOKS[::-1], 1000) is None  # other tokens
    assert decode_entry(e[:-1], k, TOKS, 1000) is None  # truncated
    assert decode_entry(e + b"\0", k, TOKS, 1000) is None  # trailing bytes
    for pos in (0, 10, HEADER.size + 3, len(e) - 1):  # flipped byte anywhere: magic, key, tokens, payload
        bad = bytearray(e)
        bad[pos] ^= 0x40
        assert decode_entry(bytes(bad), k, TOKS, 1000) is None, pos


def test_store_faults_are_misses(tmp_path):
    s = FileStore("disk", str(tmp_path), 1 << 20)
    keys = [key_of(i) for i in range(5)]
    for k in keys:
        assert s.put(k, TOKS, payload_for(k))
    assert not s.put(keys[0], TOKS, payload_for(keys[0]))  # already there
    files = {k: s._file(k) for k in keys}
    data = open(files[keys[0]], "rb").read()
    bad = bytearray(data)
    bad[-5] ^= 1
    open(files[keys[0]], "wb").write(bytes(bad))  # flipped byte
    open(files[keys[1]], "wb").write(data[:50])  # truncated
    os.unlink(files[keys[2]])  # deleted
    open(files[keys[3]], "wb").write(open(files[keys[4]], "rb").read())  # another block's entry under this name
    for k in keys[:4]:
        assert s.get(k, TOKS, 1000) is None
    assert s.get(keys[4], TOKS, 1000) == payload_for(keys[4])
    assert s.stats.corrupt == 3 and s.stats.misses == 4 and s.stats.hits == 1
    assert not os.path.exists(files[keys[0]])  # a rejected entry is removed, not read again
    assert s._read_usage() >= s.usage()  # the shared counter may over-count files removed behind its back (safe)


@pytest.mark.parametrize("err", [28, 13, 30])  # ENOSPC (full disk), EACCES (permissions), EROFS (read-only)
def test_store_write_failures_are_dropped_puts(tmp_path, monkeypatch, err):
    s = FileStore("disk", str(tmp_path / "d"), 1 << 20)
    real_open = open

    def full_disk(path, mode="r", *a, **kw):
        if "w" in mode and os.path.basename(str(path)).startswith(".tmp-") and "usage" not in str(path):
            raise OSError(err, os.strerror(err))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(store_mod, "open", full_disk, raising=False)
    assert not s.put(key_of(1), TOKS, payload_for(key_of(1)))
    monkeypatch.undo()
    assert s.stats.errors == 1 and s.usage() == 0 and s._read_usage() == 0
    assert not [n for n in os.listdir(s.path) if n.startswith(".tmp-") and "usage" not in n]  # no temp left
    assert s.put(key_of(2), TOKS, payload_for(key_of(2)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_store_read_only_dir(tmp_path):
    s = FileStore("disk", str(tmp_path / "ro"), 1 << 20)
    assert s.put(key_of(1), TOKS, payload_for(key_of(1)))
    os.chmod(s.path, 0o555)
    try:
        assert not s.put(key_of(2), TOKS, payload_for(key_of(2)))
        assert s.get(key_of(1), TOKS, 1000) == payload_for(key_of(1))
    finally:
        os.chmod(s.path, 0o755)


def test_cap_never_exceeded_lru_and_gone_files(tmp_path):
    entry = len(encode_entry(key_of(0), TOKS, payload_for(key_of(0))))
    s = FileStore("host", str(tmp_path), 10 * entry + entry // 2)
    for i in range(40):
        assert s.put(key_of(i), TOKS, payload_for(key_of(i)))
        assert s.usage() <= s.capacity
        if i == 20:  # another process deletes entries behind our back: eviction must not trip on them
            keep = os.path.basename(s._file(key_of(0)))
            for n in [n for n in os.listdir(s.path) if n.endswith(".kv") and n != keep][:4]:
                os.unlink(os.path.join(s.path, n))
        assert s.get(key_of(0), TOKS, 1000) == payload_for(key_of(0))  # block 0 stays in use
    assert s.contains(key_of(0))  # LRU: the block kept in use survived
    assert s.stats.evictions > 0


def test_restart_finds_entries_cleans_temp_and_recounts(tmp_path):
    entry = len(encode_entry(key_of(0), TOKS, payload_for(key_of(0))))
    s = FileStore("disk", str(tmp_path), 4 * entry)
    for i in range(3):
        s.put(key_of(i), TOKS, payload_for(key_of(i)))
    s.close()
    open(tmp_path / ".tmp-999-1-deadbeef", "wb").write(b"half")  # a crashed writer's temp file
    open(tmp_path / ".usage", "wb").write(b"0")  # a stale counter
    s2 = FileStore("disk", str(tmp_path), 4 * entry)
    assert s2._read_usage() == 3 * entry
    assert not (tmp_path / ".tmp-999-1-deadbeef").exists()
    assert all(s2.get(key_of(i), TOKS, 1000) == payload_for(key_of(i)) for i in range(3))
    s3 = FileStore("disk", str(tmp_path), 2 * entry)  # restarted with a smaller cap: enforced at the next put
    s3.put(key_of(9), TOKS, payload_for(key_of(9)))
    assert s3.usage() <= 2 * entry


def _hammer(path: str, cap: int, seed: int, n: int, bad: list):
    s = FileStore("host", path, cap)
    import random

    r = random.Random(seed)
    for _ in range(n):
        k = key_of(r.randrange(30))
        if r.random() < 0.5:
            s.put(k, TOKS, payload_for(k, 5000))
        else:
            got = s.get(k, TOKS, 5000)
            if got is not None and got != payload_for(k, 5000):
                bad.append(k)
        if s.usage() > cap:
            bad.append("over cap")


def test_concurrent_writers_readers_evictors(tmp_path):
    """Threads (one store each) and a second process on one directory with a small cap: every read is the
    right block or a miss, and the cap holds."""
    entry = len(encode_entry(key_of(0), TOKS, payload_for(key_of(0), 5000)))
    cap = 8 * entry
    code = ("import sys; sys.path.insert(0, %r); from tests.engine.test_kv_tiers import _hammer; bad = [];"
            "_hammer(%r, %d, 99, 300, bad); sys.exit(1 if bad else 0)") % (os.getcwd(), str(tmp_path), cap)
    proc = subprocess.Popen([sys.executable, "-c", code])
    bad: list = []
    threads = [threading.Thread(target=_hammer, args=(str(tmp_path), cap, i, 300, bad)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proc.wait(timeout=120) == 0
    assert not bad
    assert FileStore("host", str(tmp_path), cap).usage() <= cap


# -- the runner's block I/O ---------------------------------------------------------------------
def test_runner_read_write_blocks_roundtrip(tiny_dir):
    eng = LLM(str(tiny_dir), kv_cache_bytes="1MiB", dtype="float32").engine
    r = eng.runner
    for c in r.kv_caches:
        c.normal_()
    data = r.read_blocks([3, 1])
    assert data.dtype == torch.uint8 and tuple(data.shape) == (2, r.block_nbytes)
    r.write_blocks([5, 6], data)
    for c in r.kv_caches:
        assert torch.equal(c[:, 5], c[:, 3]) and torch.equal(c[:, 6], c[:, 1])
    with pytest.raises(ValueError):
        r.write_blocks([5], data)


# -- the engine ---------------------------------------------------------------------------------
def pool_bytes(path, blocks: int) -> int:
    return ModelConfig.from_dir(path).kv_bytes_per_token(4) * BS * blocks


def prompts(seed: int = 0, n: int = 5, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 4096, (40,), generator=g).tolist()
    return [system + torch.randint(1, 4096, (length,), generator=g).tolist() for _ in range(n)]


def two_rounds(path, pool=None, **kw):
    """Each prompt twice, one at a time, through a pool of 24 blocks: round 2 finds little in the pool."""
    llm = LLM(str(path), kv_cache_bytes=pool or pool_bytes(path, 24), dtype="float32", **kw)
    outs, cached = [], []
    for _ in range(2):
        for p in prompts():
            r = llm.generate([p], GREEDY)[0]
            outs.append(out(r))
            cached.append(r.num_cached_tokens)
    return outs, cached, llm.engine


def test_greedy_identical_with_tiers_after_pool_eviction(tiny_dir, tmp_path):
    ref, ref_cached, _ = two_rounds(tiny_dir)
    host, host_cached, eng = two_rounds(tiny_dir, kv_host_bytes="8MiB", kv_host_dir=str(tmp_path / "h"))
    disk, disk_cached, eng_d = two_rounds(tiny_dir, kv_disk_dir=str(tmp_path / "d"), kv_disk_bytes="8MiB")
    assert same(host, ref) and same(disk, ref)
    # round 2: the pool alone holds little of each prompt, the tiers hold all of its full blocks
    assert sum(ref_cached[5:]) < 0.5 * sum(host_cached[5:])
    assert host_cached[5:] == [(len(p) - 1) // BS * BS for p in prompts()] == disk_cached[5:]
    st = eng.stats().kv_tiers["host"]
    assert st["hits"] > 0 and st["corrupt"] == 0 and st["bytes_written"] > 0
    assert eng_d.stats().kv_tiers["disk"]["hits"] == st["hits"]


def test_int8_kv_blocks_travel_with_their_scales(tiny_dir, tmp_path):
    """An int8 KV cache's per-block scales are part of a block's bytes: loaded blocks decode the same."""
    r = LLM(str(tiny_dir), kv_cache_bytes="1MiB", dtype="float32", kv_cache_dtype="int8").engine.runner
    for c in r.kv_caches:
        c.data.random_(-127, 127)
        c.scales.uniform_(0.01, 1.0)
    r.write_blocks([5, 6], r.read_blocks([3, 1]))
    for c in r.kv_caches:
        assert torch.equal(c.data[:, 5], c.data[:, 3]) and torch.equal(c.scales[:, 6], c.scales[:, 1])
    from tokenmill.engine.runner import ModelRunner

    kw = dict(kv_cache_dtype="int8", pool=24 * ModelRunner.kv_bytes_per_block(ModelConfig.from_dir(tiny_dir), BS, torch.int8))
    ref, _, _ = two_rounds(tiny_dir, **kw)
    host, cached, eng = two_rounds(tiny_dir, kv_host_bytes="8MiB", kv_host_dir=str(tmp_path / "h"), **kw)
    # same tokens; logprobs within int8's step: a recomputed block (other chunking, fp32 reassociation)
    # can round a value to the neighbouring int8 level, a loaded one has the stored bytes
    assert same(host, ref, tol=1e-2)
    assert eng.stats().kv_tiers["host"]["hits"] > 0


def test_both_tiers_host_first_then_disk(tiny_dir, tmp_path):
    ref, _, _ = two_rounds(tiny_dir)
    res, cached, eng = two_rounds(tiny_dir, kv_host_bytes=pool_bytes(tiny_dir, 6), kv_host_dir=str(tmp_path / "h"),
                                  kv_disk_dir=str(tmp_path / "d"), kv_disk_bytes="8MiB")
    assert same(res, ref)
    st = eng.stats().kv_tiers
    assert st["host"]["evictions"] > 0 and st["disk"]["hits"] > 0  # the small host tier spilled; disk served


def test_corrupt_disk_blocks_give_identical_outputs(tiny_dir, tmp_path):
    ref, _, _ = two_rounds(tiny_dir)
    d = tmp_path / "d"
    llm = LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 24), dtype="float32",
              kv_disk_dir=str(d), kv_disk_bytes="8MiB")
    outs = [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    files = sorted(f for f in os.listdir(d) if f.endswith(".kv"))
    for i, f in enumerate(files):  # every kind of damage, spread over the files
        p = d / f
        data = bytearray(p.read_bytes())
        if i % 4 == 0:
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
        elif i % 4 == 1:
            p.write_bytes(bytes(data[:len(data) // 3]))
        elif i % 4 == 2:
            p.unlink()
    outs += [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    assert same(outs, ref)
    st = llm.engine.stats().kv_tiers["disk"]
    assert st["corrupt"] > 0 and st["hits"] > 0


def test_foreign_model_and_precision_never_hit(tiny_dir, model_dir, tmp_path):
    h = str(tmp_path / "h")
    LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 64), dtype="float32",
        kv_host_bytes="8MiB", kv_host_dir=h).generate(prompts()[:2], GREEDY)
    assert len([f for f in os.listdir(h) if f.endswith(".kv")]) > 0
    for path, kw in [(model_dir("tiny", seed=1), {}), (tiny_dir, {"kv_cache_dtype": "bfloat16"})]:
        llm = LLM(str(path), kv_cache_bytes=pool_bytes(path, 64), dtype="float32", kv_host_bytes="8MiB",
                  kv_host_dir=h, **kw)
        r = llm.generate(prompts()[:2], GREEDY)
        assert r[0].num_cached_tokens == 0
        assert llm.engine.stats().kv_tiers["host"]["hits"] == 0


def test_two_engines_share_the_host_tier(tiny_dir, tmp_path):
    """A session moved to another worker: engine B (another process) finds what engine A wrote."""
    h = str(tmp_path / "h")
    code = ("import sys, torch; sys.path.insert(0, %r); from tests.engine.test_kv_tiers import prompts, pool_bytes, GREEDY, out; import json;"
            "from tokenmill import LLM; llm = LLM(%r, kv_cache_bytes=pool_bytes(%r, 64), dtype='float32',"
            "kv_host_bytes='8MiB', kv_host_dir=%r); r = llm.generate(prompts()[:1], GREEDY)[0];"
            "print(json.dumps(out(r)))") % (os.getcwd(), str(tiny_dir), str(tiny_dir), h)
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    b = LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 40), dtype="float32", kv_host_bytes="8MiB",
            kv_host_dir=h)  # another pool size: the key depends on the block's layout, not the pool's
    r = b.generate(prompts()[:1], GREEDY)[0]
    assert r.num_cached_tokens == (len(prompts()[0]) - 1) // BS * BS
    assert same([tuple(json.loads(a))], [out(r)])


def test_disk_tier_survives_restart(tiny_dir, tmp_path):
    d = str(tmp_path / "d")
    kw = dict(kv_cache_bytes=pool_bytes(tiny_dir, 64), dtype="float32", kv_disk_dir=d, kv_disk_bytes="8MiB")
    first = LLM(str(tiny_dir), **kw).generate(prompts()[:2], GREEDY)
    again = LLM(str(tiny_dir), **kw).generate(prompts()[:2], GREEDY)  # a new engine: empty pool, same directory
    assert same([out(r) for r in again], [out(r) for r in first])
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // BS * BS for p in prompts()[:2]]


def test_loading_slower_than_recompute_is_skipped(tiny_dir, tmp_path):
    ref, ref_cached, _ = two_rounds(tiny_dir)
    llm = LLM(str(tiny_dir), kv_cache_bytes=pool_bytes(tiny_dir, 24), dtype="float32",
              kv_host_bytes="8MiB", kv_host_dir=str(tmp_path / "h"))
    outs = [out(llm.generate([p], GREEDY)[0]) for p in prompts()]
    store = llm.engine.tiers.stores[0]
    real_get = store.get

    def slow_get(*a, **kw):  # a tier far slower than recomputing a block of this tiny model
        time.sleep(0.05)
        return real_get(*a, **kw)

    store.get = slow_get
    first, *rest = prompts()
    outs.append(out(llm.generate([first], GREEDY)[0]))
    after_first = llm.engine.stats().kv_tiers["host"]["loaded_blocks"]  # one load: its run's reads are measured
    outs += [out(llm.generate([p], GREEDY)[0]) for p in rest]
    assert same(outs, ref)
    st = llm.engine.stats().kv_tiers["host"]
    assert st["skipped_slower"] > 0 and st["loaded_blocks"] == after_first > 0  # no load after the measured one
    assert llm.engine.tiers.load_s_per_block["host"] > llm.engine.tiers.recompute_s_per_token * BS


def test_config_errors_name_the_option():
    for kw, word in [({"kv_disk_dir": "/tmp/x"}, "kv_disk_bytes"), ({"kv_disk_bytes": "1GiB"}, "kv_disk_dir"),
                     ({"kv_host_dir": "/tmp/x"}, "kv_host_bytes"),
                     ({"kv_host_bytes": "1GiB", "enable_prefix_caching": False}, "prefix caching")]:
        with pytest.raises(TokenmillError, match=word):
            EngineConfig(**kw)


def test_tier_series_in_metrics(tiny_dir, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.server.metrics import ServerMetrics

    ref, _, _ = two_rounds(tiny_dir)
    _, _, eng = two_rounds(tiny_dir, kv_host_bytes="8MiB", kv_host_dir=str(tmp_path / "h"))
    text = ServerMetrics("m", 1024, lambda: (eng.stats(), 0)).render().decode()
    got = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    st = eng.stats().kv_tiers["host"]
    assert got[("tokenmill_kv_tier_hits_total", "host")] == st["hits"] > 0
    assert got[("tokenmill_kv_tier_written_bytes_total", "host")] == st["bytes_written"] > 0
    assert got[("tokenmill_kv_tier_capacity_bytes", "host")] == 8 << 20
    # the vLLM prefix-cache counters count every prompt token served without recompute, tiers included
    assert got[("vllm:prefix_cache_hits_total", None)] == eng.stats().prefix_cache_hits_tokens > 0
