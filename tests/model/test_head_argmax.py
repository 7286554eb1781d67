"""csrc/head_argmax.cpp: the int8 head's greedy token at more than 8 rows (torch._int_mm's int32 result through
dequant_rows' epilogue and argmax_rows' comparison, without writing the logits) against the path it replaces,
dequant_rows into logits of the model's dtype + argmax_rows (and torch.argmax), exactly: ties inside a 16-lane
vector, across vectors and across the threads' rows, a vocabulary that is not a multiple of 16, NaN columns
(argmax_rows: the first NaN), at 1 and 2 threads; then Int8PackedHead.greedy at 9-70 rows against the int8 Linear."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.cpu_kernels import get_kernels

_K = get_kernels()
pytestmark = pytest.mark.skipif(_K is None or not hasattr(_K, "head_argmax_int8"), reason="no C++ CPU kernels")


def _reference(acc, sx, sw, dtype):
    logits = torch.empty(acc.shape, dtype=dtype)
    _K.dequant_rows(logits, acc, sx, sw, None)
    out = torch.empty(acc.shape[0], dtype=torch.long)
    _K.argmax_rows(out, logits)
    assert torch.equal(out, logits.float().argmax(dim=-1)) or torch.isnan(logits.float()).any()
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", [(9, 32000), (33, 1000 + 7), (64, 4096), (70, 15)])
def test_equals_dequant_rows_then_argmax_rows(threads, dtype, m, n):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * 7 + n)
        acc = torch.randint(-200000, 200000, (m, n), generator=g, dtype=torch.int32)
        sx = torch.rand(m, generator=g) * 1e-3 + 1e-5
        sw = torch.rand(n, generator=g) * 1e-3 + 1e-5
        # exact ties at each row's maximum: copies of the row's best column at later indices (inside the same
        # 16-lane vector, in a later vector, and in the scalar tail where there is one)
        for r in range(m):
            best = int(acc[r].argmax())
            for j in {min(n - 1, best + 1), min(n - 1, best + 17), n - 1, (best * 5 + r) % n}:
                acc[r, j] = acc[r, best]
                sw[j] = sw[best] if r == 0 else sw[j]
        # bf16 rounding makes near-ties exact ties: many columns with nearly equal values
        acc[1, : n // 2] = acc[1].max()
        out = torch.empty(m, dtype=torch.long)
        _K.head_argmax_int8(out, acc, sx, sw, dtype == torch.bfloat16)
        assert torch.equal(out, _reference(acc, sx, sw, dtype))
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_columns_give_the_first_nan(dtype):
    g = torch.Generator().manual_seed(1)
    m, n = 12, 300
    acc = torch.randint(-1000, 1000, (m, n), generator=g, dtype=torch.int32)
    sx = torch.rand(m, generator=g) + 0.1
    sw = torch.rand(n, generator=g) + 0.1
    sw[37] = float("nan")
    sw[290] = float("nan")
    out = torch.empty(m, dtype=torch.long)
    _K.head_argmax_int8(out, acc, sx, sw, dtype == torch.bfloat16)
    assert torch.equal(out, _reference(acc, sx, sw, dtype))
    assert (out == 37).all()


def test_layout_errors_are_clear():
    acc = torch.zeros(3, 16, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out \\[M\\] int64"):
        _K.head_argmax_int8(torch.empty(2, dtype=torch.long), acc, torch.ones(3), torch.ones(16), True)
    with pytest.raises(RuntimeError, match="acc \\[M, N\\] int32"):
        _K.head_argmax_int8(torch.empty(3, dtype=torch.long), acc.float(), torch.ones(3), torch.ones(16), True)


@pytest.mark.skipif(_K is None or not _K.has_lm_head_int8(), reason="the int8 head kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [9, 16, 33, 64, 70])
def test_int8_head_greedy_above_eight_rows_equals_the_int8_linear(dtype, m):
    from tokenmill.model.linear import Int8LinearMethod, Linear
    from tokenmill.model.lm_head import Int8PackedHead

    v, h = 4096 - 21, 256
    lin = Linear(h, v, dtype=dtype, method=Int8LinearMethod())
    lin.weight.data.copy_(torch.randn(v, h, generator=torch.Generator().manual_seed(5)) * 0.05)
    lin.weight.data[100] = lin.weight.data[3000]  # tied vocabulary rows: exact logit ties
    tied = lin.weight.data[3000].clone()
    lin.method.process_weights_after_loading(lin)
    head = Int8PackedHead.build(lin)
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(m)).to(dtype)
    x[0] = tied.to(dtype) * 40  # row 0's maximum at the tied pair: the first (100) wins
    assert not head.applies(x) and head.applies_greedy(x)
    ref = torch.empty(m, dtype=torch.long)
    _K.argmax_rows(ref, lin(x))
    got = head.greedy(x)
    assert torch.equal(got, ref)
    assert int(got[0]) == 100
