"""The compiled CPU decode kernel against the PyTorch paged-attention path (and both against dense SDPA)."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model import attention
from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.cpu_kernels import get_kernels


def dense_reference(q, keys, vals, ctx, window, scale):
    # q: [nh, hd]; keys/vals: [ctx, kvh, hd] -> [nh, hd]
    nh, kvh = q.shape[0], keys.shape[1]
    k = keys.repeat_interleave(nh // kvh, dim=1).transpose(0, 1)  # [nh, ctx, hd]
    v = vals.repeat_interleave(nh // kvh, dim=1).transpose(0, 1)
    mask = torch.ones(ctx, dtype=torch.bool)
    if window:
        mask[: max(0, ctx - window)] = False
    return F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=mask[None, None], scale=scale)[:, 0]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("kvh, nh, hd", [(2, 6, 16), (2, 2, 64), (1, 8, 64), (2, 8, 24), (2, 4, 40), (2, 4, 64)])
def test_decode_paths_match_dense(monkeypatch, window, use_kernel, kvh, nh, hd):  # query heads per kv head 1-8
    if use_kernel and get_kernels() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    if not use_kernel:
        monkeypatch.setattr(attention, "_cpu_kernels", lambda q, c: None)
    g = torch.Generator().manual_seed(0)
    nb, bs = 20, 4
    cache = torch.randn(2, nb, kvh, bs, hd, generator=g)
    lens = [1, 7, 13]
    tables = [[3], [5, 9], [0, 2, 11, 19]]
    d = len(lens)
    q = torch.randn(d, nh, hd, generator=g)
    k_new = torch.randn(d, kvh, hd, generator=g)
    v_new = torch.randn(d, kvh, hd, generator=g)
    slots = torch.tensor([tables[i][(lens[i] - 1) // bs] * bs + (lens[i] - 1) % bs for i in range(d)])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(slot_mapping=slots, spans=[], decode_token_idx=torch.arange(d),
                             decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             decode_ctx_lens=torch.tensor(lens), sliding_window=window)
    out = paged_attention(q, k_new, v_new, cache, meta, scale=0.25)
    for i in range(d):
        rows = torch.tensor([tables[i][t // bs] * bs + t % bs for t in range(lens[i])])
        keys = cache[0].transpose(1, 2).reshape(-1, kvh, hd)[rows]  # [ctx, kvh, hd]
        vals = cache[1].transpose(1, 2).reshape(-1, kvh, hd)[rows]
        ref = dense_reference(q[i], keys, vals, lens[i], window, 0.25)
        assert torch.allclose(out[i], ref, atol=1e-5), i
    assert torch.equal(cache[0].transpose(1, 2).reshape(-1, kvh, hd)[slots], k_new)  # new K/V written first
