"""Row invariance of the bf16 linear kernels, which lossless speculation in bf16 rests on (linear.small_row_bits):
a row's result must not depend on how many rows share the call, within each kernel, and `small_row_bits` must
give any number of rows the small-row kernel's bits. The reference for each row is the kernel called on that row
with at most 8 rows (linear_small) or at the front of a 9-row call (oneDNN)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.hardware import capabilities
from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.model.linear import PackedWeight, amx_on, small_row_bits

pytestmark = pytest.mark.skipif(get_kernels() is None or not capabilities().native_bf16,
                                reason="no C++ CPU kernels / native bf16 on this machine")

SHAPES = [(768, 256), (256, 704), (4096, 256), (37, 64), (10, 96)]  # (N, K): the demo's projections and odd ones


def _small_rows(w, x, bias):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    for i in range(0, x.shape[0], 8):
        get_kernels().linear_small(y[i:i + 8], x[i:i + 8].contiguous(), w, bias)
    return y


def _amx() -> bool:
    return amx_on(get_kernels())


def _small_kernel_rows(pw, x, bias=None):
    """The reference for PackedWeight's small-row bits: on AMX machines each row alone through the AMX kernel,
    elsewhere linear_small over chunks of 8."""
    if pw.amx is None:
        return _small_rows(pw.weight, x, bias)
    y = torch.empty(x.shape[0], pw.weight.shape[0], dtype=x.dtype)
    for r in range(x.shape[0]):
        assert get_kernels().linear_amx_bf16(y[r:r + 1], x[r:r + 1].contiguous(), pw.amx, bias)
    return y


@pytest.mark.skipif(get_kernels() is None or not _amx(), reason="no AMX bf16 tiles on this machine")
@pytest.mark.parametrize("n,k", [(768, 256), (1408, 256), (256, 704), (4096, 256), (37, 64), (10, 96), (100, 320)])
def test_amx_linear_rows_are_the_one_row_bits_and_the_product(n, k):
    kern = get_kernels()
    g = torch.Generator().manual_seed(3 * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = (torch.randn(n, generator=g) * 0.1).bfloat16()
    packed = kern.lm_head_pack_bf16(w)
    x = torch.randn(40, k, generator=g).bfloat16()
    for bias in (None, b):
        one = torch.empty(40, n, dtype=torch.bfloat16)
        for r in range(40):
            assert kern.linear_amx_bf16(one[r:r + 1], x[r:r + 1].contiguous(), packed, bias)
        ref = x.double() @ w.double().t() + (b.double() if bias is not None else 0)
        assert (one.double() - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16 output rounding, fp32 sums
        for m in (2, 3, 5, 8, 9, 16, 17, 33, 40):  # 16 rows per tile pass, then a second pass
            y = torch.empty(m, n, dtype=torch.bfloat16)
            assert kern.linear_amx_bf16(y, x[:m].contiguous(), packed, bias)
            assert torch.equal(y, one[:m]), (m, n, k)
    assert not kern.linear_amx_bf16(torch.empty(3, n), torch.randn(3, k), packed, None)  # fp32: refused


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_rows_bf16_has_linear_smalls_bits_for_any_row_count(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = (torch.randn(n, generator=g) * 0.1).bfloat16()
    for m in (1, 4, 5, 9, 20, 63, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        for bias in (None, b):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            assert get_kernels().linear_rows_bf16(y, x, w, bias)
            assert torch.equal(y, _small_rows(w, x, bias)), (m, n, k)
    y = torch.empty(3, n, dtype=torch.float32)  # not bf16: refused, nothing written
    assert not get_kernels().linear_rows_bf16(y, torch.randn(3, k), w.float(), None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_weight_rows_do_not_depend_on_the_row_count(n, k):
    g = torch.Generator().manual_seed(7 + n)
    pw = PackedWeight(w := (torch.randn(n, k, generator=g) * 0.05).bfloat16())
    x = torch.randn(300, k, generator=g).bfloat16()
    small = _small_kernel_rows(pw, x)
    assert torch.equal(pw(x[:5]), small[:5])  # <= 8 rows: the small-row kernel itself (AMX / linear_small)
    for m in (9, 20, 64, 300):
        y = pw(x[:m])  # oneDNN: each row as at the front of a 9-row call
        for r in range(0, m, max(1, m // 6)):
            assert torch.equal(y[r], pw(torch.cat([x[r:r + 1], x[:8]]))[0]), (m, r)
        with small_row_bits(True):
            assert torch.equal(pw(x[:m]), small[:m])
    # the two kernels do differ (why the context exists; short sums may happen to agree). Not on AMX: oneDNN's
    # bf16 GEMM there runs AMX tiles too, and for these K (<= 704) gives the AMX kernel's bits at every row count
    # (measured; from K = 1024 on it splits K above ~16 rows and differs)
    if k >= 256 and pw.amx is None:
        assert not torch.equal(pw(x[:300]), small)


@pytest.mark.skipif(get_kernels() is None or not _amx(), reason="no AMX bf16 tiles on this machine")
def test_amx_switch_and_row_limit():
    """TOKENMILL_AMX=0 keeps the AVX-512 small-row kernels (limit 8 rows); on, bf16 linears take AMX up to
    amx_rows() rows and the model-wide limit is that; a value other than 0/1 is an error naming the variable."""
    import subprocess
    import sys

    from tokenmill.model.linear import small_row_limit

    pw = PackedWeight((torch.randn(64, 64) * 0.05).bfloat16())
    assert pw.amx is not None and pw.small_limit == get_kernels().amx_rows() > 8
    assert small_row_limit(torch.nn.Module()) == PackedWeight.SMALL_ROWS  # no linears: the plain limit
    code = ("import torch; from tokenmill.model.linear import PackedWeight; "
            "pw = PackedWeight(torch.randn(64, 64).bfloat16()); print(pw.amx is None, pw.small_limit)")
    for env, expect in (("0", "True 8"), ("1", f"False {get_kernels().amx_rows()}")):
        out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "TOKENMILL_AMX": env},
                             capture_output=True, text=True, timeout=300)
        assert out.stdout.split() == expect.split(), out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "TOKENMILL_AMX": "yes"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "TOKENMILL_AMX" in out.stderr


def test_linear_rows_bf16_keeps_denormal_outputs_as_linear_small_does():
    """The 4x4 tile's vector epilogue (vcvtneps2bf16 flushes denormals) hands denormal sums to the scalar
    conversion: zero weights and a denormal bias give the bias back, the bits linear_small gives."""
    n, k = 64, 64
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    b = torch.full((n,), 1e-39).bfloat16()
    assert 0 < b[0].float().abs() < torch.finfo(torch.float32).tiny  # a denormal
    x = torch.randn(16, k).bfloat16()
    y = torch.empty(16, n, dtype=torch.bfloat16)
    assert get_kernels().linear_rows_bf16(y, x, w, b)
    assert torch.equal(y, _small_rows(w, x, b)) and torch.equal(y, b.expand(16, n))
