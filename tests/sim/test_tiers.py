"""KV tiers in the simulator (sim/tiers.py): the engine's KVTiers decides, on the virtual clock."""

from __future__ import annotations

import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.engine.tiers.manager import KVTiers
from tests.sim.test_sim import profile, sim

# multi-turn conversations: each turn resends the conversation; a 4 MiB pool (~80 blocks of the demo model)
# cannot keep the conversations waiting on their users' think time, a 64 MiB host tier can
CHAT = "chat:turns_min=4,turns_max=6,prompt=200,output=32,system=0,think_s=2"
POOL = 4 << 20
HOST = 64 << 20
COEF = [0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4]


def run(tmp_path, load=None, wl=CHAT, **kw):
    hw = profile(tmp_path, COEF)
    load = load or LoadConfig("rate", rate=4, num_requests=150)
    kw.setdefault("kv_cache_bytes", POOL)
    result, sj = sim(tmp_path, hw, wl, load, **kw)
    return result.runs[0], sj["levels"][0]


def test_a_host_tier_brings_back_evicted_prefixes(tmp_path):
    """More cached prompt tokens and a lower TTFT with the host tier; everything completes (parked requests
    are woken when their loads end, also on an idle worker: a few closed-loop streams with think time)."""
    for load in (LoadConfig("rate", rate=4, num_requests=150), LoadConfig("concurrency", concurrency=4,
                                                                            num_requests=60)):
        off, lv_off = run(tmp_path, load)
        on, lv_on = run(tmp_path, load, kv_host_bytes=HOST)
        assert all(r.ok or r.http_status == 400 for r in on.records)  # 400: a conversation past max_model_len
        assert sum(r.ok for r in on.records) == sum(r.ok for r in off.records) > 0
        assert "kv_tiers" not in lv_off
        t = lv_on["kv_tiers"]["tiers"]["host"]
        assert t["loaded_blocks"] > 0 and t["stores"] > 0 and t["bytes_read"] > 0
        assert on.summary.prefix_cache_hit_rate > off.summary.prefix_cache_hit_rate + 0.2
        assert on.summary.ttft_ms.mean < off.summary.ttft_ms.mean
        assert lv_on["kv_tiers"]["engine"]["parked"] > 0


def test_the_engines_load_decision_runs(tmp_path, monkeypatch):
    """KVTiers._worth_loading patched to refuse every tier: nothing is loaded, the hit rate falls back."""
    real, lv = run(tmp_path, kv_host_bytes=HOST)
    monkeypatch.setattr(KVTiers, "_worth_loading", lambda self, store: False)
    never, lv_never = run(tmp_path, kv_host_bytes=HOST)
    assert lv["kv_tiers"]["tiers"]["host"]["loaded_blocks"] > 0
    assert lv_never["kv_tiers"]["tiers"]["host"]["loaded_blocks"] == 0
    assert lv_never["kv_tiers"]["tiers"]["host"]["stores"] > 0  # write-through still runs
    assert never.summary.prefix_cache_hit_rate < real.summary.prefix_cache_hit_rate - 0.2


def test_a_tier_slower_than_recompute_is_skipped(tmp_path):
    """A host tier read at 1 MB/s (~50 ms per block against ~0.3 ms to recompute one) is measured on the
    first reads, then skipped (re-probed now and then); with the default speed it never is."""
    _, fast = run(tmp_path, kv_host_bytes=HOST)
    _, slow = run(tmp_path, kv_host_bytes=HOST, tier_io={"host_read_bw": 1e6})
    f, s = fast["kv_tiers"]["tiers"]["host"], slow["kv_tiers"]["tiers"]["host"]
    assert f["skipped_slower"] == 0
    assert s["skipped_slower"] > 0
    assert s["loaded_blocks"] < f["loaded_blocks"] / 4
    assert slow["kv_tiers"]["per_worker"][0]["host"]["load_seconds_per_block"] > 0.01


def test_disk_hits_are_promoted_to_the_host_tier(tmp_path):
    """A host tier too small for the working set, a disk tier that holds it: blocks are found on the disk
    and written back to the host tier (the engine's promotion)."""
    run_, lv = run(tmp_path, kv_host_bytes=2 << 20, kv_disk_bytes=HOST)
    t = lv["kv_tiers"]["tiers"]
    assert t["disk"]["loaded_blocks"] > 0 and t["disk"]["promoted"] == t["disk"]["loaded_blocks"]
    assert t["host"]["evictions"] > 0 and t["host"]["promoted"] == 0
    assert all(r.ok or r.http_status == 400 for r in run_.records)


