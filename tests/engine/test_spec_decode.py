"""Speculative decoding: proposers, lossless verification (greedy token for token, sampled in distribution),
KV rollback and the `auto` policy. The reference is always the same engine with speculation off (or the exact
target distribution computed from it)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.spec.policy import SpecPolicyConfig, SpecSnapshot, StepCost, choose_k, expected_tokens
from tokenmill.engine.spec.proposers import NgramProposer
from tokenmill.engine.spec.verify import verify_greedy, verify_sampled
from tokenmill.errors import TokenmillError
from tokenmill.hardware import capabilities
from tokenmill.testing.prompts import heldout_code_prompts

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n",
    "    def __init__(self",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n",
]


def chi2_pvalue(counts: list[float], probs: list[float]) -> float:
    """Pearson's chi-square test of observed counts against probabilities (cells with expected < 5 merged)."""
    n = sum(counts)
    cells, rest_o, rest_e = [], 0.0, 0.0
    for o, p in zip(counts, probs):
        if n * p >= 5:
            cells.append((o, n * p))
        else:
            rest_o, rest_e = rest_o + o, rest_e + n * p
    if rest_e > 0:
        cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- proposers ---------------------------------------------------------------------------------------
def _ngram_reference(tokens, k, lo, hi):
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):  # latest occurrence followed by a known token
            if tokens[i:i + n] == suffix:
                ext = list(tokens)  # the continuation copies on over its own output (the cycle repeats)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[len(tokens):]
    return []


def test_ngram_lookup_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    prop = NgramProposer(2, 4)
    for trial in range(300):
        vocab = [3, 5, 300, 70000][trial % 4]  # big ids: byte patterns that straddle token boundaries
        toks = torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for k in (1, 3, 6):
            assert prop.lookup(toks, k) == _ngram_reference(toks, k, 2, 4), (toks, k)
    assert prop.lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert prop.lookup([5, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a short cycle: the copy runs over its output
    assert prop.lookup([256, 1, 7, 1], 2) == []  # bytes of 256 and 1 overlap unaligned: no false match


def test_ngram_keyed_lookups_on_a_growing_sequence_match_brute_force():
    """A request's lookups keep its tokens' byte image and extend it (key=request id), also for a prefix
    (end=: auto's shadow proposals at earlier positions): the same proposals as a fresh lookup each time."""
    g = torch.Generator().manual_seed(1)
    prop = NgramProposer(2, 4)
    for trial in range(40):
        vocab = [3, 5, 300, 70000][trial % 4]
        toks: list[int] = []
        for _ in range(60):
            toks.extend(torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist())
            for k in (1, 4):
                assert prop.lookup(toks, k, key="r") == _ngram_reference(toks, k, 2, 4)
                end = max(1, len(toks) - 3)
                assert prop.lookup(toks, k, end, "r") == _ngram_reference(toks[:end], k, 2, 4)
        prop.forget("r")
        assert "r" not in prop._bufs
    # a different sequence under a key already used (not an extension of it) is rebuilt, not searched stale
    prop.lookup([1, 2, 3, 1, 2], 2, key="x")
    assert prop.lookup([7, 8, 9, 7, 8], 2, key="x") == [9, 7]


# -- greedy: token for token identical to speculation off ---------------------------------------------
@pytest.fixture(scope="module")
def greedy_reference():
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32")
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, sp)]


def _shadow_reference(tokens: list[int], prompt_len: int, max_tokens: int, k_max: int) -> list[tuple[int, int]]:
    """The shadow proposals an `auto` n-gram run that never speculates scores, from its final tokens alone: the first
    decode step (after the prefill's token) proposes min(k_max, drafts the output has room for) tokens by brute-force
    lookup; the proposal keeps its prefix that the output repeats and is scored once the output's token after that
    prefix was seen by a later step (the last token is seen by none); the next proposal starts after that token."""
    seen = tokens[:-1]  # what the last step's plan saw
    out, s = [], prompt_len + 1
    while s < len(seen):
        cap = max_tokens - (s - prompt_len) - 1
        if cap <= 0:
            break
        prop = _ngram_reference(seen[:s], min(k_max, cap), 2, 4)
        m = 0
        while m < len(prop) and s + m < len(seen) and seen[s + m] == prop[m]:
            m += 1
        if s + m >= len(seen):
            break
        out.append((len(prop), m))
        s += m + 1
    return out


