"""The AVX2 exact int8 kernels (csrc/int8_gemm.cpp): W8A8 with exact int32 sums, the same bits as quantize_rows +
an int32 reference product (q.int() @ w.int().t()) + dequant_rows, for any row count and K."""

import pytest
import torch

from tokenmill.model.cpu_kernels import get_kernels

K_MOD = get_kernels()
pytestmark = pytest.mark.skipif(K_MOD is None or not K_MOD.has_avx2_int8(), reason="no AVX2 int8 kernels here")


def _quant_w(n, k, gen):
    w = torch.randn(n, k, generator=gen)
    s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8), s


def _reference(x, w8, sw, bias):
    """quantize_rows + exact int32 product (int64 matmul, checked to fit int32) + dequant_rows."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    sx = torch.empty(m, dtype=torch.float32)
    K_MOD.quantize_rows(q, sx, x)
    acc = q.long() @ w8.long().t()
    assert acc.abs().max() < 2 ** 31
    out = torch.empty(m, w8.shape[0], dtype=x.dtype)
    K_MOD.dequant_rows(out, acc.int().contiguous(), sx, sw, bias)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (9, 48, 32), (16, 768, 512), (37, 40, 30), (64, 512, 1408),
                                   (100, 2816, 512), (7, 24, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_bit_exact(dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w8, sw = _quant_w(n, k, gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, : min(k, 5)] = 0  # a few zeros, and one all-zero row (scale 1)
    if m > 2:
        x[2] = 0
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    panels = K_MOD.avx2_int8_pack(w8)
    out = torch.empty(m, n, dtype=dtype)
    K_MOD.avx2_int8_gemm(out, x, panels, sw, bias)
    assert torch.equal(out, _reference(x, w8, sw, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(8, 16), (768, 512), (512, 1408), (2816, 512)])
def test_gemv_bit_exact_and_same_bits_as_gemm(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w8, sw = _quant_w(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    assert K_MOD.avx2_int8_gemv(out, x, w8, sw, bias)
    assert torch.equal(out, _reference(x, w8, sw, bias))
    big = torch.empty(m, n, dtype=dtype)
    K_MOD.avx2_int8_gemm(big, x, K_MOD.avx2_int8_pack(w8), sw, bias)
    assert torch.equal(out, big)  # row-count invariant: a decode row has the same bits in any batch


def test_extreme_sums_exact_past_fp32s_exact_range():
    """All-max operands: |sum| = 127*127*K. For K = 1408 (the demo model's down_proj) partial sums pass 2^24, past
    which fp32 accumulation (the dequantize-then-fp32 fallback) is no longer exact for odd sums; int32 is."""
    k, n = 1408, 16
    w8 = torch.full((n, k), 127, dtype=torch.int8)
    w8[1::2] = -127
    w8[2, 1] = 126  # an odd total, not representable in fp32 above 2^24
    x = torch.ones(3, k)
    x[1] = -1
    x[2, 1::2] = -1
    sw = torch.ones(n)
    out = torch.empty(3, n)
    K_MOD.avx2_int8_gemm(out, x, K_MOD.avx2_int8_pack(w8), sw, None)
    assert torch.equal(out, _reference(x, w8, sw, None))
    assert 127 * 127 * k > 2 ** 24
    gemv = torch.empty(3, n)
    assert K_MOD.avx2_int8_gemv(gemv, x, w8, sw, None)
    assert torch.equal(gemv, out)


def test_gemv_declines_shapes_it_does_not_take():
    w8 = torch.zeros(12, 32, dtype=torch.int8)  # N % 8 != 0
    assert not K_MOD.avx2_int8_gemv(torch.empty(1, 12), torch.randn(1, 32), w8, torch.ones(12), None)
    w8 = torch.zeros(16, 40, dtype=torch.int8)  # K % 16 != 0
    assert not K_MOD.avx2_int8_gemv(torch.empty(1, 16), torch.randn(1, 40), w8, torch.ones(16), None)
    assert not K_MOD.avx2_int8_gemv(torch.empty(9, 16), torch.randn(9, 32), torch.zeros(16, 32, dtype=torch.int8),
                                    torch.ones(16), None)


def test_bad_input_is_refused():
    w8 = torch.zeros(16, 32, dtype=torch.int8)
    panels = K_MOD.avx2_int8_pack(w8)
    with pytest.raises(RuntimeError, match="panels"):
        K_MOD.avx2_int8_gemm(torch.empty(2, 16), torch.randn(2, 34), panels, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="out"):
        K_MOD.avx2_int8_gemm(torch.empty(2, 15), torch.randn(2, 32), panels, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="int8"):
        K_MOD.avx2_int8_pack(torch.zeros(4, 4))


# ---- the vpmaddubsw GEMV (|w| as u8 times x * sign(w) as s8) and the AVX2 int8 head fused with the argmax ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(8, 32), (768, 512), (512, 1408), (40, 64)])
def test_u8_gemv_same_bits_as_the_reference_and_the_i16_kernel(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 13 + n + k)
    w8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too (a checkpoint may hold it)
    sw = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    prev = K_MOD.set_avx2_int8_u8(True)
    try:
        out = torch.empty(m, n, dtype=dtype)
        assert K_MOD.avx2_int8_gemv(out, x, w8, sw, bias)
        K_MOD.set_avx2_int8_u8(False)
        old = torch.empty(m, n, dtype=dtype)
        assert K_MOD.avx2_int8_gemv(old, x, w8, sw, bias)
    finally:
        K_MOD.set_avx2_int8_u8(prev)
    assert torch.equal(out, _reference(x, w8, sw, bias))
    assert torch.equal(out, old)


@pytest.mark.parametrize("wval", [127, -127, -128])
def test_u8_gemv_extreme_pairs_do_not_saturate(wval):
    """vpmaddubsw adds two u8*s8 products in saturating int16: with |w| <= 128 and |q| <= 127 a pair is at most
    2 * 128 * 127 = 32512 < 32767. All-extreme operands reach it in every pair (and 127*127*K past 2^24)."""
    k, n = 1408, 16
    w8 = torch.full((n, k), wval, dtype=torch.int8)
    w8[1::2] = -wval if wval != -128 else 127
    x = torch.ones(3, k)  # quantizes to +-127 exactly
    x[1] = -1
    x[2, 1::2] = -1
    q = torch.empty(3, k, dtype=torch.int8)
    K_MOD.quantize_rows(q, torch.empty(3), x)
    assert q.abs().max() == 127 and (q != -128).all()  # the quantizer never produces -128
    sw = torch.ones(n)
    out = torch.empty(3, n)
    assert K_MOD.avx2_int8_gemv(out, x, w8, sw, None)
    assert torch.equal(out, _reference(x, w8, sw, None))
    s = torch.tensor(1.0) / 127  # the row's scale (max|x| / 127), fp32
    assert out[0, 0] == torch.tensor(float(wval * 127 * k)) * s  # every pair at its extreme, summed exactly


def test_pack8_layout_is_the_gemv_read_order():
    """[N/8, K/32, 8, 32]: per block of 8 rows, the 32-byte k-chunks of its rows in turn (an independent index map)."""
    n, k = 24, 96
    w8 = torch.arange(n * k, dtype=torch.int64).remainder(251).sub(125).to(torch.int8).view(n, k)
    p = K_MOD.avx2_int8_pack8(w8)
    assert p.shape == (n // 8, k // 32, 8, 32) and p.dtype == torch.int8 and p.is_contiguous()
    flat = p.flatten()
    for row in range(n):
        for col in range(k):
            b, i, c, j = row // 8, row % 8, col // 32, col % 32
            assert flat[((b * (k // 32) + c) * 8 + i) * 32 + j] == w8[row, col]
    with pytest.raises(RuntimeError, match="pack8"):
        K_MOD.avx2_int8_pack8(torch.zeros(12, 32, dtype=torch.int8))  # N % 8 != 0
    with pytest.raises(RuntimeError, match="pack8"):
        K_MOD.avx2_int8_pack8(torch.zeros(16, 48, dtype=torch.int8))  # K % 32 != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(8, 32), (768, 512), (512, 1408), (2816, 512), (40, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemv_and_head_same_bits_as_the_plain_weight(dtype, m, n, k, threads):
    gen = torch.Generator().manual_seed(m * 7 + n + k + threads)
    w8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    sw = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    p = K_MOD.avx2_int8_pack8(w8)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain, packed = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
        assert K_MOD.avx2_int8_gemv(plain, x, w8, sw, bias) and K_MOD.avx2_int8_gemv(packed, x, p, sw, bias)
        tp, tk = torch.empty(m, dtype=torch.long), torch.empty(m, dtype=torch.long)
        assert K_MOD.avx2_int8_head_argmax(tp, x, w8, sw) and K_MOD.avx2_int8_head_argmax(tk, x, p, sw)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(packed, _reference(x, w8, sw, bias)) and torch.equal(packed, plain)
    assert torch.equal(tk, tp)


def test_packed_gemv_declines_and_refuses():
    w8 = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    p = K_MOD.avx2_int8_pack8(w8)
    out9 = torch.empty(9, 16)
    assert not K_MOD.avx2_int8_gemv(out9, torch.randn(9, 64), p, torch.ones(16), None)  # more than 8 rows
    prev = K_MOD.set_avx2_int8_u8(False)  # the i16 kernel reads the plain layout only: the caller takes the GEMM
    try:
        assert not K_MOD.avx2_int8_gemv(torch.empty(1, 16), torch.randn(1, 64), p, torch.ones(16), None)
    finally:
        K_MOD.set_avx2_int8_u8(prev)
    with pytest.raises(RuntimeError, match="w8"):  # K of x does not match the packed weight's
        K_MOD.avx2_int8_gemv(torch.empty(1, 16), torch.randn(1, 32), p, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="w8"):
        K_MOD.avx2_int8_gemv(torch.empty(1, 16), torch.randn(1, 64), p.view(2, 2, 16, 16), torch.ones(16), None)


def test_int8_linear_streams_the_packed_weight():
    """Int8LinearMethod on this CPU keeps the GEMV's copy in read order (where N % 8 == 0 and K % 32 == 0) and
    its outputs equal the plain weight's, for <= 8 rows (the GEMV) and more (the GEMM)."""
    from tokenmill.hardware import capabilities
    from tokenmill.model.linear import Int8LinearMethod, Linear

    if capabilities().native_int8:
        pytest.skip("native int8: the VNNI / oneDNN paths, not the AVX2 kernels")
    torch.manual_seed(0)
    lin = Linear(512, 768, bias=False, method=Int8LinearMethod())
    with torch.no_grad():
        lin.weight.copy_(torch.randn(768, 512))
    lin.method.process_weights_after_loading(lin)
    assert lin.w8_gemv.shape == (96, 16, 8, 32)
    assert torch.equal(lin.w8_gemv, lin.w8.view(96, 8, 16, 32).permute(0, 2, 1, 3))
    for m in (1, 8, 9):
        x = torch.randn(m, 512)
        ref = torch.empty(m, 768)
        assert K_MOD.avx2_int8_gemv(ref, x, lin.w8, lin.w_scale, None) if m <= 8 else True
        if m > 8:
            K_MOD.avx2_int8_gemm(ref, x, lin.avx2_panels, lin.w_scale, None)
        assert torch.equal(lin(x), ref)
    # no [K, N] copy for torch._int_mm on this path; the PyTorch fallback (an fp16 input: no kernel takes it)
    # computes the same W8A8 product from w8
    assert lin.w8_t is None
    x = torch.randn(3, 512).half()
    want = torch.empty(3, 768)
    K_MOD.avx2_int8_gemv(want, x.float(), lin.w8, lin.w_scale, None)  # exact fp32 sums (127 * 127 * 512 < 2^24)
    torch.testing.assert_close(lin(x).float(), want.half().float(), rtol=1e-3, atol=1e-3)  # the fp16 rounding


def _head_case(v, k, m, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w8 = torch.randint(-127, 128, (v, k), generator=gen, dtype=torch.int8)
    sw = torch.rand(v, generator=gen) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=gen).to(dtype)
    return w8, sw, x


def _gemv_argmax(x, w8, sw):
    logits = torch.empty(x.shape[0], w8.shape[0], dtype=x.dtype)
    assert K_MOD.avx2_int8_gemv(logits, x, w8, sw, None)
    return logits, logits.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_head_argmax_equals_argmax_of_the_gemv_logits(dtype, m, threads):
    w8, sw, x = _head_case(4000, 512, m, dtype, m + threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tok = torch.empty(m, dtype=torch.long)
        assert K_MOD.avx2_int8_head_argmax(tok, x, w8, sw)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(tok, _gemv_argmax(x, w8, sw)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_argmax_ties_nan_and_inf(dtype):
    """torch.argmax's rules on the stored logits: the first index of the maximum (ties inside a block, across
    blocks and across the threads' ranges; in bf16 values that only tie after rounding), the first NaN if any."""
    v, k = 4096, 64
    w8, sw, x = _head_case(v, k, 4, dtype, 3)
    w8[:] = w8[0]  # every row the same weights: logits differ only by their scale
    sw[:] = 0.01
    sw[3000] = sw[5] = sw[2049] = 0.02  # the maximum (for rows with positive sums) at 5, 2049, 3000: the first wins
    sw[7] = 0.02 * (1 + 2 ** -12)  # larger in fp32, the same value after bf16 rounding
    tok = torch.empty(4, dtype=torch.long)
    assert K_MOD.avx2_int8_head_argmax(tok, x, w8, sw)
    logits, ref = _gemv_argmax(x, w8, sw)
    assert torch.equal(tok, ref)
    sw[1234] = float("nan")
    sw[3333] = float("nan")
    sw[100] = float("inf")
    assert K_MOD.avx2_int8_head_argmax(tok, x, w8, sw)
    logits, ref = _gemv_argmax(x, w8, sw)
    assert logits.isnan().any() and torch.equal(tok, ref)


def test_head_argmax_all_negative_infinity_rows():
    v, k = 64, 32
    w8 = torch.full((v, k), 1, dtype=torch.int8)
    sw = torch.full((v,), float("inf"))
    x = -torch.ones(2, k)
    tok = torch.empty(2, dtype=torch.long)
    assert K_MOD.avx2_int8_head_argmax(tok, x, w8, sw)
    logits, ref = _gemv_argmax(x, w8, sw)
    assert (logits == float("-inf")).all() and torch.equal(tok, ref) and tok.tolist() == [0, 0]


def test_head_argmax_declines_and_refuses():
    tok = torch.empty(1, dtype=torch.long)
    assert not K_MOD.avx2_int8_head_argmax(tok, torch.randn(1, 48), torch.zeros(16, 48, dtype=torch.int8),
                                           torch.ones(16))  # K % 32 != 0
    assert not K_MOD.avx2_int8_head_argmax(tok, torch.randn(1, 32), torch.zeros(12, 32, dtype=torch.int8),
                                           torch.ones(12))  # N % 8 != 0
    tok9 = torch.empty(9, dtype=torch.long)
    assert not K_MOD.avx2_int8_head_argmax(tok9, torch.randn(9, 32), torch.zeros(16, 32, dtype=torch.int8),
                                           torch.ones(16))  # more than 8 rows
    with pytest.raises(RuntimeError, match="tokens"):
        K_MOD.avx2_int8_head_argmax(torch.empty(2, dtype=torch.long), torch.randn(1, 32),
                                    torch.zeros(16, 32, dtype=torch.int8), torch.ones(16))
    with pytest.raises(RuntimeError, match="w8"):
        K_MOD.avx2_int8_head_argmax(tok, torch.randn(1, 32), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_through_the_avx2_head_equals_the_logits_path(tiny_dir, dtype):
    """On a CPU without int8 dot products the int8 model's head is Avx2Int8Head: all-greedy steps of <= 8 rows take
    its fused argmax, and give the tokens of the logits path (greedy with logprobs, which writes the logits)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import capabilities
    from tokenmill.model.lm_head import Avx2Int8Head

    if capabilities().native_int8:
        pytest.skip("native int8: the VNNI head (Int8PackedHead) runs there")
    llm = LLM(str(tiny_dir), dtype=dtype, quantization="int8", kv_cache_bytes="8MiB")
    model = llm.engine.runner.model
    head = model.packed_head
    assert isinstance(head, Avx2Int8Head)
    calls = {"greedy": 0}
    inner = head.greedy

    def counted(h):
        calls["greedy"] += 1
        return inner(h)

    head.greedy = counted
    prompts = [[5, 17, 300, 42, 9, 11], [7, 8, 9], list(range(40, 80)), [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    fused = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert calls["greedy"] > 0
    llm.engine.kv.pool.reset_prefix_cache()
    n = calls["greedy"]
    with_logits = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))
    assert calls["greedy"] == n  # logprobs: the logits path
    assert [r.outputs[0].token_ids for r in fused] == [r.outputs[0].token_ids for r in with_logits]
    h = torch.randn(3, model.cfg.hidden_size).to(getattr(torch, dtype))
    assert torch.equal(head.greedy(h), model.compute_logits(h, float32=False).argmax(-1))


def test_avx2_head_off_with_the_env_switches(tiny_dir, monkeypatch):
    from tokenmill import LLM
    from tokenmill.hardware import capabilities

    if capabilities().native_int8:  # VNNI / AMX machines take the VNNI int8 head, which these switches do not govern
        pytest.skip("the AVX2 int8 head is used only where int8 dot products are not native")

    monkeypatch.setenv("TOKENMILL_AVX2_INT8", "0")
    assert LLM(str(tiny_dir), quantization="int8", kv_cache_bytes="8MiB").engine.runner.model.packed_head is None
    monkeypatch.setenv("TOKENMILL_AVX2_INT8", "1")
    monkeypatch.setenv("TOKENMILL_LM_HEAD", "0")
    assert LLM(str(tiny_dir), quantization="int8", kv_cache_bytes="8MiB").engine.runner.model.packed_head is None
