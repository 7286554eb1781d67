"""Logits and greedy tokens against HF transformers (the independent reference), every architecture."""

import pytest
import torch

from tests.conftest import ARCH_PRESETS
from tests.parity import Harness, hf_logits, hf_model, make_req, rel_err
from tokenmill import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_logits_prefill_decode_chunked_prefix_hit(model_dir, preset):
    path = model_dir(preset)
    hf = hf_model(path)
    h = Harness(path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (120,), generator=g).tolist()
    ref = hf_logits(hf, ids)

    # prefill of the first 100 tokens in one step, then 3 decode steps
    a = make_req("a", ids)
    (la,) = h.run([(a, 100)])
    assert rel_err(la, ref[:100]) < 1e-4
    for pos in range(100, 103):
        (ld,) = h.run([(a, 1)])
        assert rel_err(ld, ref[pos:pos + 1]) < 1e-4

    # chunked prefill: odd chunk sizes that straddle block boundaries, batched with a decode of `a`
    b = make_req("b", ids[:90] + [5, 6, 7])
    ref_b = hf_logits(hf, b.all_token_ids)
    got = []
    for chunk in (7, 30, 41, 15):
        lb, ld = h.run([(b, chunk), (a, 1)])
        got.append(lb)
    assert rel_err(torch.cat(got), ref_b) < 1e-4

    # prefix-cache hit: a request that shares a's first 64 tokens reuses a's blocks (no recompute)
    c = make_req("c", ids[:70] + [11, 12, 13, 14])
    blocks, n_cached = h.kv.get_computed_blocks(c)
    assert n_cached == 64 and [bl.block_id for bl in blocks] == h.kv.block_ids(a)[:4]
    assert h.kv.allocate_slots(c, n_cached, 0, blocks)
    c.num_computed_tokens = n_cached
    (lc,) = h.run([(c, c.num_tokens - n_cached)])
    ref_c = hf_logits(hf, c.all_token_ids)
    assert rel_err(lc, ref_c[n_cached:]) < 1e-4


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_greedy_matches_hf_generate_batched_staggered_shared_prefix(model_dir, preset):
    path = model_dir(preset)
    hf = hf_model(path)
    llm = LLM(str(path), kv_cache_bytes="32MiB", max_num_batched_tokens=48, dtype="float32")
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, 4096, (40,), generator=g).tolist()
    prompts = [system + torch.randint(1, 4096, (n,), generator=g).tolist() for n in (3, 25, 9, 60)]
    prompts.append(torch.randint(1, 4096, (7,), generator=g).tolist())
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    outs = {}
    pending = list(enumerate(prompts))
    step = 0
    # requests arrive at different steps: one more every second step
    while pending or eng.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            eng.add_request(str(i), p, params)
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id)] = (o.output_token_ids, o.num_cached_tokens)
        step += 1
    assert sum(c for _, c in outs.values()) >= 32  # later requests hit the shared system prompt
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=36, min_new_tokens=36, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert outs[i][0] == ref, f"request {i}"
