"""The small-batch decode fast path against the reference path it stands beside.

The fast path (on by default; TOKENMILL_DECODE_FAST_PATH=0 turns it off) is two things: the runner builds a
decode-only step's inputs in one pass (`ModelRunner._execute_decode`) and the fused decoder stack's per-model
arguments are held in C++ (`DecodeStackHandle`, csrc/decode_step.cpp). Both feed the same kernels the same data,
so outputs must be equal bit for bit: the metadata itself (against the general `execute` on the same steps),
then whole engines' tokens and logprobs with the fast path on and off, per precision and architecture, under
streaming, stop strings, abort and preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.model.linear import onednn_bf16

needs_kernels = pytest.mark.skipif(get_kernels() is None, reason="no C++ CPU kernels on this machine")
needs_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="bf16 is emulated on this CPU")

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9], list(range(40, 80)), [1000, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def set_fast(llm: LLM, on: bool) -> None:
    runner = llm.engine.runner
    runner.decode_fast_path = on
    if runner.model.fused is not None:
        runner.model.fused.use_handle = on


class _Recorder(torch.nn.Module):
    """Stands in for the model: records what the runner passes and returns zeros."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.calls = hidden, []

    def forward(self, ids, positions, kv_caches, meta):
        self.calls.append((ids.clone(), positions.clone(), meta))
        return torch.zeros(ids.shape[0], self.hidden)

    def greedy_tokens(self, h):
        return None

    def compute_logits(self, h, float32=True):
        return torch.zeros(h.shape[0], 7)


def _decode_steps(rng: random.Random, block_size: int, num_blocks: int):
    for n in (1, 2, 3, 5, 8, 9, 16):
        seqs = []
        for i in range(n):
            start = rng.randrange(0, 8 * block_size)
            blocks = rng.sample(range(num_blocks), start // block_size + 1 + rng.randrange(0, 2))  # maybe a spare
            seqs.append(ScheduledSeq(f"r{i}", [rng.randrange(1, 500)], start, blocks, 1))
        yield SchedulerOutput(seqs)


def _assert_same_inputs(rec, window) -> None:
    """The last two recorded forwards (fast path, then general path) got the same ids, positions and metadata."""
    (ids_f, pos_f, mf), (ids_r, pos_r, mr) = rec.calls[-2:]
    assert torch.equal(ids_f, ids_r) and torch.equal(pos_f, pos_r)
    for name in ("slot_mapping", "decode_token_idx", "decode_block_tables", "decode_ctx_lens"):
        a, b = getattr(mf, name), getattr(mr, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert mf.spans == mr.spans == [] and mf.sliding_window == mr.sliding_window == window
    assert mf.logits_rows is None and mr.logits_rows is None


@pytest.mark.parametrize("window", [None, 24])
def test_decode_inputs_equal_the_general_path(tiny_dir, window):
    """Every tensor the model gets (ids, positions, slots, tables, context lengths, decode index) is the general
    path's, on random decode steps of 1-16 sequences with scattered blocks, for both logits kinds."""
    llm = LLM(str(tiny_dir), kv_cache_bytes="8MiB")
    runner = llm.engine.runner
    runner.sliding_window = window
    runner.small_rows = 8  # the non-AMX limit (AMX: 256, which these steps never pass): some steps need the bits
    rec = _Recorder(runner.cfg.hidden_size)
    runner.model = rec
    rng = random.Random(0)
    checked = 0
    for sched in _decode_steps(rng, runner.block_size, runner.num_blocks):
        for greedy in (True, False):
            outs = []
            for on in (True, False):
                runner.decode_fast_path = on
                outs.append(runner.execute(sched, float_logits=False, greedy=greedy))
            _assert_same_inputs(rec, window)
            assert outs[0].logit_offsets == outs[1].logit_offsets
            assert torch.equal(outs[0].logits, outs[1].logits)
            checked += 1
    assert checked == 14


def _verify_steps(rng: random.Random, block_size: int, num_blocks: int):
    """Steps of decode-style rows only: plain decodes beside speculative verifications (1 + d tokens, d of the
    k reserved slots filled: d = 0 when a lookup found nothing), 1-12 sequences, up to 20 rows."""
    for n, k in ((1, 4), (1, 1), (2, 3), (3, 6), (5, 2), (9, 1), (12, 1)):
        seqs = []
        for i in range(n):
            start = rng.randrange(0, 8 * block_size)
            spec = i == 0 or rng.random() < 0.7  # one at least: a step of plain decodes takes _execute_decode
            d = rng.randrange(0, k + 1) if spec else 0
            blocks = rng.sample(range(num_blocks), (start + d) // block_size + 1 + rng.randrange(0, 2))
            toks = [rng.randrange(1, 500) for _ in range(1 + d)]
            seqs.append(ScheduledSeq(f"r{i}", toks, start, blocks, 1 + d, num_spec_slots=k if spec else 0))
        yield SchedulerOutput(seqs, sum(len(s.token_ids) for s in seqs))


@pytest.mark.parametrize("window", [None, 24])
def test_verify_inputs_equal_the_general_path(tiny_dir, window, monkeypatch):
    """A step of decodes and speculative verifications (`ModelRunner._execute_verify`): every tensor the model gets,
    the small-row-bits setting it runs under, the logit offsets and the logits are the general path's."""
    from tokenmill.model import linear

    llm = LLM(str(tiny_dir), kv_cache_bytes="8MiB")
    runner = llm.engine.runner
    runner.sliding_window = window
    runner.small_rows = 8  # the non-AMX limit (AMX: 256, which these steps never pass): some steps need the bits
    rec = _Recorder(runner.cfg.hidden_size)
    bits: list[bool] = []
    fwd = rec.forward
    rec.forward = lambda *a: (bits.append(linear.small_row_bits_on()), fwd(*a))[1]
    runner.model = rec
    used = []
    orig = runner._execute_verify
    monkeypatch.setattr(runner, "_execute_verify", lambda *a: (used.append(1), orig(*a))[1])
    rng = random.Random(1)
    checked = 0
    for sched in _verify_steps(rng, runner.block_size, runner.num_blocks):
        for greedy in (True, False):
            outs = []
            for on in (True, False):
                runner.decode_fast_path = on
                outs.append(runner.execute(sched, float_logits=True, greedy=greedy))
            _assert_same_inputs(rec, window)
            assert bits[-2] == bits[-1]
            assert outs[0].logit_offsets == outs[1].logit_offsets
            assert torch.equal(outs[0].logits, outs[1].logits)
            checked += 1
    assert checked == 14 and len(used) == 14  # the fast path ran on every step it was on for
    assert any(bits)  # some step had > 8 rows from <= 8 sequences


def test_a_wrong_fast_path_is_caught(tiny_dir, monkeypatch):
    """The comparison above can fail: slots one off in the fast path differ from the general path's."""
    llm = LLM(str(tiny_dir), kv_cache_bytes="8MiB")
    runner = llm.engine.runner
    rec = _Recorder(runner.cfg.hidden_size)
    runner.model = rec
    sched = SchedulerOutput([ScheduledSeq("a", [3], 20, [4, 9], 1)])
    real = runner._tensor

    def off_by_one(data, dtype=torch.long):
        t = real(data, dtype)
        if t.dim() == 2 and t.shape[0] == 4:  # the fast path's [ids, positions, slots, ctx] rows
            t[2] += 1
        return t

    monkeypatch.setattr(runner, "_tensor", off_by_one)
    runner.decode_fast_path = True
    runner.execute(sched)
    runner.decode_fast_path = False
    runner.execute(sched)
    assert not torch.equal(rec.calls[0][2].slot_mapping, rec.calls[1][2].slot_mapping)


def _generate(llm, prompts, params):
    res = llm.generate(prompts, params)
    llm.engine.kv.pool.reset_prefix_cache()
    toks = [r.outputs[0].token_ids for r in res]
    lps = [[(lp.token_id, lp.logprob, lp.top) for lp in (r.outputs[0].logprobs or [])] for r in res]
    return toks, lps, [r.outputs[0].text for r in res]


def _on_off(llm, prompts, params):
    set_fast(llm, True)
    fast = _generate(llm, prompts, params)
    set_fast(llm, False)
    ref = _generate(llm, prompts, params)
    set_fast(llm, True)
    return fast, ref


MIXED = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),  # greedy: the packed head's argmax
         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),  # logits + logprobs
         SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, seed=7),  # sampled, seeded
         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]