def test_a_shared_host_tier_serves_sessions_that_move(tmp_path):
    """Round-robin over 2 workers moves every conversation between them each turn: a host tier shared by
    both finds the other worker's blocks, two private ones find far fewer."""
    private, _ = run(tmp_path, workers=2, kv_host_bytes=HOST)
    shared, lv = run(tmp_path, workers=2, kv_host_bytes=HOST, kv_host_shared=True)
    assert lv["kv_tiers"]["host_shared"]
    assert shared.summary.prefix_cache_hit_rate > private.summary.prefix_cache_hit_rate + 0.1


def test_tiers_off_change_nothing(tmp_path, monkeypatch):
    """Without tier capacity the worker never builds tiers (their constructor patched to fail), the records
    are those of a config without any tier field set, and fast-forward still equals stepping."""
    load = LoadConfig("rate", rate=4, num_requests=80)
    base, lv_base = run(tmp_path, load)
    monkeypatch.setattr("tokenmill.sim.tiers.WorkerTiers.__init__", lambda *a, **k: pytest.fail("tiers built"))
    zero, lv_zero = run(tmp_path, load, kv_host_bytes=0, kv_disk_bytes=0, tier_io={"host_read_bw": 1.0})
    step, lv_step = run(tmp_path, load, fast_forward=False)
    recs = [r.to_json() for r in base.records]
    assert recs == [r.to_json() for r in zero.records] == [r.to_json() for r in step.records]
    for k in ("steps", "output_tokens", "mean_worker_busy", "simulated_s"):
        assert lv_base[k] == lv_zero[k] == lv_step[k]
    assert lv_base["fast_forward"]["runs"] > 0 and lv_step["fast_forward"]["runs"] == 0


def test_tiers_are_deterministic(tmp_path):
    a, la = run(tmp_path, kv_host_bytes=2 << 20, kv_disk_bytes=HOST, workers=2, kv_host_shared=True)
    b, lb = run(tmp_path, kv_host_bytes=2 << 20, kv_disk_bytes=HOST, workers=2, kv_host_shared=True)
    assert [r.to_json() for r in a.records] == [r.to_json() for r in b.records]
    assert la["kv_tiers"] == lb["kv_tiers"]


def test_cli_tier_flags(tmp_path):
    from tokenmill.cli import main
    import json

    hw = profile(tmp_path, COEF)
    out = tmp_path / "cli"
    rc = main(["sim", "--model", "demo", "--hardware", hw, "--out", str(out), "--workload", CHAT,
               "--rate", "4", "--num-requests", "40", "--kv-cache-bytes", "4MiB", "--kv-host-bytes", "64MiB",
               "--kv-disk-bytes", "1GiB", "--kv-disk-read-bw", "2", "--kv-link-bw", "20", "--no-plots"])
    assert rc == 0
    sim_json = json.loads((out / "result.json").read_text())["sim"]
    tiers = sim_json["worker"]["tiers"]
    assert tiers["kv_host_bytes"] == 64 << 20 and tiers["kv_disk_bytes"] == 1 << 30
    assert tiers["io"]["disk_read_bw"] == 2e9 and tiers["io"]["link_bw"] == 20e9
    assert set(sim_json["levels"][0]["kv_tiers"]["tiers"]) == {"host", "disk"}


def test_a_load_wakes_an_idle_worker(tmp_path, monkeypatch):
    """A few closed-loop streams with think time: the worker is often idle with only a parked request. The
    load's end wakes it (as LLMEngine's wait on the read); without that wake-up the request would wait for
    the next arrival, seconds later."""
    load = LoadConfig("concurrency", concurrency=4, num_requests=60)
    woken, lv = run(tmp_path, load, kv_host_bytes=HOST)
    monkeypatch.setattr("tokenmill.sim.tiers.WorkerTiers.idle", lambda self, wake: None)
    asleep, _ = run(tmp_path, load, kv_host_bytes=HOST)
    assert lv["kv_tiers"]["tiers"]["host"]["loaded_blocks"] > 0
    assert asleep.summary.ttft_ms.max > 5 * woken.summary.ttft_ms.max