def test_auto_ngram_scores_shadow_proposals_while_off(greedy_reference, monkeypatch):
    """`auto` n-gram with every bucket held off: each sequence's k = 0 steps still score a lookup against the tokens
    the target emits (counterfactual acceptance), exactly as a brute-force replay of the output says; the scores reach
    the acceptance EMA and the guard's shadow table; nothing is drafted or verified and the output is off's."""
    from tokenmill.engine.spec.guard import GoodputGuard
    from tokenmill.engine.spec.stats import Acceptance

    def held_off(self, n, suggest=None):
        b = self._get(n)
        b.cur = 0
        b.steps += 1
        return 0

    calls: dict[str, list[tuple[int, int]]] = {}
    observe = Acceptance.observe

    def spy(self, rid, drafts, accepted):
        calls.setdefault(rid, []).append((drafts, accepted))
        observe(self, rid, drafts, accepted)

    monkeypatch.setattr(GoodputGuard, "cap", held_off)
    monkeypatch.setattr(Acceptance, "observe", spy)
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32", speculative_model="ngram", num_speculative_tokens="auto")
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    assert [r.outputs[0].token_ids for r in outs] == greedy_reference
    spec = llm.engine.spec
    ref = {r.request_id: _shadow_reference(list(r.prompt_token_ids) + list(r.outputs[0].token_ids),
                                           len(r.prompt_token_ids), 48, spec.policy.k_max) for r in outs}
    # per request, the scores in order (an empty lookup drafts nothing: no acceptance observation)
    assert calls == {rid: [c for c in cs if c[0]] for rid, cs in ref.items() if any(c[0] for c in cs)}
    drafted = [c for cs in ref.values() for c in cs if c[0]]
    assert len(drafted) >= 10 and sum(a for _k, a in drafted) > 0  # the lookup matched somewhere: not vacuous
    assert (spec.num_shadow, spec.num_shadow_drafts, spec.num_shadow_accepted) == (
        len(drafted), sum(k for k, _a in drafted), sum(a for _k, a in drafted))
    st = llm.engine.stats().spec
    assert st.num_draft_tokens == 0 and st.num_drafts == 0  # shadow proposals are not drafts
    # the guard's shadow tables hold every scored proposal, empty lookups included (1 token each)
    assert sum(b.shadow[0][2] for b in spec.guard.buckets.values() if b.shadow) > 0


@pytest.mark.parametrize("proposer,k", [("ngram", 3), ("ngram", "auto"), ("demo-draft", 4), ("demo-draft", "auto")])
def test_greedy_identical_to_spec_off(greedy_reference, proposer, k):
    kw = dict(kv_cache_bytes="32MiB", dtype="float32", speculative_model=proposer, num_speculative_tokens=k)
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm = LLM("demo", **kw)
    # batch compositions: all together (cold prefix cache), one at a time (warm cache: prompt hits)
    together = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, sp)]
    assert together == greedy_reference
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == greedy_reference
    st = llm.engine.stats()
    assert st.spec.num_draft_tokens > 0 and st.spec.num_accepted_tokens > 0
    assert sum(st.spec.accepted_per_pos) == st.spec.num_accepted_tokens <= st.spec.num_draft_tokens
    assert st.kv_blocks_used == 0  # every block (including rolled-back draft positions) came back
    # chunked prefill alongside speculating decodes, a mix with sampled requests, prefix caching off
    llm = LLM("demo", max_num_batched_tokens=24, enable_prefix_caching=False, **kw)
    params = [sp if i % 2 == 0 else SamplingParams(max_tokens=48, temperature=0.8, seed=i) for i in range(10)]
    out = llm.generate(PROMPTS + PROMPTS, params)
    for i in range(0, 10, 2):
        assert out[i].outputs[0].token_ids == greedy_reference[i % 5]