@needs_kernels
@pytest.mark.parametrize("dtype,quant,kv", [
    ("float32", "none", "auto"), pytest.param("bfloat16", "none", "auto", marks=needs_bf16),
    ("float32", "int8", "auto"), ("bfloat16", "int8", "auto"), ("bfloat16", "int8", "int8"),
    ("float32", "none", "bfloat16")])
def test_engine_outputs_equal_with_the_fast_path_on_and_off(tiny_dir, dtype, quant, kv):
    llm = LLM(str(tiny_dir), dtype=dtype, quantization=quant, kv_cache_dtype=kv, kv_cache_bytes="8MiB")
    assert llm.engine.runner.model.fused is not None and llm.engine.runner.model.fused.use_handle
    for prompts, params in ((PROMPTS[:1], MIXED[0]), (PROMPTS[:1], MIXED[1]), (PROMPTS, MIXED)):
        fast, ref = _on_off(llm, prompts, params)
        assert fast == ref


@needs_kernels
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-mistral"])
def test_fast_path_on_other_architectures(model_dir, preset):
    """qkv bias (qwen2), qk-norm (qwen3), llama3 rope and tied head, one kv head (mistral): bit for bit."""
    dtype = "bfloat16" if onednn_bf16() else "float32"
    llm = LLM(str(model_dir(preset)), dtype=dtype, kv_cache_bytes="8MiB")
    fast, ref = _on_off(llm, PROMPTS, MIXED)
    assert fast == ref


