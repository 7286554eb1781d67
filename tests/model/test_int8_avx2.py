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