def test_greedy_identical_under_preemption(greedy_reference):
    """A KV cache too small for the batch: requests are preempted and recomputed; the draft's KV count
    restarts with them."""
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.engine.spec.proposers import draft_model_config
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.loader import resolve_model_path

    target = ModelConfig.from_dir(resolve_model_path("demo"))
    per_block = (ModelRunner.kv_bytes_per_block(target, 16, torch.float32)
                 + ModelRunner.kv_bytes_per_block(draft_model_config("demo-draft", target)[1], 16, torch.float32))
    llm = LLM("demo", dtype="float32", kv_cache_bytes=12 * per_block, block_size=16, max_model_len=160,
              speculative_model="demo-draft", num_speculative_tokens=3, max_num_batched_tokens=64)
    assert llm.engine.kv.pool.num_blocks == 12
    out = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, sp)]
    assert llm.engine.stats().num_preempted_total > 0
    assert out == greedy_reference


@pytest.mark.slow
@pytest.mark.skipif(not capabilities().native_bf16,
                    reason="bf16 runs on native instructions only where the CPU has them")
def test_greedy_identical_to_spec_off_in_bf16_at_concurrency():
    """bf16 (the default dtype on a bf16-native CPU): a verify step of n decodes + their drafts has more rows than
    the n-row decode step it stands for, and the linear kernels for <= 8 rows and for more differ in the last
    bits (flipping near-tie argmaxes: before the fix 2 of these 8 outputs differed at concurrency 4). Each
    configuration runs the same closed batches of c concurrent requests as speculation off."""
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_bytes="64MiB", dtype="bfloat16")
    off = LLM("demo", **kw)
    prompts = heldout_code_prompts(off.tokenizer, 8, 128)
    assert len(prompts) == 8

    def run(llm, c):
        return [r.outputs[0].token_ids for i in range(0, len(prompts), c)
                for r in llm.generate(prompts[i:i + c], sp)]

    refs = {c: run(off, c) for c in (4, 8)}
    for proposer, k in (("ngram", 4), ("demo-draft", 4), ("demo-draft", "auto")):
        llm = LLM("demo", speculative_model=proposer, num_speculative_tokens=k, **kw)
        for c, ref in refs.items():
            out = run(llm, c)
            assert out == ref, (proposer, k, c, [i for i, (a, b) in enumerate(zip(out, ref)) if a != b])
        assert llm.engine.stats().spec.num_accepted_tokens > 0


@pytest.mark.skipif(not capabilities().native_bf16,
                    reason="the packed head (fused argmax) runs on native bf16 only")
@pytest.mark.parametrize("proposer", ["ngram", "demo-draft"])
def test_greedy_verify_from_the_fused_argmax_identical_to_off(proposer):
    """An all-greedy speculative step takes the runner's fused head+argmax (no fp32 logits) and verifies from
    the rows' argmax; a step with a logprobs request takes the logits. Both give speculation off's tokens (and
    off's logprobs), and the argmax path is really the one taken (the runner returned tokens)."""
    kw = dict(kv_cache_bytes="64MiB", dtype="bfloat16")
    off = LLM("demo", **kw)
    llm = LLM("demo", speculative_model=proposer, num_speculative_tokens=3, **kw)
    taken = {"tokens": 0, "logits": 0}
    execute = llm.engine.runner.execute

    def spy(sched, **a):
        out = execute(sched, **a)
        if any(s.num_spec_slots for s in sched.seqs):
            taken["tokens" if out.tokens is not None else "logits"] += 1
        return out

    llm.engine.runner.execute = spy
    prompts = heldout_code_prompts(off.tokenizer, 3, 96)
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for p in prompts:  # batch 1, as the batch-1 benchmark runs
        assert llm.generate([p], sp)[0].outputs[0].token_ids == off.generate([p], sp)[0].outputs[0].token_ids
    assert taken["tokens"] > 10 and taken["logits"] == 0, taken
    lp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    got = llm.generate([prompts[0]], lp)[0].outputs[0]
    ref = off.generate([prompts[0]], lp)[0].outputs[0]
    assert got.token_ids == ref.token_ids and taken["logits"] > 0
    assert [x.token_id for x in got.logprobs] == got.token_ids
    assert all(abs(x.logprob - y.logprob) < 0.05 for x, y in zip(got.logprobs, ref.logprobs))
    assert llm.engine.stats().spec.num_accepted_tokens > 0


