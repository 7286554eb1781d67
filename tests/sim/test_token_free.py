"""`tokenmill sim --token-free`: Mooncake prompts as named blocks (engine/kv/named_tokens.py) through the real
scheduler, KV manager and router give the same records as the trace's synthesized token ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.cli import CLIError
from tokenmill.engine.kv.hashing import block_hashes
from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.kv.named_tokens import NAMED, TAIL, NamedSpan, NamedTokens
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.router.config import RouterConfig
from tokenmill.router.prefix_index import chunk_hashes, named_chunk_hashes
from tokenmill.sim.simulation import SimConfig, run_simulation


def _trace(tmp_path: Path, rows: int = 60, seed: int = 0, burst_ms: int = 40) -> Path:
    """A Mooncake trace with shared prefixes of 1-3 blocks (8 of them), unique rests, lengths that end mid-block
    and on a block boundary, and outputs long enough to fill the prompt's last block (mixed blocks)."""
    rng = np.random.default_rng(seed)
    prefixes = [[100 * g + j for j in range(1 + g % 3)] for g in range(8)]
    nxt, lines = 10_000, []
    for i in range(rows):
        blocks = int(rng.integers(1, 6))
        length = 512 * blocks - (0 if i % 5 == 0 else int(rng.integers(1, 511)))
        ids = list(prefixes[int(rng.integers(8))][:blocks]) if rng.random() < 0.6 else []
        ids += list(range(nxt, nxt + blocks - len(ids)))
        nxt += blocks
        out = int(rng.choice([8, 40, 300, 700]))
        lines.append(json.dumps({"timestamp": burst_ms * i, "input_length": length, "output_length": out,
                                 "hash_ids": ids}))
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path, trace, token_free, workers=3, policy="prefix-load", **kw):
    router = RouterConfig(policy=policy)
    cfg = SimConfig(model="llama-3.1-8b", hardware="h100", out=tmp_path / "out", workers=workers, router=router,
                    workloads=(f"trace:{trace}",), load=LoadConfig("trace"), plots=False, token_free=token_free,
                    **kw)
    res, s = run_simulation(cfg)
    recs = [r.to_json() for r in res.runs[0].records]
    lvl = {k: s["levels"][0][k] for k in ("events", "steps", "simulated_s", "prompt_tokens", "output_tokens",
                                          "fast_forward")}
    return recs, lvl, s


def _without_digest(recs):
    return [{k: v for k, v in r.items() if k != "digest"} for r in recs]


@pytest.mark.parametrize("case", ["default", "small-kv", "small-kv-stepping", "round-robin-no-caching"])
def test_token_free_gives_the_token_id_schedule(tmp_path, monkeypatch, case):
    """Same records (every token's time, cached tokens, statuses) and the same engine steps and events as the
    token-id mode, with prefix hits, evictions, preemptions (recompute looks up blocks holding output tokens)
    and blocks mixing a prompt's tail with outputs."""
    trace = _trace(tmp_path)
    kw = {}
    if case.startswith("small-kv"):  # 24 blocks of 512 tokens per worker: the arrivals preempt and evict
        kw = {"kv_cache_bytes": 24 * 512 * 131072}
    if case == "small-kv-stepping":
        kw["fast_forward"] = False
    policy = "prefix-load"
    if case == "round-robin-no-caching":
        kw, policy = {"enable_prefix_caching": False}, "round-robin"
    from tokenmill.engine import scheduler as sched_mod

    preempted = []
    orig = sched_mod.Scheduler._preempt
    monkeypatch.setattr(sched_mod.Scheduler, "_preempt",
                        lambda self, req, out: (preempted.append(req.request_id), orig(self, req, out))[1])
    ids, lvl_ids, _ = _run(tmp_path, trace, False, policy=policy, **kw)
    n_preempted = len(preempted)
    named, lvl_named, s = _run(tmp_path, trace, True, policy=policy, **kw)
    assert s["prompts"].startswith("token-free")
    assert _without_digest(named) == _without_digest(ids)
    assert lvl_named == lvl_ids
    assert len(preempted) == 2 * n_preempted
    assert all(r["status"] == "ok" for r in ids)
    hit = sum(r["cached_tokens"] or 0 for r in ids)
    if case == "round-robin-no-caching":
        assert hit == 0
    else:
        assert hit > 0  # the shared prefixes are found
    if case.startswith("small-kv"):
        assert n_preempted > 0
    # the digests name the plan in each mode: different values, equal for equal prompts within a mode
    assert all(a["digest"] != b["digest"] for a, b in zip(ids, named))


