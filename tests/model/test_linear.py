"""The CPU linear paths (oneDNN-packed weights, the small-batch streaming kernel) against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.linear import Linear, PackedWeight


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 300])
def test_packed_weight_matches_f_linear_at_every_batch_size(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    packed = PackedWeight.maybe(w)
    if packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(rows, 96, generator=g)
    torch.testing.assert_close(packed(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96, generator=g)  # leading dims are kept
    torch.testing.assert_close(packed(x3, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


def test_linear_repacks_after_loading_and_keeps_its_answer(monkeypatch):
    lin = Linear(64, bias=True, shards=[("q", 32), ("k", 16)])
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(5, 64)
    want = F.linear(x, lin.weight, lin.bias)
    lin.method.process_weights_after_loading(lin)
    if lin.packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("TOKENMILL_ONEDNN", "0")  # the switch keeps plain F.linear
    lin.method.process_weights_after_loading(lin)
    assert lin.packed is None
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)


def test_onednn_row_buckets_give_the_unpadded_answer_and_match_the_fused_stacks_rule():
    """Calls of more than 256 rows run oneDNN at the row count rounded up to 64 (zero rows appended): the result is
    the product of the real rows (vs fp64); the C++ fused stacks use the same rule."""
    from tokenmill.model.cpu_kernels import get_kernels
    from tokenmill.model.row_buckets import onednn_rows

    pw = PackedWeight.maybe(w := torch.randn(48, 64))
    if pw is None:
        pytest.skip("no oneDNN prepacked linears here")
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    try:
        torch.ops.mkldnn._linear_pointwise = lambda x, *a: (seen.append(x.shape[0]), real(x, *a))[1]
        for m in (257, 300, 320, 333):
            x = torch.randn(m, 64)
            y = pw(x)
            assert y.shape == (m, 48)
            torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-4)
    finally:
        torch.ops.mkldnn._linear_pointwise = real
    assert seen == [320, 320, 320, 384]
    k = get_kernels()
    if k is not None:
        assert all(k.onednn_rows(m) == onednn_rows(m) for m in range(1, 3000, 7))