# -- sampled: the output distribution is the target's -------------------------------------------------
def test_rejection_sampling_unit_distribution():
    """verify_sampled's first emitted token ~ p whatever q proposed (draft distribution or point mass)."""
    p_logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    params = SamplingParams(temperature=1.0)
    target = [0.5, 0.3, 0.15, 0.05]
    for mode in ("draft", "point"):
        g = torch.Generator().manual_seed(1)
        counts = [0] * 4
        for _ in range(6000):
            if mode == "draft":
                d = int(torch.multinomial(q[0], 1, generator=g))
                toks, _ = verify_sampled(p_logits, [d], q, params, g)
            else:
                toks, _ = verify_sampled(p_logits, [3], None, params, g)  # always proposes the least likely
            counts[toks[0]] += 1
        assert chi2_pvalue(counts, target) > 1e-3, (mode, counts)
        # the test has power: the same counts are far from the proposal's own distribution
        assert chi2_pvalue(counts, [0.1, 0.2, 0.3, 0.4]) < 1e-6
    assert verify_greedy([4, 5, 6], [4, 7]) == ([4, 5], 1)
    assert verify_greedy([4, 5, 6], [4, 5]) == ([4, 5, 6], 2)


def _exact_joint(prompt_ids, top_k):
    """p(t1, t2, t3) of the target at temperature 1 with top_k, from speculation-off logprobs."""
    ref = LLM("demo", kv_cache_bytes="16MiB", dtype="float32")
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=top_k)

    def dist(prefixes):
        res = ref.generate([prompt_ids + list(p) for p in prefixes], one)
        out = []
        for r in res:
            top = r.outputs[0].logprobs[0].top
            z = sum(math.exp(v) for v in top.values())
            out.append({t: math.exp(v) / z for t, v in top.items()})
        return out

    joint = {}
    (d1,) = dist([()])
    d2s = dist([(a,) for a in d1])
    pairs = [(a, b) for a, d2 in zip(d1, d2s) for b in d2]
    d3s = dist(pairs)
    for (a, b), d3 in zip(pairs, d3s):
        for c, pc in d3.items():
            joint[(a, b, c)] = d1[a] * d2s[list(d1).index(a)][b] * pc
    return joint


@pytest.mark.parametrize("proposer", ["demo-draft", "ngram"])
def test_sampled_output_matches_target_distribution(proposer):
    """Chi-square at fixed seeds: 3-token continuations sampled with speculation (k=2) against the target's
    exact joint distribution (top_k=3, temperature 1). The prompt repeats a line the demo target copies from
    (its first token is the copy ` name` with p ~0.55 of the top 3), so n-gram proposals are drafted after it,
    accepted and rejected. (Session 19's target copied `return width * height` of a two-line function here; the
    session-21 target, trained against repeating itself after short prompts, does not: ` #` 0.58.)"""
    prompt = "import os\nimport sys\n\npath = os.path.join(base, name)\nfull = os.path.join(base, name)\nother = os.path.join(base,"
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32", speculative_model=proposer, num_speculative_tokens=2)
    ids = llm.tokenizer.encode(prompt)
    joint = _exact_joint(ids, 3)
    n = 3000
    res = llm.generate([ids] * n, [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True)
                                   for i in range(n)])
    keys = list(joint)
    counts = {k: 0 for k in keys}
    for r in res:
        counts[tuple(r.outputs[0].token_ids)] += 1  # a sequence outside the support would raise KeyError
    st = llm.engine.stats().spec
    assert st.num_draft_tokens > 1000 and 0 < st.num_accepted_tokens < st.num_draft_tokens  # both paths ran
    assert chi2_pvalue([counts[k] for k in keys], [joint[k] for k in keys]) > 1e-3


