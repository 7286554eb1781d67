"""The fused decoder stack (one C++ call for decode steps of any size) against the module path it replaces.

The reference is the same engine with `model.fused = None` (every step through the nn.Modules in llama.py). The
fused path calls the same kernels in the same order, so greedy tokens and their logprobs must be equal (bit for
bit where no qk-norm is involved; qk-norm models take the kernel RMSNorm where the module path's strided view
takes PyTorch's, so their logprobs get a tolerance)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.hardware import capabilities
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.linear import onednn_bf16

pytestmark = pytest.mark.skipif(get_kernels() is None, reason="no C++ CPU kernels on this machine")
# the fused stack runs unquantized bf16 models only where their linears are oneDNN-packed (native bf16); elsewhere
# (e.g. an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2) it is by design not built for them, and the module path runs.
# int8 models get it wherever the kernels build (their decoder linears are all int8, whatever the activations' dtype):
# for steps of any size where an int8 linear has a > 8-row int8 path, else for steps of at most MAX_TOKENS tokens
needs_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="bf16 is emulated on this CPU: no fused bf16 stack")


def _int8_stack() -> bool:  # native int8 dot products, or the AVX2 exact int8 kernels (csrc/int8_gemm.cpp)
    from tokenmill.model.cpu_kernels import get_kernels
    from tokenmill.model.linear import avx2_int8_by_env

    k = get_kernels()
    return capabilities().native_int8 or (k is not None and k.has_avx2_int8() and avx2_int8_by_env())


needs_int8 = pytest.mark.skipif(not _int8_stack(), reason="no int8 GEMM on this CPU: no fused int8 stack")

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9], list(range(40, 80)), [1000, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
# 13 sequences: decode steps of more than 8 tokens (oneDNN / int8 GEMM inside the stack), contexts 3..70
MANY = PROMPTS + [[(31 * i + 7 * j) % 500 + 1 for j in range(3 + 7 * i)] for i in range(9)]


class _Counting:
    """Wraps a FusedDecodeStack and counts the steps it ran (so a silent fallback fails the test)."""

    def __init__(self, inner: FusedDecodeStack):
        self.inner, self.calls, self.max_tokens_seen = inner, 0, 0

    def applies(self, x, meta):
        return self.inner.applies(x, meta)

    def __call__(self, *a):
        self.calls += 1
        self.max_tokens_seen = max(self.max_tokens_seen, a[0].shape[0])
        return self.inner(*a)


def _run(llm: LLM, prompts, fused, max_tokens=12):
    model = llm.engine.runner.model
    model.fused = fused
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    res = llm.generate(prompts, params)
    llm.engine.kv.pool.reset_prefix_cache()
    return ([r.outputs[0].token_ids for r in res],
            torch.tensor([[lp.logprob for lp in r.outputs[0].logprobs] for r in res]))


def _compare(llm: LLM, prompts, exact: bool):
    model = llm.engine.runner.model
    stack = model.fused
    assert stack is not None, "the fused path was not built for this model"
    counting = _Counting(stack)
    got_tokens, got_lp = _run(llm, prompts, counting)
    ref_tokens, ref_lp = _run(llm, prompts, None)
    model.fused = stack
    assert counting.calls > 0, "no step took the fused path"
    assert counting.max_tokens_seen >= len(prompts), "a full decode step did not take the fused path"
    assert got_tokens == ref_tokens
    if exact:
        assert torch.equal(got_lp, ref_lp), (got_lp - ref_lp).abs().max()
    else:
        torch.testing.assert_close(got_lp, ref_lp, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype,quant,kv", [
    ("float32", "none", "auto"), pytest.param("bfloat16", "none", "auto", marks=needs_bf16),
    ("float32", "int8", "auto"), ("bfloat16", "int8", "int8"), ("float32", "none", "bfloat16")])
def test_fused_decode_equals_the_module_path(tiny_dir, dtype, quant, kv):
    from tokenmill.model.fused_decode import ANY, MAX_TOKENS

    llm = LLM(str(tiny_dir), dtype=dtype, quantization=quant, kv_cache_dtype=kv, kv_cache_bytes="8MiB")
    _compare(llm, PROMPTS[:1], exact=True)  # batch 1
    _compare(llm, PROMPTS, exact=True)  # 4 sequences per step, different context lengths
    stack = llm.engine.runner.model.fused
    if stack.max_tokens != ANY:  # only an int8 stack without a > 8-row int8 path (no VNNI) keeps to small steps
        assert stack.max_tokens == MAX_TOKENS and quant == "int8" and not capabilities().native_int8
        return
    _compare(llm, MANY, exact=True)  # 13 per step: the > 8-row linears (oneDNN, int8 GEMM)


@needs_bf16
def test_fused_decode_equals_the_module_path_without_batch_invariance(tiny_dir):
    """bf16 engines are batch-invariant by default (every step under small_row_bits); off, the stack's > 8-row
    linears take oneDNN (AMX: above amx_rows), and the module path must give the same bits there too."""
    llm = LLM(str(tiny_dir), dtype="bfloat16", kv_cache_bytes="8MiB", batch_invariant="off")
    assert not llm.engine.batch_invariant
    _compare(llm, PROMPTS, exact=True)
    _compare(llm, MANY, exact=True)


@needs_bf16
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama3", "tiny-mistral"])
def test_fused_decode_on_other_architectures(model_dir, preset):
    """qkv bias (qwen2), llama3 rope and tied head, one kv head of 32 dims (mistral)."""
    llm = LLM(str(model_dir(preset)), dtype="bfloat16", kv_cache_bytes="8MiB")
    _compare(llm, PROMPTS, exact=True)
    _compare(llm, MANY, exact=True)


def test_fused_decode_with_qk_norm(model_dir):
    llm = LLM(str(model_dir("tiny-qwen3")), dtype="float32", kv_cache_bytes="8MiB")
    _compare(llm, PROMPTS, exact=False)
    _compare(llm, MANY, exact=False)


def test_fused_decode_runs_speculative_verification_steps():
    """k draft tokens per sequence (each attends with its own context length) go through the fused stack too."""
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32", speculative_model="ngram", num_speculative_tokens=4)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]  # repetitive: the n-gram proposer finds drafts
    _compare(llm, prompts, exact=True)


def test_a_wrong_fused_stack_is_caught(tiny_dir):
    """The comparison above can fail: a fused stack whose final norm is off changes the logprobs."""
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB")
    stack = llm.engine.runner.model.fused
    stack.final_norm = stack.final_norm * 1.01
    with pytest.raises(AssertionError):
        _compare(llm, PROMPTS[:1], exact=True)


def test_a_wrong_large_step_linear_is_caught(tiny_dir):
    """Only the > 8-row path changed (layer 0's o_proj reads a 1%-off packed weight there): the comparison on
    13 sequences fails, and the same stack on 4 sequences (small-row kernels only) still passes."""
    from tokenmill.model.fused_decode import LAYER_SLOTS_PY, LIN_SLOTS_PY
    from tokenmill.model.linear import PackedWeight

    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB")
    model = llm.engine.runner.model
    stack = model.fused
    o = model.layers[0].self_attn.o_proj
    slot = 4 + LIN_SLOTS_PY + 4  # layer 0, o_proj, its oneDNN-packed weight
    assert LAYER_SLOTS_PY == 4 + 4 * LIN_SLOTS_PY and stack.weights[slot] is o.packed.packed
    stack.weights[slot] = PackedWeight(o.weight * 1.01).packed
    _compare(llm, PROMPTS, exact=True)
    with pytest.raises(AssertionError):
        _compare(llm, MANY, exact=True)


@needs_int8
def test_int8_without_an_int8_gemm_keeps_the_stack_to_small_steps(tiny_dir):
    """Where an int8 linear has no int8 GEMM (no VNNI, no AVX2 kernels: the module path computes its big products in
    fp32) the stack takes at most MAX_TOKENS tokens, and larger steps run the modules."""
    from tokenmill.model.fused_decode import ANY, MAX_TOKENS

    llm = LLM(str(tiny_dir), dtype="float32", quantization="int8", kv_cache_bytes="8MiB")
    model = llm.engine.runner.model
    assert model.fused.max_tokens == ANY
    model.layers[1].mlp.down_proj.int8_gemm = False
    model.layers[1].mlp.down_proj.avx2_panels = None  # and no AVX2 int8 kernels either
    model.fused = FusedDecodeStack.build(model)
    assert model.fused.max_tokens == MAX_TOKENS
    counting = _Counting(model.fused)
    _run(llm, MANY, counting)  # 13 sequences decoding together the whole way: every step runs the modules
    assert counting.calls == 0
    _run(llm, PROMPTS, counting)
    assert counting.calls > 0 and counting.max_tokens_seen == len(PROMPTS)


def test_fused_decode_off_by_env(monkeypatch, tiny_dir):
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    assert LLM(str(tiny_dir), kv_cache_bytes="8MiB").engine.runner.model.fused is None
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_FUSED_DECODE"):
        LLM(str(tiny_dir), kv_cache_bytes="8MiB")


@needs_bf16
def test_verify_steps_that_need_small_row_bits_run_fused_with_those_bits():
    """Without batch invariance (`batch_invariant="off"`), a bf16 verify step of 4 sequences x (1 + 4 drafts) = 20
    rows stands for a 4-row decode step: its rows must get the small-row kernels' bits (linear.small_row_bits),
    which the fused stack's > 8-row oneDNN path would not give. The stack's C++ linears follow that context
    (`set_small_row_bits`, session 22; before, the stack stepped aside for such steps), so it runs them, and the
    output is token for token speculation off. On AMX the small-row kernel takes up to amx_rows() (256) rows: there
    160 sequences x ~2.5 rows stand for a 160-row step, and the stack's limit is 256."""
    from tokenmill.model.linear import small_row_bits_on

    prompts = [[3, 4, 5, 6] * 4, [9, 10, 11] * 5, [20, 21] * 7, [7, 8, 9, 10, 11] * 3]  # repetitive: n-gram drafts
    probe = LLM("demo", kv_cache_bytes="32MiB", dtype="bfloat16", batch_invariant="off")
    limit = probe.engine.runner.model.fused.bits_rows
    assert probe.engine.runner.small_rows == limit  # the runner's rule and the stack's agree
    assert hasattr(probe.engine.runner.model.fused.kernels, "set_small_row_bits")
    if limit > 8:  # AMX: more sequences, so that a verify step passes the stack's limit while its decode rows do not
        prompts = [[(t + i) % 200 + 3 for t in p] for i in range(40) for p in prompts]  # 160 (~2.5 rows each)
        assert limit >= len(prompts)
    # 48 tokens: the session-21 demo target seldom continues these patterns at once (with 24, no AMX verify step
    # passed the limit); later in the output its own text repeats and the lookups draft
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    off = LLM("demo", kv_cache_bytes="32MiB", dtype="bfloat16", batch_invariant="off")
    ref = [r.outputs[0].token_ids for r in off.generate(prompts, params)]
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="bfloat16", speculative_model="ngram", num_speculative_tokens=4,
              batch_invariant="off")
    model = llm.engine.runner.model
    seen = {"big_small_bits": 0, "big_fused_small_bits": 0}

    class Watching(_Counting):
        def applies(self, x, meta):
            ok = self.inner.applies(x, meta)
            if x.shape[0] > limit and small_row_bits_on():
                seen["big_small_bits"] += 1
                seen["big_fused_small_bits"] += int(ok)
            return ok

    watching = Watching(model.fused)
    model.fused = watching
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert seen["big_small_bits"] > 0, "no verify step needed the small-row bits: the test checks nothing"
    assert seen["big_fused_small_bits"] == seen["big_small_bits"]  # the stack ran every one of them
    assert watching.calls > 0  # the draft-free and small steps still take the fused stack
    assert got == ref