def test_named_blocks_are_equal_exactly_where_token_blocks_are(tmp_path):
    """Per pair of the trace's prompts and per block: the KV block hashes (and the router's chunk hashes) of the
    named blocks are equal exactly where those of the synthesized token ids are."""
    from tokenmill.bench.tokenizer import approximate_vocab
    from tokenmill.bench.workloads import make_workload

    trace = make_workload(f"trace:{_trace(tmp_path)}", approximate_vocab(), 0)
    rows = trace.rows
    tok_kv, tok_chunks, named_kv, named_chunks = [], [], [], []
    for i, row in enumerate(rows):
        arr = trace.session(i).turns[0].flat_tokens()
        assert len(arr) == row.input_length
        tok_kv.append(block_hashes(arr.tolist(), 512))
        tok_chunks.append(chunk_hashes(arr, 512))
        nt = NamedTokens(row.hash_ids, row.input_length, 512)
        named_kv.append(nt.block_hashes(row.input_length // 512))
        named_chunks.append(named_chunk_hashes(row.hash_ids, row.input_length, 512, 512))
    equal_pairs = 0
    for a in range(len(rows)):
        assert len(named_kv[a]) == len(tok_kv[a]) and len(named_chunks[a]) == len(tok_chunks[a])
        for b in range(a + 1, len(rows)):
            for x, y, u, v in zip(tok_kv[a], tok_kv[b], named_kv[a], named_kv[b]):
                assert (x == y) == (u == v)
                equal_pairs += x == y
            for x, y, u, v in zip(tok_chunks[a], tok_chunks[b], named_chunks[a], named_chunks[b]):
                assert (x == y) == (u == v)
    assert equal_pairs > 0


def test_named_tokens_sequence():
    t = NamedTokens((7, 8, 9), 1100, 512)
    assert len(t) == 1100
    with pytest.raises(TypeError):
        list(t)
    with pytest.raises(ValueError, match="block names"):
        NamedTokens((7, 8), 1100, 512)
    s = t[100:700]
    assert isinstance(s, NamedSpan) and len(s) == 600
    assert t.block(0) == ((NAMED, 7),) and t.block(1) == ((NAMED, 8),)
    with pytest.raises(IndexError):
        t.block(2)  # 76 tokens of block 2: not full
    u = t.copy()
    u.extend([1] * 436)
    assert len(t) == 1100 and len(u) == 1536
    assert u.block(2) == ((TAIL, 9, 76), *([1] * 436))
    u.extend([5] * 512)
    assert u.block(3) == (5,) * 512 and u[1536:1540] == [5] * 4 and u[-1] == 5
    with pytest.raises(TypeError):
        u[3]
    # block hashes: the named blocks chained, the rest from their content; equal prefixes, equal hashes
    hu = u.block_hashes(4)
    assert hu[:2] == t.block_hashes(2) and len(set(hu)) == 4
    assert NamedTokens((7, 8, 4), 1100, 512).block_hashes(2) == hu[:2]
    assert NamedTokens((8, 7, 9), 1100, 512).block_hashes(2)[1] != hu[1]  # a name after another prefix


def test_the_real_kv_manager_and_scheduler_take_named_prompts():
    """Prefix hits between named prompts, and the output tokens of a block mixing a prompt's tail with outputs
    registered and found again (a preempted request's recompute)."""
    kv = KVCacheManager(num_blocks=16, block_size=512)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096), kv)

    def req(rid, names, n, out=600):
        p = NamedTokens(names, n, 512)
        return Request(rid, p, SamplingParams(max_tokens=out), all_token_ids=p.copy())

    a = req("a", (1, 2, 3), 1200)
    sched.add(a)
    o = sched.schedule()
    assert [len(q.token_ids) for q in o.seqs] == [1200] and o.seqs[0].num_logits == 1
    for _ in range(400):  # decode: the tail block (176 prompt tokens) fills at 336 outputs and is registered
        a.append_output(1)
        sched.schedule()
    assert a.num_registered_blocks == 3
    assert kv.cached_prefix_tokens(NamedTokens((1, 2, 5), 1200, 512)) == 1024
    assert kv.cached_prefix_tokens(NamedTokens((1, 9, 3), 1200, 512)) == 512
    b = req("b", (1, 2, 3, 4), 1900)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 1024  # block 2 of b is a full named block: a's block 2 holds a tail + outputs
    # a recompute of a (preempted) finds its own tail + output block
    hashes_before = list(a.block_hashes)
    sched._preempt(a, SchedulerOutput())
    sched.finish(b, RequestStatus.FINISHED_LENGTH)
    computed, n = kv.get_computed_blocks(a)
    assert n == 1536 and a.block_hashes[:3] == hashes_before[:3]


def test_token_free_refuses_what_it_cannot_name(tmp_path):
    trace = _trace(tmp_path, rows=4)
    with pytest.raises(CLIError, match="Mooncake trace"):
        run_simulation(SimConfig(model="llama-3.1-8b", hardware="h100", out=tmp_path / "o", workloads=("chat",),
                                 load=LoadConfig("rate", rate=1, num_requests=2), plots=False, token_free=True))
    with pytest.raises(CLIError, match="512-token blocks"):
        _run(tmp_path, trace, True, block_size=16)
    azure = tmp_path / "az.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n"
                     "2023-11-16 18:15:47.6805900,200,10\n")
    with pytest.raises(CLIError, match="hash_ids"):
        _run(tmp_path, azure, True)
