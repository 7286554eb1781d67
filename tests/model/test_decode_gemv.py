"""csrc/decode_gemv.cpp: the W8A8 GEMV for <= 8 rows that linear_small_vnni (and through it the int8 modules and
the fused decoder stack) calls first.

The reference is the int8 GEMM path's product computed independently: quantize_rows, exact int32 sums by a
torch.mm over int64, then dequant_rows (the engine's _int_mm path uses the same two C++ ends). Integer sums are exact
in any order, and the epilogue is the same fp32 operations, so the results must be equal bit for bit. The engine
checks compare the whole model with the kernel on and off (`set_decode_gemv`: linear_small_vnni's own loop)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.hardware import capabilities
from tokenmill.model import cpu_kernels
from tokenmill.model.cpu_kernels import get_kernels

kernels = get_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.has_vnni_small(),
                                reason="no AVX-512 VNNI build here (the GEMV is not compiled in)")


def _reference(x, w8, sw, b):
    rows, k = x.shape
    q, sx = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows)
    kernels.quantize_rows(q, sx, x)
    acc = torch.mm(q.long(), w8.long().t()).int()  # exact, independent of any int8 kernel
    ref = torch.empty(rows, w8.shape[0], dtype=x.dtype)
    kernels.dequant_rows(ref, acc, sx, sw, b)
    return ref


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k,n,bias", [(64, 16, True), (128, 48, False), (512, 1024, False), (1408, 512, True),
                                      (192, 2816, False)])
def test_gemv_equals_the_int8_gemm_product(threads, dtype, rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    if rows > 2:
        x[1] = 0  # an all-zero row (scale 1)
        x[2, 5] = 1e4  # one large outlier: most of the row quantizes to 0
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w8[0] = 127  # extreme sums
    sw = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    applied = kernels.vnni_gemv(out, x, w8, w8.sum(1, dtype=torch.int32), sw, b)
    if rows > 4 and threads == 1:  # by design: linear_small_vnni's loop is faster there
        assert not applied and out.isnan().all()
        return
    assert applied
    ref = _reference(x, w8, sw, b)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    assert not torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("rows,k,n", [(1, 64, 37), (1, 100, 64), (9, 64, 64), (2, 16384, 16)])
def test_gemv_refuses_shapes_it_does_not_take(rows, k, n):
    """N not a multiple of 16, K not a multiple of 64, more than 8 rows, K past its stack buffer: False, nothing
    written (linear_small_vnni then runs its own loop, or the caller another path)."""
    x = torch.randn(rows, k)
    w8 = torch.ones(n, k, dtype=torch.int8)
    out = torch.full((rows, n), 7.0)
    assert not kernels.vnni_gemv(out, x, w8, w8.sum(1, dtype=torch.int32), torch.ones(n), None)
    assert (out == 7).all()


def test_the_switch_turns_it_off_and_the_old_loop_gives_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=g).bfloat16()
    w8 = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=g)
    ws, sw = w8.sum(1, dtype=torch.int32), torch.rand(96, generator=g) * 0.01
    new, old = torch.empty(3, 96, dtype=torch.bfloat16), torch.empty(3, 96, dtype=torch.bfloat16)
    kernels.linear_small_vnni(new, x, w8, ws, sw, None)
    assert kernels.set_decode_gemv(False) is True
    try:
        assert not kernels.vnni_gemv(torch.empty(3, 96, dtype=torch.bfloat16), x, w8, ws, sw, None)
        kernels.linear_small_vnni(old, x, w8, ws, sw, None)
    finally:
        kernels.set_decode_gemv(True)
    assert torch.equal(new, old)


def test_a_bad_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv("TOKENMILL_DECODE_GEMV", "yes")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with pytest.raises(ValueError, match="TOKENMILL_DECODE_GEMV"):
        cpu_kernels.get_kernels()


@pytest.mark.skipif(not capabilities().native_int8, reason="int8 is emulated on this CPU")
@pytest.mark.parametrize("preset,dtype,kv", [("tiny", "float32", "auto"), ("tiny", "bfloat16", "int8"),
                                             ("tiny-qwen2", "bfloat16", "auto")])
def test_engine_tokens_and_logprobs_equal_with_the_gemv_on_and_off(model_dir, preset, dtype, kv):
    """int8 W8A8 engines (fused stack and modules both call linear_small_vnni) at batch 1 and 4: the same greedy
    tokens and bit-equal logprobs with the GEMV and with linear_small_vnni's own loop."""
    from tokenmill import LLM, SamplingParams

    if dtype == "bfloat16" and not capabilities().native_bf16:
        pytest.skip("bf16 is emulated on this CPU")
    llm = LLM(str(model_dir(preset)), dtype=dtype, quantization="int8", kv_cache_dtype=kv, kv_cache_bytes="8MiB")
    lin = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    probe = torch.randn(1, lin.in_features).to(lin.w_scale.device, llm.engine.dtype)
    assert kernels.vnni_gemv(torch.empty(1, lin.out_features, dtype=llm.engine.dtype), probe, lin.w8, lin.w8_sum,
                             lin.w_scale, None), "the model's linears are not shapes the GEMV takes: test is vacuous"
    prompts = [[5, 17, 300, 42, 9, 11], [7, 8, 9], list(range(40, 80)), [100, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(on, ps):
        kernels.set_decode_gemv(on)
        try:
            res = llm.generate(ps, params)
        finally:
            kernels.set_decode_gemv(True)
        llm.engine.kv.pool.reset_prefix_cache()
        return ([r.outputs[0].token_ids for r in res],
                torch.tensor([[lp.logprob for lp in r.outputs[0].logprobs] for r in res]))

    for ps in (prompts[:1], prompts):
        (t_new, lp_new), (t_old, lp_old) = run(True, ps), run(False, ps)
        assert t_new == t_old
        assert torch.equal(lp_new, lp_old)
