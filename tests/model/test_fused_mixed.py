"""The fused stack for steps with prefill chunks (csrc/mixed_stack.cpp via fused_mixed.py) against the module path.

The reference is the same engine with `model.fused_mixed = None` (every prefill / mixed step through the nn.Modules
in llama.py, which call the same kernels in the same order). Chunked prefill under a small token budget makes steps
that hold fresh prefills, chunks over cached context (earlier chunks and prefix-cache hits) and decodes together.
Greedy tokens and logprobs must be equal bit for bit (qk-norm models: within a tolerance, as in test_fused_decode)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.hardware import capabilities
from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.model.fused_mixed import FusedMixedStack
from tokenmill.model.linear import onednn_bf16

_k = get_kernels()
pytestmark = pytest.mark.skipif(_k is None or not _k.has_prefill_attention(),
                                reason="no C++ prefill attention on this machine")
needs_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="bf16 is emulated on this CPU: no fused bf16 stack")


def _int8_stack() -> bool:  # native int8 dot products, or the AVX2 exact int8 kernels (csrc/int8_gemm.cpp)
    from tokenmill.model.cpu_kernels import get_kernels
    from tokenmill.model.linear import avx2_int8_by_env

    k = get_kernels()
    return capabilities().native_int8 or (k is not None and k.has_avx2_int8() and avx2_int8_by_env())


needs_int8 = pytest.mark.skipif(not _int8_stack(), reason="no int8 GEMM on this CPU: no fused int8 stack")

# long prompts (several 48-token chunks), short ones (decoding while others prefill), a shared prefix (cache hit)
PROMPTS = [list(range(3, 120)), [7, 8, 9], list(range(40, 80)) + [5] * 30, [1000, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           list(range(3, 120)) + [17, 18, 19], [(31 * j) % 500 + 1 for j in range(70)]]


class _Counting:
    """Wraps a FusedMixedStack; counts its steps, and those with decode tokens beside the spans."""

    def __init__(self, inner: FusedMixedStack):
        self.inner, self.calls, self.with_decodes, self.max_tokens = inner, 0, 0, 0

    def applies(self, x, meta):
        return self.inner.applies(x, meta)

    def __call__(self, x, positions, rope, caches, meta):
        self.calls += 1
        self.with_decodes += int(meta.decode_token_idx is not None)
        self.max_tokens = max(self.max_tokens, x.shape[0])
        return self.inner(x, positions, rope, caches, meta)


def _run(llm: LLM, mixed, max_tokens=10):
    model = llm.engine.runner.model
    model.fused_mixed = mixed
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    res = llm.generate(PROMPTS, params)
    llm.engine.kv.pool.reset_prefix_cache()
    return ([r.outputs[0].token_ids for r in res],
            torch.tensor([[lp.logprob for lp in r.outputs[0].logprobs] for r in res]))


def _compare(llm: LLM, exact: bool):
    model = llm.engine.runner.model
    mixed = model.fused_mixed
    assert mixed is not None, "the fused mixed stack was not built for this model"
    counting = _Counting(mixed)
    got_t, got_lp = _run(llm, counting)
    ref_t, ref_lp = _run(llm, None)
    model.fused_mixed = mixed
    assert counting.calls > 0 and counting.with_decodes > 0, "no prefill step (with decodes beside) ran fused"
    assert counting.max_tokens > 8, "no step of more than 8 rows (oneDNN / int8 GEMM) ran fused"
    assert got_t == ref_t
    if exact:
        assert torch.equal(got_lp, ref_lp), (got_lp - ref_lp).abs().max()
    else:
        torch.testing.assert_close(got_lp, ref_lp, atol=2e-2, rtol=0)


def _llm(path, **kw):
    return LLM(str(path), kv_cache_bytes="8MiB", enable_prefix_caching=True, max_num_batched_tokens=48, **kw)


@pytest.mark.parametrize("dtype,quant,kv", [
    ("float32", "none", "auto"), pytest.param("bfloat16", "none", "auto", marks=needs_bf16),
    pytest.param("float32", "int8", "auto", marks=needs_int8),
    pytest.param("bfloat16", "int8", "int8", marks=[needs_bf16, needs_int8]), ("float32", "none", "bfloat16")])
def test_fused_mixed_equals_the_module_path(tiny_dir, dtype, quant, kv):
    _compare(_llm(tiny_dir, dtype=dtype, quantization=quant, kv_cache_dtype=kv), exact=True)


@needs_bf16
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama3", "tiny-mistral"])
def test_fused_mixed_on_other_architectures(model_dir, preset):
    """qkv bias (qwen2), llama3 rope and tied head, one kv head of 32 dims (mistral)."""
    _compare(_llm(model_dir(preset), dtype="bfloat16"), exact=True)


def test_fused_mixed_with_a_sliding_window(model_dir, tmp_path):
    """A Mistral with a 24-token window: prefill chunks and decodes attend to the window only, in both paths."""
    src = model_dir("tiny-mistral")
    dst = tmp_path / "swa"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = 24
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = _llm(dst, dtype="float32")
    assert llm.engine.runner.sliding_window == 24
    _compare(llm, exact=True)


def test_fused_mixed_with_qk_norm(model_dir):
    _compare(_llm(model_dir("tiny-qwen3"), dtype="float32"), exact=False)


def test_a_wrong_fused_mixed_stack_is_caught(tiny_dir):
    """The comparison above can fail: a final norm 1% off (shared with the decode stack: both paths' decode steps
    use it, only the prefill steps' hidden states differ) changes the first token's logprobs."""
    llm = _llm(tiny_dir, dtype="float32")
    model = llm.engine.runner.model
    model.fused_mixed = FusedMixedStack(model.fused)
    model.fused_mixed.stack = type(model.fused)(**{**_stack_kwargs(model.fused),
                                                   "final_norm": model.fused.final_norm * 1.01})
    with pytest.raises(AssertionError):
        _compare(llm, exact=True)


def _stack_kwargs(s):
    return dict(kernels=s.kernels, weights=s.weights, kinds=s.kinds, final_norm=s.final_norm, eps=s.eps, nh=s.nh,
                nkv=s.nkv, hd=s.hd, inter=s.inter, scale=s.scale, max_tokens=s.max_tokens)


def test_fused_mixed_off_by_env(monkeypatch, tiny_dir):
    monkeypatch.setenv("TOKENMILL_FUSED_MIXED", "0")
    model = LLM(str(tiny_dir), kv_cache_bytes="8MiB").engine.runner.model
    assert model.fused is not None and model.fused_mixed is None
    monkeypatch.setenv("TOKENMILL_FUSED_MIXED", "on")
    with pytest.raises(ValueError, match="TOKENMILL_FUSED_MIXED"):
        LLM(str(tiny_dir), kv_cache_bytes="8MiB")


def test_prefill_attention_off_means_the_modules(monkeypatch, tiny_dir):
    """TOKENMILL_PREFILL_ATTN=0 (the PyTorch attention path) keeps prefill steps on the modules."""
    llm = _llm(tiny_dir, dtype="float32")
    counting = _Counting(llm.engine.runner.model.fused_mixed)
    monkeypatch.setenv("TOKENMILL_PREFILL_ATTN", "0")
    _run(llm, counting)
    assert counting.calls == 0


@pytest.mark.parametrize("fused", [True, False])
def test_last_layer_pruned_to_the_sampled_rows(tiny_dir, fused):
    """Prefill steps: the last layer computes only the sampled rows past its attention (meta.logits_rows), in the
    fused stack and in the modules. Against the same engine computing every row (runner.prune_rows = False): the
    same greedy tokens, fp32 logprobs within 1e-4 (fewer rows may take another GEMM kernel: last-bit differences)."""
    llm = _llm(tiny_dir, dtype="float32")
    model = llm.engine.runner.model
    mixed = model.fused_mixed
    seen = []
    orig = type(model).forward

    def spy(self, input_ids, positions, kv_caches, meta):
        out = orig.__wrapped__(self, input_ids, positions, kv_caches, meta) if hasattr(orig, "__wrapped__") else \
            orig(self, input_ids, positions, kv_caches, meta)
        if meta.spans:
            seen.append((input_ids.shape[0], None if meta.logits_rows is None else meta.logits_rows.shape[0],
                         out.shape[0]))
        return out

    type(model).forward = spy
    try:
        got_t, got_lp = _run(llm, mixed if fused else None)
        pruned = list(seen)
        llm.engine.runner.prune_rows = False
        seen.clear()
        ref_t, ref_lp = _run(llm, mixed if fused else None)
    finally:
        type(model).forward = orig
        llm.engine.runner.prune_rows = True
    assert any(r is not None and r < t for t, r, _ in pruned), "no prefill step was pruned"
    assert all(o == (t if r is None else r) for t, r, o in pruned)
    assert all(r is None and o == t for t, r, o in seen)
    assert got_t == ref_t
    torch.testing.assert_close(got_lp, ref_lp, atol=1e-4, rtol=0)
