"""Sampler semantics and engine-level sampling features on a tiny random model."""

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.sampler import Sampler, _top_k_top_p, greedy_tokens
from tokenmill.errors import InvalidRequestError


def test_top_k_top_p_mask_by_hand():
    x = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda k, p: torch.isfinite(_top_k_top_p(x.clone(), [k], [p]))[0].tolist()  # noqa: E731
    assert keep(2, 1.0) == [True, True, False, False, False]
    assert keep(0, 0.6) == [True, True, False, False, False]  # 0.5 < 0.6, 0.5 + 0.2 >= 0.6
    assert keep(0, 0.5) == [True, False, False, False, False]
    assert keep(0, 0.71) == [True, True, True, False, False]
    assert keep(1, 0.9) == [True, False, False, False, False]
    assert keep(0, 1.0) == [True] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_equal_torch_argmax_of_fp32(dtype):
    """The greedy path (C++ argmax_rows on the logits' own dtype) against torch.argmax over an fp32 copy, with ties
    (the first maximum wins), -inf, a NaN (torch picks the NaN), row lengths off the vector width, a strided view."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(67, 32003, generator=g).to(dtype)
    x[3, 100] = x[3, 5000] = x[3].max() + 1  # a tie: index 100
    x[4, -1] = x[4].max() + 1  # the last column (the scalar tail)
    x[5, :] = float("-inf")  # all -inf: index 0
    x[6, 77] = float("nan")  # torch.argmax returns the NaN's index
    x[7, 9] = x[7, 12] = float("nan")
    x[7, 20000] = x[7].nan_to_num(nan=0).max() + 1
    for t in (x, x[:, 1:], x[:, :31]):
        assert greedy_tokens(t) == t.float().argmax(dim=-1).tolist()
    assert greedy_tokens(x[:0]) == []
    y = x.clone()
    y[10, 3] = y[10].nan_to_num(nan=0).max() + 2  # the check above can fail
    assert greedy_tokens(y) != x.float().argmax(dim=-1).tolist()


def test_greedy_sample_skips_the_fp32_copy_only_without_logprobs():
    s = Sampler(0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 1.0, 0.0]], dtype=torch.bfloat16)
    r = s.sample(logits, [SamplingParams(temperature=0)] * 2, [None] * 2)
    assert r.token_ids == [1, 0] and r.logprobs == [None, None]
    r = s.sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=1)], [None] * 2)
    assert r.token_ids == [1, 0] and r.logprobs[0] is None
    assert r.logprobs[1].logprob == pytest.approx(float(torch.log_softmax(logits[1].float(), -1)[0]))


def test_sampling_distribution_follows_temperature():
    s = Sampler(0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    toks = torch.tensor(s.sample(logits, params, [None] * 4000).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    # temperature 0.5 squares the odds: p ~ [0.49, 0.04, 0.01] / 0.54
    toks = torch.tensor(s.sample(logits, [SamplingParams(temperature=0.5)] * 4000, [None] * 4000).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert abs(freq[0].item() - 0.49 / 0.54) < 0.03


def test_logprobs_are_log_softmax_of_raw_logits():
    s = Sampler(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    r = s.sample(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    lp = r.logprobs[0]
    z = math.log(sum(math.exp(v) for v in [2.0, 1.0, 0.0, -1.0]))
    assert lp.token_id == 0 and abs(lp.logprob - (2.0 - z)) < 1e-6
    assert list(lp.top) == [0, 1] and abs(lp.top[1] - (1.0 - z)) < 1e-6


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(logprobs=99), dict(stop=[""]), dict(seed="x")])
def test_invalid_params_rejected(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), kv_cache_bytes="16MiB", max_num_batched_tokens=256)


def test_seed_reproducible_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["def f(x):"], p)[0].outputs[0].token_ids
    batch = llm.generate(["import os", "def f(x):", "class A:"],
                         [SamplingParams(temperature=1.0, max_tokens=20), p, SamplingParams(temperature=0.7)])
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate(["def f(x):"], SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=20,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone


def test_stop_token_ids_max_tokens_and_stop_strings(llm):
    base = llm.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    # stop at the 5th generated token's id
    tok = base.token_ids[4]
    first = base.token_ids.index(tok)
    r = llm.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok],
                                               ignore_eos=True))[0].outputs[0]
    assert r.token_ids == base.token_ids[:first + 1] and r.finish_reason == "stop" and r.stop_reason == tok
    # a stop string taken from the middle of the greedy text: output ends right before it
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        r = llm.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                   ignore_eos=True))[0].outputs[0]
        assert r.finish_reason == "stop" and r.text == text[:text.index(stop)] and stop not in r.text


def test_engine_rejects_bad_requests(llm):
    eng = llm.engine
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", [], SamplingParams())
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        eng.add_request("x", [1] * 10, SamplingParams(max_tokens=eng.max_model_len))


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free0 = eng.kv.pool.num_free
    eng.add_request("ab", list(range(1, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    assert eng.kv.pool.num_free < free0
    eng.abort_request("ab")
    assert eng.kv.pool.num_free == free0 and not eng.has_unfinished_requests()


def test_waiting_queue_is_bounded(tiny_dir):
    from tokenmill.errors import EngineOverloadedError

    llm = LLM(str(tiny_dir), kv_cache_bytes="4MiB", max_waiting_requests=2)
    llm.engine.add_request("1", [1, 2], SamplingParams())
    llm.engine.add_request("2", [1, 2], SamplingParams())
    with pytest.raises(EngineOverloadedError):
        llm.engine.add_request("3", [1, 2], SamplingParams())