def test_seeded_sampling_reproducible_with_speculation():
    kw = dict(kv_cache_bytes="32MiB", speculative_model="demo-draft", num_speculative_tokens=3)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True)
    llm = LLM("demo", **kw)
    alone = llm.generate([PROMPTS[0]], p)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, max_tokens=30) for _ in PROMPTS[:-1]] + [p])
    assert LLM("demo", **kw).generate([PROMPTS[0]], p)[0].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[4], PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=30), p])
    assert again[1].outputs[0].token_ids == alone
    assert batch[-1].outputs[0].token_ids == llm.generate([PROMPTS[-1]], p)[0].outputs[0].token_ids
    other = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=8, max_tokens=40,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone


def test_logprobs_and_stop_with_speculation(greedy_reference):
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32", speculative_model="ngram", num_speculative_tokens=4)
    off = LLM("demo", kv_cache_bytes="32MiB", dtype="float32")
    sp = SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)
    a, b = llm.generate([PROMPTS[2]], sp)[0].outputs[0], off.generate([PROMPTS[2]], sp)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 30
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3 and list(x.top) == list(y.top)
    # max_tokens cuts inside an accepted run; a stop token ends it
    ref = greedy_reference[2]
    for m in (1, 2, 7):
        assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))[0] \
            .outputs[0].token_ids == ref[:m]
    stop = ref[5]  # ignore_eos as in the reference: the stop token is what ends it (the demo may emit EOS first)
    got = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop],
                                                    ignore_eos=True))[0]
    assert got.outputs[0].token_ids == ref[:ref.index(stop) + 1] and got.outputs[0].finish_reason == "stop"
    assert llm.engine.stats().kv_blocks_used == 0


# -- config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,msg", [
    (dict(speculative_model="ngram"), "needs num_speculative_tokens"),
    (dict(num_speculative_tokens=3), "speculative_model"),
    (dict(speculative_model="ngram", num_speculative_tokens="fast"), "'fast'"),
    (dict(speculative_model="ngram", num_speculative_tokens=0), "[1, 16]"),
    (dict(speculative_model="ngram", num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=2),
     "prompt_lookup_min"),
    (dict(speculative_model="ngram", num_speculative_tokens="auto", speculative_max_k=17), "[1, 16]"),
    (dict(speculative_model="ngram", num_speculative_tokens="auto", speculative_max_k=4.5), "4.5"),
])
def test_config_errors_name_the_field(kw, msg):
    with pytest.raises(TokenmillError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(**kw)


def test_unknown_or_mismatched_draft_model_is_a_clear_error(tiny_dir, tmp_path):
    import json
    import shutil

    with pytest.raises(TokenmillError, match="speculative_model='nope'"):
        LLM("demo", kv_cache_bytes="8MiB", speculative_model="nope", num_speculative_tokens=2)
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 5000
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenmillError, match="vocabulary of 5000 tokens"):
        LLM("demo", kv_cache_bytes="8MiB", speculative_model=str(other), num_speculative_tokens=2)
    assert EngineConfig(speculative_model="ngram", num_speculative_tokens="4").num_speculative_tokens == 4


def test_auto_largest_k_defaults_by_proposer():
    """n-gram's largest auto k is 8 (its proposal is free; verify rows are what the guard measures), a draft
    model's 6 (each proposed token is a draft forward); an explicit value wins for both."""
    assert EngineConfig(speculative_model="ngram", num_speculative_tokens="auto").speculative_max_k == 8
    assert EngineConfig(speculative_model="demo-draft", num_speculative_tokens="auto").speculative_max_k == 6
    assert EngineConfig(speculative_model="ngram", num_speculative_tokens="auto", speculative_max_k=3).speculative_max_k == 3
    assert EngineConfig(speculative_model="demo-draft", num_speculative_tokens="auto",
                        speculative_max_k=10).speculative_max_k == 10


