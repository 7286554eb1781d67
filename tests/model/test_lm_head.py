"""The packed bf16 lm_head (csrc/lm_head.cpp, model/lm_head.py) and its fusion with the greedy argmax.

- logits against an fp32 product of the same bf16 values (tolerance: one bf16 rounding of the result plus fp32
  accumulation, rtol 2^-8 + atol 1e-3);
- batch invariance: every row of an M-row call is bit-equal to the same row computed alone;
- fused argmax == torch.argmax over the kernel's own logits, exactly: ties (within a thread's range and across the
  threads' ranges), NaN rows and NaN columns, +-inf, a vocabulary that is not a multiple of the 64-wide tile,
  at 1 and 2 threads;
- the engine: all-greedy steps take the fused path and give the tokens of the logits path (greedy with logprobs,
  which writes the logits), in bf16 and with int8 KV and the model variants."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.model.lm_head import PackedHead

_K = get_kernels()
pytestmark = pytest.mark.skipif(_K is None or not _K.has_lm_head_bf16(),
                                reason="the packed lm_head needs the C++ kernels built with AVX-512 BF16")


def _head(v: int, h: int, seed: int = 0) -> tuple[torch.Tensor, PackedHead]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, h, generator=g) * 0.05).bfloat16()
    return w, PackedHead.build(w)


def _x(m: int, h: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, h, generator=g).bfloat16()


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64, 70])
def test_logits_match_fp32_reference_and_are_batch_invariant(m):
    v, h = 1000 + 37, 96  # a vocab that is not a multiple of 64; K not a multiple of 32
    w, head = _head(v, h)
    x = _x(m, h)
    got = head.logits(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, v)
    ref = x.float() @ w.float().t()
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-3)
    for i in {0, m // 2, m - 1}:  # each row alone: the same bits
        assert torch.equal(head.logits(x[i:i + 1]), got[i:i + 1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 6, 57, 64])
def test_fused_argmax_equals_argmax_of_the_logits(m, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        v, h = 32000 - 21, 128
        w, _ = _head(v, h, seed=2)
        x = _x(m, h, seed=3)
        # exact ties: the same weight row at several indices, large enough to be the maximum of row 0;
        # indices inside one thread's range and across the two threads' ranges
        w[[7, 300, 20000, 31000]] = (x[0].float() * 0.5).bfloat16()
        if m > 1:  # row 1's maximum tied only across the halves of the vocabulary
            w[[25000, 9000]] = (x[1].float() * 0.5).bfloat16()
        if m > 3:
            x[2, 5] = float("nan")  # a NaN row: every logit NaN -> index 0
            x[3] = 0
            x[3, 0] = 1.0  # row 3 reads column 0 of W only
        w[12345, 0] = float("inf")  # column 12345: +inf for rows with x[0] > 0, -inf below, NaN at 0
        w[23456, 0] = float("nan")  # column 23456 is NaN in every row whose products reach it
        head = PackedHead.build(w)
        logits = head.logits(x)
        want = logits.argmax(dim=-1)
        got = head.greedy(x)
        assert torch.equal(got, want), (got, want)
        assert bool(torch.isnan(logits[:, 23456]).all())  # the NaN column is there: its index wins every row
        # without the NaN column: the tie rules themselves
        w[23456, 0] = 0
        head = PackedHead.build(w)
        logits = head.logits(x)
        got = head.greedy(x)
        assert torch.equal(got, logits.argmax(dim=-1))
        if x[0, 0] <= 0:
            assert got[0].item() == 7  # the first of the tied maxima
    finally:
        torch.set_num_threads(prev)


def test_all_negative_infinity_rows():
    v, h = 200, 64
    w = torch.zeros(v, h, dtype=torch.bfloat16)
    w[:, 0] = float("-inf")
    head = PackedHead.build(w)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    logits = head.logits(x)
    assert bool((logits == float("-inf")).all())
    assert torch.equal(head.greedy(x), logits.argmax(dim=-1))  # all -inf: index 0


def test_env_switch_keeps_the_module_path(monkeypatch):
    w, _ = _head(100, 64)
    monkeypatch.setenv("TOKENMILL_LM_HEAD", "0")
    assert PackedHead.build(w) is None
    monkeypatch.setenv("TOKENMILL_LM_HEAD", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_LM_HEAD"):
        PackedHead.build(w)
    monkeypatch.setenv("TOKENMILL_LM_HEAD", "1")
    assert PackedHead.build(w.float()) is None  # fp32 heads keep the module path


PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9], list(range(40, 80)), [1000, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MANY = PROMPTS + [[(31 * i + 7 * j) % 500 + 1 for j in range(3 + 7 * i)] for i in range(9)]


class _CountingHead:
    def __init__(self, inner: PackedHead):
        self.inner, self.greedy_calls, self.logit_calls = inner, 0, 0

    def applies(self, h):
        return self.inner.applies(h)

    def applies_greedy(self, h):
        return self.inner.applies_greedy(h)

    def logits(self, h):
        self.logit_calls += 1
        return self.inner.logits(h)

    def greedy(self, h):
        self.greedy_calls += 1
        return self.inner.greedy(h)


def _engine_compare(llm: LLM, prompts=MANY, logits_via_head: bool = True):
    """logits_via_head=False: steps too large for the head's logits kernel (the int8 head above MAX_ROWS: the
    with-logits run computes them through the int8 Linear, the reference)."""
    model = llm.engine.runner.model
    assert model.packed_head is not None, "the packed head was not built for this model"
    counting = _CountingHead(model.packed_head)
    model.packed_head = counting
    try:
        fused = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert counting.greedy_calls > 0 and counting.logit_calls == 0
        llm.engine.kv.pool.reset_prefix_cache()
        with_logits = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))
        assert counting.logit_calls > 0 or not logits_via_head
    finally:
        model.packed_head = counting.inner
    assert [r.outputs[0].token_ids for r in fused] == [r.outputs[0].token_ids for r in with_logits]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_engine_fused_greedy_equals_the_logits_path(tiny_dir, kv):
    _engine_compare(LLM(str(tiny_dir), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes="8MiB"))


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama3", "tiny-mistral"])
def test_engine_fused_greedy_on_other_architectures(model_dir, preset):
    _engine_compare(LLM(str(model_dir(preset)), dtype="bfloat16", kv_cache_bytes="8MiB"))


def test_fp32_models_keep_their_heads(tiny_dir):
    assert LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB").engine.runner.model.packed_head is None


_I8 = pytest.mark.skipif(_K is None or not _K.has_lm_head_int8(), reason="the int8 head kernel needs AVX-512 VNNI")


@_I8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 57, 70])
def test_int8_head_equals_the_int8_linear(dtype, m):
    """The packed int8 head against the Int8LinearMethod path it replaces (linear_small_vnni for <= 8 rows,
    quantize_rows + torch._int_mm + dequant_rows above): the same quantization, exact int32 sums and the same
    fp32 epilogue, so the same bits; its fused argmax against torch.argmax of its logits."""
    from tokenmill.model.linear import Int8LinearMethod, Linear
    from tokenmill.model.lm_head import Int8PackedHead

    v, h = 4096 - 21, 256
    lin = Linear(h, v, dtype=dtype, method=Int8LinearMethod())
    lin.weight.data.copy_(torch.randn(v, h, generator=torch.Generator().manual_seed(5)) * 0.05)
    lin.method.process_weights_after_loading(lin)
    head = Int8PackedHead.build(lin)
    assert head is not None
    x = _x(m, h, seed=6).to(dtype)
    assert head.applies(x) == (m <= Int8PackedHead.MAX_ROWS)  # larger steps keep torch._int_mm (faster there)
    got = head.logits(x)
    assert got.dtype == dtype
    assert torch.equal(got, lin(x))
    assert torch.equal(head.logits(x[-1:]), got[-1:])
    assert torch.equal(head.greedy(x), got.argmax(dim=-1))


@_I8
@pytest.mark.parametrize("dtype,kv", [("bfloat16", "auto"), ("bfloat16", "int8"), ("float32", "auto")])
def test_engine_fused_greedy_int8(tiny_dir, dtype, kv):
    from tokenmill.model.lm_head import Int8PackedHead

    llm = LLM(str(tiny_dir), dtype=dtype, quantization="int8", kv_cache_dtype=kv, kv_cache_bytes="8MiB")
    assert isinstance(llm.engine.runner.model.packed_head, Int8PackedHead)
    _engine_compare(llm, PROMPTS)  # 4 sequences: steps within Int8PackedHead.MAX_ROWS
    llm.engine.kv.pool.reset_prefix_cache()
    _engine_compare(llm, MANY, logits_via_head=False)  # 13: the int8 GEMM + csrc/head_argmax.cpp above MAX_ROWS


def test_int8_head_without_the_kernel_stays_the_linear(tiny_dir, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LM_HEAD", "0")
    q = LLM(str(tiny_dir), dtype="bfloat16", quantization="int8", kv_cache_bytes="8MiB").engine.runner.model
    head = q.lm_head if q.lm_head is not None else q.tied_head
    assert q.packed_head is None and hasattr(head, "w8")  # the int8 Linear computes the logits
