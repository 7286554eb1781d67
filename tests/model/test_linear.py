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