@needs_kernels
def test_stop_strings_streaming_abort_and_preemption_are_unchanged(tiny_dir):
    """Stop strings (text cut, finish reasons), per-step streamed outputs, an abort mid-decode, and a KV cache small
    enough to preempt: the same step by step with the fast path on and off."""
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.model.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_dir)
    per_block = ModelRunner.kv_bytes_per_block(cfg, 16, torch.float32)

    def trace(on: bool):
        llm = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes=6 * per_block, block_size=16, max_model_len=96,
                  max_num_batched_tokens=32)
        set_fast(llm, on)
        eng = llm.engine
        ref_text = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        text = ref_text[0].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 2] if len(text) >= 4 else None
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop] if stop else None),
                  SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3)]
        for i, (p, sp) in enumerate(zip([PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1]], params)):
            eng.add_request(f"q{i}", p, sp)
        steps = []
        while eng.has_unfinished_requests():
            outs = eng.step()
            steps.append([(o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.stop_reason)
                          for o in outs])
            if len(steps) == 25:  # after the cache filled up (the preemptions come first)
                eng.abort_request("q2")
        return steps, eng.stats().num_preempted_total, eng.kv.pool.num_used

    fast, ref = trace(True), trace(False)
    assert fast == ref
    steps, preempted, used = fast
    assert preempted > 0, "the KV cache was big enough: no preemption tested"
    assert used == 0
    finished = {rid: (reason, stop_reason) for st in steps for rid, _, _, done, reason, stop_reason in st if done}
    assert finished["q1"][0] == "stop" and finished["q1"][1] is not None  # the stop string ended it
    assert "q2" not in finished  # aborted: no output after


@needs_kernels
def test_the_handle_follows_new_caches_and_rope(tiny_dir):
    """The C++-held cache list is replaced when the runner's caches change, and a different rope table rebuilds
    the handle (the Python API of FusedDecodeStack is unchanged: callers pass caches and rope each call)."""
    from tokenmill.model.attention import AttentionMetadata

    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB")
    runner = llm.engine.runner
    model, stack = runner.model, runner.model.fused
    meta = AttentionMetadata(slot_mapping=torch.tensor([3]), spans=[], decode_token_idx=torch.arange(1),
                             decode_block_tables=torch.tensor([[0]]), decode_ctx_lens=torch.tensor([4]))
    x = model.embed_tokens(torch.tensor([5]))
    pos = torch.tensor([3])  # a rotation that the rope tables decide
    with torch.inference_mode():
        outs = {}
        for on in (True, False):
            stack.use_handle = on
            caches = [c.clone() for c in runner.kv_caches]
            outs[on] = stack(x.clone(), pos, model.rope, caches, meta)
            outs[(on, "caches")] = caches[0]
        assert torch.equal(outs[True], outs[False])
        assert torch.equal(outs[(True, "caches")], outs[(False, "caches")])  # the KV went to the caches passed
        assert outs[(True, "caches")].abs().sum() > 0
        stack.use_handle = True
        held = stack._handle
        rope2 = type(model.rope).__new__(type(model.rope))
        rope2.__dict__.update(model.rope.__dict__)
        rope2.cos, rope2.sin = model.rope.cos * 0 + 1, model.rope.sin * 0  # no rotation
        y = stack(x.clone(), pos, rope2, [c.clone() for c in runner.kv_caches], meta)
        assert stack._handle is not held
        stack.use_handle = False
        y_ref = stack(x.clone(), pos, rope2, [c.clone() for c in runner.kv_caches], meta)
        assert torch.equal(y, y_ref)


def test_fast_path_off_by_env(monkeypatch, tiny_dir):
    monkeypatch.setenv("TOKENMILL_DECODE_FAST_PATH", "0")
    llm = LLM(str(tiny_dir), kv_cache_bytes="8MiB")
    assert not llm.engine.runner.decode_fast_path
    assert llm.engine.runner.model.fused is None or not llm.engine.runner.model.fused.use_handle
    monkeypatch.setenv("TOKENMILL_DECODE_FAST_PATH", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_DECODE_FAST_PATH"):
        LLM(str(tiny_dir), kv_cache_bytes="8MiB")


@needs_kernels
def test_changing_the_stack_after_its_first_call_reaches_the_handle(tiny_dir):
    """The handle holds copies of the stack's lists and tensors: setting an attribute or a weight-list item after
    the first call must still change the result, exactly as on the reference path."""
    from tokenmill.model.fused_decode import LIN_SLOTS_PY

    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB")
    stack = llm.engine.runner.model.fused
    before = _on_off(llm, PROMPTS, MIXED[1])
    assert before[0] == before[1] and stack._handle is not None
    stack.final_norm = stack.final_norm * 1.01
    assert stack._handle is None
    after_norm = _on_off(llm, PROMPTS, MIXED[1])
    assert after_norm[0] == after_norm[1] and after_norm[0][1] != before[0][1]
    slot = 4  # layer 0's qkv weight (the small-row kernels read it)
    assert stack.kinds[0] == 0 and LIN_SLOTS_PY == 6
    stack.weights[slot] = stack.weights[slot] * 1.05
    assert stack._handle is None
    after_w = _on_off(llm, PROMPTS, MIXED[1])
    assert after_w[0] == after_w[1] and after_w[0][1] != after_norm[0][1]
