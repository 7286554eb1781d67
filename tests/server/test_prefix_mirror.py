"""The front-end's PrefixMirror, fed the engine core's KV events, equals the engine's own prefix cache
(the reference: BlockPool.cached and KVCacheManager.cached_prefix_tokens) after every step, through
stores, evictions (a small KV cache) and a reset."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenmill.engine.llm_engine")

from tokenmill.engine.config import EngineConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.sampling_params import SamplingParams  # noqa: E402
from tokenmill.server.engine_core import AddCmd, EngineCore  # noqa: E402
from tokenmill.server.prefix_mirror import PrefixMirror  # noqa: E402


def test_mirror_tracks_the_prefix_cache_through_evictions(tiny_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_bytes=1 << 20, max_model_len=256, block_size=16))
    assert eng.kv.pool.num_blocks < 200  # small enough that the workload below evicts
    core = EngineCore(eng, kv_events=True)
    mirror = PrefixMirror(16)
    rng = random.Random(0)
    systems = [[rng.randrange(1, 500) for _ in range(48)] for _ in range(4)]
    prompts, evicted_before = [], eng.kv.pool.num_evictions
    n = 0
    for round_ in range(12):
        cmds = []
        for _ in range(6):
            p = rng.choice(systems) + [rng.randrange(1, 500) for _ in range(rng.randrange(8, 120))]
            prompts.append(p)
            cmds.append(AddCmd(f"r{n}", p, SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0,
                                                          ignore_eos=True)))
            n += 1
        res = core.run_once(cmds)
        while True:
            mirror.apply(res.kv_events)
            assert mirror.hashes == set(eng.kv.pool.cached)
            for p in rng.sample(prompts, 5):
                assert mirror.cached_prefix_tokens(p) == eng.cached_prefix_tokens(p)
            if not res.busy:
                break
            res = core.run_once([])
    assert eng.kv.pool.num_evictions > evicted_before
    assert any(mirror.cached_prefix_tokens(p) > 0 for p in prompts)
    eng.kv.pool.reset_prefix_cache()
    mirror.apply(core.run_once([]).kv_events)
    assert mirror.hashes == set(eng.kv.pool.cached) == set()