# -- the auto policy (pure) ---------------------------------------------------------------------------
def _snap(n, alpha, per_token=1e-4, draft_step=2.5e-4, prev=None, prefill=0, caps=8):
    return SpecSnapshot(alphas=(alpha,) * n, caps=(caps,) * n, prev_k=(prev,) * n, prefill_tokens=prefill,
                        target=StepCost(8e-4, 3e-4, per_token), draft_step_s=draft_step, draft_token_s=2e-5)


def _brute_force(snap, k_max):
    """Best common k by enumeration (all sequences alike): the policy must reach its goodput."""
    from tokenmill.engine.spec.policy import _goodput

    return max(_goodput(snap, snap.alphas, [k] * len(snap.alphas)) for k in range(k_max + 1))


def test_policy_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - (1 + 0.5 + 0.25)) < 1e-12


@pytest.mark.parametrize("n,alpha,per_token", [(1, 0.8, 1e-4), (1, 0.3, 1e-4), (8, 0.6, 1e-4), (64, 0.7, 2e-4),
                                               (256, 0.9, 5e-4), (32, 0.5, 1e-5)])
def test_policy_reaches_the_best_fixed_k(n, alpha, per_token):
    from tokenmill.engine.spec.policy import _goodput

    cfg = SpecPolicyConfig(k_max=6)
    snap = _snap(n, alpha, per_token)
    ks = choose_k(snap, cfg)
    assert _goodput(snap, snap.alphas, list(ks)) >= _brute_force(snap, 6) * (1 - 1e-9)


def test_policy_turns_off_when_verification_is_expensive_and_on_when_cheap():
    assert set(choose_k(_snap(128, 0.6, per_token=5e-3))) == {0}  # a drafted token costs more than it yields
    assert min(choose_k(_snap(1, 0.9, per_token=1e-5, draft_step=1e-5))) >= 4
    lo, hi = choose_k(_snap(4, 0.4))[0], choose_k(_snap(4, 0.9))[0]
    assert lo < hi  # better acceptance, longer drafts


def test_policy_hysteresis_keeps_a_near_equal_previous_choice():
    snap = _snap(4, 0.7)
    best = choose_k(snap)[0]
    from tokenmill.engine.spec.policy import _goodput

    for prev in range(0, 7):
        kept = choose_k(_snap(4, 0.7, prev=prev))[0]
        g_prev = _goodput(snap, snap.alphas, [prev] * 4)
        g_best = _goodput(snap, snap.alphas, [best] * 4)
        assert kept == (prev if g_best <= g_prev * 1.05 else best)
    # per-sequence caps are respected
    assert choose_k(SpecSnapshot((0.9, 0.9), (0, 2), (None, None), 0, StepCost(1e-3, 1e-4, 1e-5), 1e-5, 1e-6)) \
        [0] == 0


def test_auto_does_not_oscillate_at_steady_load():
    """The engine under a steady batch: after warm-up, k switches are rare (hysteresis + EMAs)."""
    llm = LLM("demo", kv_cache_bytes="32MiB", speculative_model="demo-draft", num_speculative_tokens="auto")
    sp = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS * 2, sp)  # warm-up: the cost model sees its first shapes, α its first verifications
    st0 = llm.engine.stats().spec
    llm.generate(PROMPTS * 2, sp)  # the same load again
    st = llm.engine.stats().spec
    steps = sum(st.chosen_k.values()) - sum(st0.chosen_k.values())
    switches = st.num_k_switches - st0.num_k_switches
    assert steps > 300
    assert switches / steps < 0.1, (switches, steps, st.chosen_k)


