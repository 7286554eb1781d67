"""model/invariant.py: the fixed-tile math of `--batch-invariant on` on CUDA, checked on the CPU: the attention
against PyTorch's SDPA, a row's bits against the same row in other steps (row counts, table widths, padding),
the tiling of linears / norms / the head, and an engine step through it."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model import invariant
from tokenmill.model.invariant import by_row_tiles, decode_attention, fixed_tiles


def _cache(nb=40, kvh=2, bs=16, hd=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nb, kvh, bs, hd, generator=g).to(dtype), torch.randn(nb, kvh, bs, hd, generator=g).to(dtype))


def _rows(d, nh, hd, ctxs, nb, bs, dtype=torch.float32, seed=1, width=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, nh, hd, generator=g).to(dtype)
    w = width or max(-(-c // bs) for c in ctxs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:w] for _ in range(d)])
    return q, tables, torch.tensor(ctxs)


def _reference(q, kc, vc, tables, ctxs, scale, window=None):
    out = []
    bs = kc.shape[2]
    for i in range(q.shape[0]):
        c = int(ctxs[i])
        blk = tables[i, : -(-c // bs)]
        k = kc[blk].permute(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[3])[:, :c].float()
        v = vc[blk].permute(1, 0, 2, 3).reshape(vc.shape[1], -1, vc.shape[3])[:, :c].float()
        mask = None
        if window is not None:
            mask = (torch.arange(c) >= c - window)[None, None, :]
        o = F.scaled_dot_product_attention(q[i, :, None].float()[None], k[None], v[None], attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 40])
def test_decode_attention_matches_sdpa(window):
    kc, vc = _cache()
    ctxs = [1, 5, 16, 17, 255, 256, 257, 300, 511, 600, 33]
    q, tables, lens = _rows(len(ctxs), 4, 32, ctxs, 40, 16)
    got = decode_attention(q, kc, vc, tables, lens, 0.17, window)
    ref = _reference(q, kc, vc, tables, lens, 0.17, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_step(dtype):
    """The same query row (same context, same blocks) alone, among 37 rows, and with a wider block table (more key
    blocks iterated: exact no-ops for it): identical bits."""
    kc, vc = _cache(dtype=dtype)
    ctxs = [7 + 13 * i for i in range(37)]
    q, tables, lens = _rows(37, 4, 32, ctxs, 40, 16, dtype=dtype, width=40)
    full = decode_attention(q, kc, vc, tables, lens, 0.2)
    for i in (0, 5, 36):
        w = -(-ctxs[i] // 16)
        alone = decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1, :w], lens[i:i + 1], 0.2)
        assert torch.equal(alone[0], full[i]), i
    # a different step around row 5: other rows, another order
    idx = torch.tensor([30, 5, 2, 11])
    mixed = decode_attention(q[idx], kc, vc, tables[idx], lens[idx], 0.2)
    assert torch.equal(mixed[1], full[5])


def test_by_row_tiles_calls_fixed_shapes_and_keeps_rows():
    seen = []
    w = torch.randn(24, 8)

    def fn(x):
        seen.append(tuple(x.shape))
        return x @ w.t()

    for n in (1, 63, 64, 65, 200):
        seen.clear()
        x = torch.randn(n, 8)
        y = by_row_tiles(fn, x, tile=64)
        assert y.shape == (n, 24)
        torch.testing.assert_close(y, x @ w.t())
        assert set(seen) == {(64, 8)} and len(seen) == -(-n // 64)


def test_fixed_tiles_switch_nests_and_restores():
    assert not invariant.fixed_tiles_on()
    with fixed_tiles(True):
        assert invariant.fixed_tiles_on()
        with fixed_tiles(False):
            assert invariant.fixed_tiles_on()  # False leaves an enclosing True alone
        assert invariant.fixed_tiles_on()
    assert not invariant.fixed_tiles_on()


def test_linear_norm_and_head_run_by_tiles(monkeypatch):
    """Under fixed_tiles every Linear, RMSNorm and the head computes in calls of ROW_TILE rows."""
    from tokenmill.model.layers import RMSNorm
    from tokenmill.model.linear import Linear

    lin = Linear(16, 12, dtype=torch.float32)
    torch.nn.init.normal_(lin.weight)
    lin.method.process_weights_after_loading(lin)
    lin.packed = None  # the plain F.linear path (what CUDA runs)
    norm = RMSNorm(16, 1e-6, torch.float32)
    shapes = []
    real = F.linear
    monkeypatch.setattr("tokenmill.model.linear.F.linear", lambda x, *a: (shapes.append(tuple(x.shape)), real(x, *a))[1])
    x = torch.randn(100, 16)
    plain = lin(x)
    assert shapes == [(100, 16)]
    shapes.clear()
    with fixed_tiles(True):
        tiled = lin(x)
        n = norm(x.clone())
    assert shapes == [(invariant.ROW_TILE, 16)] * 2
    torch.testing.assert_close(tiled, plain)
    torch.testing.assert_close(n, norm(x.clone()))


@pytest.mark.slow
def test_engine_with_fixed_tiles_matches_the_plain_engine(monkeypatch):
    """A CPU engine forced onto the CUDA path's fixed tiles (no C++ kernels, every row a decode row), with n-gram
    speculation and a small KV cache (preemptions): the same greedy tokens as the plain engine (fp32)."""
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    from tokenmill import LLM, SamplingParams
    from tokenmill.testing.prompts import heldout_code_prompts

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("demo", dtype="float32", num_threads=1)
    prompts = heldout_code_prompts(plain.tokenizer, 10, 60)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    tiled = LLM("demo", dtype="float32", num_threads=1, speculative_model="ngram", num_speculative_tokens=4,
                kv_cache_bytes="1MiB", max_num_seqs=10)
    r = tiled.engine.runner
    r.batch_invariant, r.invariant_attention, r.tiles = True, "strict", True
    calls = []
    real = invariant.decode_attention
    monkeypatch.setattr("tokenmill.model.attention.decode_attention", lambda *a: (calls.append(1), real(*a))[1])
    got = [o.outputs[0].token_ids for o in tiled.generate(prompts, params)]
    assert calls, "the fixed-tile attention never ran"
    assert got == want
