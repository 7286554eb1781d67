"""Batch-invariant math from fixed shapes (`--batch-invariant on` on CUDA): a row's bits never depend on the step.

Why: on a GPU the library kernels pick their algorithm (tiling, split-K, how many blocks share one row's reduction)
from the *shapes* of the call, so the same row computed in a step of 1 row and in a step of 37 rows differs in its
last bits; in bf16 that flips near-tie argmaxes, and a speculative verify step (n decodes + their drafts), a
preemption or a different prefill chunking then changes greedy output (session 23, H200: 6-10 of 44 sequences
in bf16). The CPU gets invariance from its own kernels (model/linear.py `small_row_bits`); on CUDA this module
gets it without kernels of its own, from one rule: **every library call has the same shape whatever the step**.

    linears, norms, the head   rows cut into tiles of ROW_TILE (the last padded with zeros), one call per tile:
                               GEMMs and row reductions never mix rows, so a row's bits depend only on the tile
                               shape, which is fixed
    attention                  every row attends like a decode row (the runner's "strict" layout): per tile of
                               DECODE_TILE rows and per block of KEY_TILE keys, the scores, the running max /
                               sum and the weighted values in fp32 (an online softmax whose blocks are combined in
                               key order). A block past a row's context is masked whole: the update is an exact
                               no-op (max unchanged, scale exp(0) = 1, zero weights), so how many blocks the step
                               iterates (its longest context) does not change a row either

The cost is launches (a tile per call, a block per 256 keys): an opt-in mode for output that must not depend on
load (tests of speculation, reproducible evaluation), not the fast path. Exactness within a device and library
version; tests/model/test_invariant.py checks the rule on the CPU (row counts, padding, masked blocks) and
scripts/cuda_check.py on a GPU (greedy output with speculation vs without, bf16).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

ROW_TILE = 64  # rows per call of a linear, a norm, the head
DECODE_TILE = 16  # query rows per attention call
KEY_TILE = 256  # keys per attention block (a multiple of the KV block size; rounded up to one)

_ON = [False]


@contextmanager
def fixed_tiles(on: bool):
    """Within the block, Linear / RMSNorm / the head / paged attention compute by fixed tiles (the runner turns it
    on for every step of a batch-invariant engine on CUDA)."""
    if not on:
        yield
        return
    prev = _ON[0]
    _ON[0] = True
    try:
        yield
    finally:
        _ON[0] = prev


def fixed_tiles_on() -> bool:
    return _ON[0]


def by_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """fn over x's rows (dim 0) in calls of exactly `tile` rows, the last tile padded with zero rows; the outputs
    of the real rows, concatenated. fn must be row-wise (row i's output depends on row i's input only)."""
    n = x.shape[0]
    if n == 0:
        return fn(x)
    pad = (-n) % tile
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = x.contiguous()
    outs = [fn(x[i:i + tile]) for i in range(0, n + pad, tile)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n] if pad else out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     ctx_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [D, nh, hd] (each row a query at position ctx_len - 1 of its sequence); k_cache / v_cache:
    [num_blocks, kvh, bs, hd]; block_tables: [D, W] int64 (padded with any valid block id); ctx_lens: [D] int64.
    Returns [D, nh, hd] in q's dtype. Row i attends to keys [max(0, ctx_i - window), ctx_i) of its table. Every
    matmul / reduction has a shape fixed by (DECODE_TILE, KEY_TILE, heads, head_dim): see the module docstring."""
    d, nh, hd = q.shape
    nb, kvh, bs, _ = k_cache.shape
    rep = nh // kvh
    per = max(1, -(-KEY_TILE // bs))  # cache blocks per key block
    keys = per * bs
    dev = q.device
    pad_d = (-d) % DECODE_TILE
    w = block_tables.shape[1]
    pad_w = (-w) % per
    tables = block_tables
    if pad_w:
        tables = torch.cat([tables, tables.new_zeros((tables.shape[0], pad_w))], dim=1)
    lens = ctx_lens
    qq = q
    if pad_d:  # padding rows: one key (block 0, position 0), their output dropped
        tables = torch.cat([tables, tables.new_zeros((pad_d, tables.shape[1]))])
        lens = torch.cat([lens, lens.new_ones(pad_d)])
        qq = torch.cat([q, q.new_zeros((pad_d, nh, hd))])
    kpos0 = torch.arange(keys, device=dev)
    out = torch.empty((d + pad_d, nh, hd), dtype=q.dtype, device=dev)
    T = DECODE_TILE
    for t in range(0, d + pad_d, T):
        qt = qq[t:t + T].float().view(T, kvh, rep, hd)
        lt = lens[t:t + T, None]  # [T, 1]
        m = torch.full((T, kvh, rep, 1), float("-inf"), device=dev)
        l = torch.zeros((T, kvh, rep, 1), device=dev)
        o = torch.zeros((T, kvh, rep, hd), device=dev)
        for j in range(0, tables.shape[1], per):
            blk = tables[t:t + T, j:j + per]  # [T, per]
            kb = k_cache[blk].permute(0, 2, 1, 3, 4).reshape(T, kvh, keys, hd).float()
            vb = v_cache[blk].permute(0, 2, 1, 3, 4).reshape(T, kvh, keys, hd).float()
            s = torch.matmul(qt, kb.transpose(-1, -2)) * scale  # [T, kvh, rep, keys]
            kpos = kpos0 + j * bs  # [keys]
            valid = kpos[None, :] < lt
            if window is not None:
                valid = valid & (kpos[None, :] >= lt - window)
            s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            # a row with no valid key yet (a sliding window's leading blocks): subtract 0, not -inf (no NaN)
            m_sub = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_sub)
            p = torch.exp(s - m_sub)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            o = o * alpha + torch.matmul(p, vb)
            m = m_new
        out[t:t + T] = (o / l).view(T, nh, hd).to(q.dtype)
    return out[:d] if pad_d else out
