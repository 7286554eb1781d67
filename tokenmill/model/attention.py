"""Paged attention over a block-structured KV cache, in plain PyTorch (CPU and CUDA).

Layout: one cache tensor per layer, `[2, num_blocks, num_kv_heads, block_size, head_dim]` (K, V): within a
block each head's tokens are contiguous, so a kernel reading one (sequence, head) streams whole rows.
A flat batch holds T new tokens from many sequences; each sequence brings q_len >= 1 new tokens
(a prefill chunk, one decode token, or k draft tokens to verify) on top of ctx_len - q_len cached ones.

Per layer: (1) write the new K/V into their slots (`slot_mapping`), (2) attend. Because every new
K/V of the step is written before anyone attends, two sequences scheduled in the same step may share
blocks that the step itself fills (same-step prefix sharing).

Sequences with q_len == 1 are attended together in one padded batch; others one by one (a sequence
with no cached context uses the causal fast path without gathering from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    q_start: int  # offset of the sequence's first new token in the flat batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens in the cache after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset, for each new token
    spans: list[SeqSpan]  # sequences with q_len > 1 (or a single decode)
    decode_token_idx: torch.Tensor | None  # [D] long: flat indices of the q_len == 1 tokens
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long (padded with 0)
    decode_ctx_lens: torch.Tensor | None  # [D] long
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks*block_size] bool, True = attend (fallback path)
    sliding_window: int | None = None


def _cpu_kernels(q: torch.Tensor, cache: torch.Tensor):
    from tokenmill.model.cpu_kernels import KERNEL_DTYPES, kernels_for

    return kernels_for(q) if cache.dtype in KERNEL_DTYPES else None  # the cache may differ (--kv-cache-dtype)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # cache: [2, NB, kvh, bs, hd]; k, v: [T, kvh, hd]
    bs = cache.shape[3]
    blk, off = slot_mapping // bs, slot_mapping % bs
    cache[0][blk, :, off] = k
    cache[1][blk, :, off] = v


def gather_kv(cache_kv: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[NB, kvh, bs, hd] + block table [..., MB] -> [..., kvh, MB * bs, hd] (a copy)."""
    g = cache_kv[block_table]  # [..., MB, kvh, bs, hd]
    mb, kvh, bs, hd = g.shape[-4:]
    return g.transpose(-4, -3).reshape(*g.shape[:-4], kvh, mb * bs, hd)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          gqa: bool) -> torch.Tensor:
    """One sequence: q [nh, q, hd], k/v [kvh, ctx, hd]; causal when `mask` is None. The inputs get a batch
    dimension: with 3-D inputs PyTorch's CPU SDPA takes its math path (mask materialized, safe softmax),
    with 4-D its flash kernel, 2-3x faster here at 64-384 tokens."""
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=gqa)
    return o[0]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, kvh, hd] (this step's new tokens). Returns [T, nh, hd]."""
    kernels = _cpu_kernels(q, cache)
    if kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
        kernels.write_kv(cache[0], cache[1], k.to(cache.dtype), v.to(cache.dtype), meta.slot_mapping)
    else:
        write_kv(cache, k, v, meta.slot_mapping)  # index assignment casts to the cache's dtype
    out = torch.empty_like(q)
    nh, kvh = q.shape[1], k.shape[1]
    gqa = nh != kvh
    bs = cache.shape[3]
    for s in meta.spans:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [nh, q, hd]
        window = meta.sliding_window
        if s.ctx_len == s.q_len and (window is None or window >= s.ctx_len):
            ks = k[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [kvh, q, hd]
            vs = v[s.q_start:s.q_start + s.q_len].transpose(0, 1)
            o = _sdpa(qs, ks, vs, None, scale, gqa)
        else:
            ks = gather_kv(cache[0], s.block_table)[:, :s.ctx_len].to(q.dtype)  # [kvh, ctx, hd]
            vs = gather_kv(cache[1], s.block_table)[:, :s.ctx_len].to(q.dtype)
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)[:, None]
            kpos = torch.arange(s.ctx_len, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = _sdpa(qs, ks, vs, mask, scale, gqa)
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)
    if meta.decode_token_idx is not None:
        idx = meta.decode_token_idx
        d = idx.shape[0]
        if kernels is not None:  # K/V read in place from the cache, no padded gather
            if not meta.spans and d == q.shape[0]:  # a pure decode step: tokens are in order, no copies
                kernels.paged_decode_attention(out, q, cache[0], cache[1], meta.decode_block_tables,
                                               meta.decode_ctx_lens, scale, meta.sliding_window or 0)
                return out
            qd = q.index_select(0, idx)  # [D, nh, hd]
            od = torch.empty_like(qd)
            kernels.paged_decode_attention(od, qd, cache[0], cache[1], meta.decode_block_tables,
                                           meta.decode_ctx_lens, scale, meta.sliding_window or 0)
            out.index_copy_(0, idx, od)
            return out
        if meta.decode_mask is None:  # built once per step, shared by all layers
            kpos = torch.arange(meta.decode_block_tables.shape[1] * bs, device=q.device)[None, :]
            lens = meta.decode_ctx_lens[:, None]
            mask = kpos < lens
            if meta.sliding_window is not None:
                mask &= kpos >= lens - meta.sliding_window
            meta.decode_mask = mask[:, None, None, :]
        qd = q.index_select(0, idx).unsqueeze(2)  # [D, nh, 1, hd]
        kd = gather_kv(cache[0], meta.decode_block_tables).to(q.dtype)  # [D, kvh, S, hd]
        vd = gather_kv(cache[1], meta.decode_block_tables).to(q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, idx, o.squeeze(2))
    return out