def test_spec_metrics_on_the_server_registry():
    """The engine's spec counters appear on /metrics under vLLM's names, with per-position and chosen-k series."""
    from tokenmill.server.metrics import ServerMetrics

    llm = LLM("demo", kv_cache_bytes="32MiB", speculative_model="ngram", num_speculative_tokens=3)
    llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    st = llm.engine.stats()
    text = ServerMetrics("demo", 2048, lambda: (st, 0)).render().decode()
    sp = st.spec

    def value(line_start):
        return float(next(x for x in text.splitlines() if x.startswith(line_start)).rsplit(" ", 1)[1])

    assert value("vllm:spec_decode_num_drafts_total{") == sp.num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens_total{") == sp.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total{") == sp.num_accepted_tokens
    assert value('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="demo",position="0"}') \
        == sp.accepted_per_pos[0]
    assert value('tokenmill_spec_decode_chosen_k_total{engine="0",k="3",model_name="demo",proposer="ngram"}') \
        == sp.chosen_k[3]
    assert "tokenmill_spec_decode_k_switches_total" in text
    off = LLM("demo", kv_cache_bytes="16MiB").engine.stats()
    assert "spec_decode" not in ServerMetrics("demo", 2048, lambda: (off, 0)).render().decode()


def test_speculation_with_kv_tiers_stores_only_known_tokens(tmp_path, greedy_reference):
    """A host tier under speculation: blocks are written through with known tokens only, and a second engine
    that loads them (the draft recomputes its own KV) still produces the target's greedy output."""
    kw = dict(kv_cache_bytes="32MiB", dtype="float32", speculative_model="demo-draft", num_speculative_tokens=4,
              kv_host_bytes="64MiB", kv_host_dir=str(tmp_path / "host"))
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    assert [r.outputs[0].token_ids for r in LLM("demo", **kw).generate(PROMPTS, sp)] == greedy_reference
    second = LLM("demo", **kw)
    assert [r.outputs[0].token_ids for r in second.generate(PROMPTS, sp)] == greedy_reference
    assert second.engine.stats().kv_tiers["host"]["loaded_blocks"] > 0


def test_auto_counts_the_time_between_back_to_back_steps(monkeypatch):
    """The cost of a step that `auto` weighs is its whole period: what the engine's caller spends between two
    back-to-back steps (the core process's IPC and output handling: 0.2 ms of ~1 ms at batch 1 through the server,
    session 21) is paid once per step whatever k, so leaving it out favours short drafts. Here the caller spends
    20 ms between steps: every guard observation after the first few counts it; an idle wait (no unfinished work,
    then a new request) is not counted."""
    import time

    from tokenmill.engine.spec.guard import GoodputGuard

    seen: list[float] = []
    observe = GoodputGuard.observe

    def spy(self, n, cap, tokens, seconds, seqs=None):
        seen.append(seconds)
        observe(self, n, cap, tokens, seconds, seqs)

    monkeypatch.setattr(GoodputGuard, "observe", spy)
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32", speculative_model="ngram", num_speculative_tokens="auto")
    eng = llm.engine
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng.add_request("a", eng.tokenizer.encode(PROMPTS[2]), sp)
    while eng.has_unfinished_requests():
        eng.step()
        time.sleep(0.02)
    first = list(seen)
    assert len(first) >= 15, len(first)
    assert all(s >= 0.02 for s in first[8:]), [round(s * 1e3, 1) for s in first]
    gap = eng.spec.gap_s
    assert 0.015 < gap < 0.04, gap
    seen.clear()
    time.sleep(0.3)  # idle: the engine has no unfinished work
    eng.add_request("b", eng.tokenizer.encode(PROMPTS[0]), sp)
    while eng.has_unfinished_requests():
        eng.step()
    assert seen and all(s < 0.2 for s in seen), [round(s * 1e3, 1) for s in seen]


def test_ngram_byte_images_are_dropped_with_their_requests():
    """The n-gram proposer's per-request token bytes (lookup key=) go when the request ends: no growth over
    a server's lifetime."""
    from tokenmill import LLM, SamplingParams

    llm = LLM("demo", speculative_model="ngram", num_speculative_tokens="auto", num_threads=1)
    prompts = [[5, 6, 7, 8] * 10 + [i] for i in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.spec.proposer._bufs == {}
