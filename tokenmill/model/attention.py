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

`--kv-cache-dtype int8` stores the cache as an `Int8KVCache` (int8 data in the same layout + one fp32 scale per
(block, kv head) for K and for V); see its docstring for the scheme. `--kv-cache-dtype fp8` is the same scheme
with e4m3 values (`Fp8KVCache`): written and read by the PyTorch code here (the CPU kernels take fp32, bf16 and
int8 caches; on CUDA every path is this one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.invariant import _ON as _TILES, decode_attention


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
    prefill_args: tuple | None = None  # the spans as the C++ prefill attention takes them (built once per step)
    # [R] long, increasing: the rows whose hidden states the caller reads (the rows it samples from); set, the last
    # layer computes only these rows past its attention (KV of every row is still written) and the model returns
    # [R, hidden]. None: every row. The runner sets it for steps with prefill chunks.
    logits_rows: torch.Tensor | None = None
    # for a 1-byte KV cache written by `write_kv_scaled` off the CPU: the step's blocks grouped on the host
    # (`KVBlockGroups.of`), so the write reads no sizes or flags back from the device (torch.unique and a
    # Python `if` on a tensor each wait for the GPU: two per layer per step). None: computed on the device.
    kv_groups: "KVBlockGroups | None" = None


@dataclass
class KVBlockGroups:
    """The blocks a step writes, as `write_kv_scaled` groups them: the distinct blocks (sorted), each new
    token's index among them, and each block's first written offset (0: a fresh block)."""

    blocks: torch.Tensor  # [U] long, sorted
    inverse: torch.Tensor  # [T] long: slot t writes into blocks[inverse[t]]
    first_offset: torch.Tensor  # [U] long

    @staticmethod
    def of(slots: list[int], block_size: int, to_device) -> "KVBlockGroups":
        first: dict[int, int] = {}
        for s in slots:
            b, o = divmod(s, block_size)
            if o < first.get(b, block_size):
                first[b] = o
        blocks = sorted(first)
        index = {b: i for i, b in enumerate(blocks)}
        return KVBlockGroups(to_device(blocks), to_device([index[s // block_size] for s in slots]),
                             to_device([first[b] for b in blocks]))


class ScaledKVCache:
    """One layer's KV cache in a 1-byte type with one fp32 scale per (block, kv head), K and V apart: the scheme of
    `Int8KVCache` (below); `Fp8KVCache` stores e4m3 values instead of int8 (qmax 448 instead of 127, rounding by
    the cast). Subclasses set `dtype`, `qmax` and `quantize`."""

    dtype: torch.dtype
    qmax: float

    def __init__(self, data: torch.Tensor, scales: torch.Tensor):
        self.data, self.scales = data, scales

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @staticmethod
    def quantize(x: torch.Tensor) -> torch.Tensor:
        """fp32 values already divided by their scale (|x| <= qmax) -> the storage type."""
        raise NotImplementedError

    def raw(self) -> torch.Tensor:
        """`data` as int8 bits (itself for int8): index reads and writes go through it (PyTorch has no index_put /
        index_copy kernels for fp8 on every device)."""
        return self.data if self.data.dtype == torch.int8 else self.data.view(torch.int8)

    def stored(self, bits: torch.Tensor) -> torch.Tensor:
        """int8 bits read from `raw()` -> the storage type's values."""
        return bits if self.dtype == torch.int8 else bits.view(self.dtype)

    @classmethod
    def empty(cls, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, device, zeros=None):
        """Zeroed data and scales; `zeros(shape, dtype, device)` allocates the data (the runner passes its
        huge-page allocator), torch.zeros by default."""
        shape = (2, num_blocks, kv_heads, block_size, head_dim)
        data = zeros(shape, cls.dtype, device) if zeros else torch.zeros(shape, dtype=cls.dtype, device=device)
        return cls(data, torch.zeros(2, num_blocks, kv_heads, dtype=torch.float32, device=device))


class Int8KVCache(ScaledKVCache):
    """One layer's int8 KV cache: `data` [2, num_blocks, kv_heads, block_size, head_dim] int8 (the float layout)
    and `scales` [2, num_blocks, kv_heads] fp32: value = data * scale, one scale per (block, kv head), K and V
    apart. Both are indexed by block id in dim 1, so a block's full contents are `data[:, b]` + `scales[:, b]`.

    The scheme, and why: a block is filled incrementally (a prefill chunk, then one decode token per step), so a
    scale fixed at the block's first write would clip a later, larger token, and per-token scales would cost
    4 bytes per head_dim bytes (17% at the demo model's head_dim 24). Instead the scale may only grow: tokens
    are written in position order, so when this step's tokens land at offsets >= o0, rows [0, o0) are the
    block's valid content (o0 == 0: a fresh block, the old scale is stale and ignored). The new scale is
    max(old scale, absmax(new rows) / 127); if it grew, rows [0, o0) are requantized to it first (their |q|
    only shrinks), then the new rows are quantized (round to nearest, +-127). Nothing ever saturates; a
    requantized row carries at most one extra rounding per growth (a block's running maximum over 16 tokens
    grows ~3 times on average). Capacity: 1 byte per value + 8 bytes per (block, head) per layer, ~4x fp32 and
    ~2x bf16. Shared (prefix-cached) blocks are full and never written again, so requantization never touches
    a block another sequence is reading in a later step.
    """

    dtype = torch.int8
    qmax = 127.0

    @staticmethod
    def quantize(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x).clamp_(-127, 127).to(torch.int8)


class Fp8KVCache(ScaledKVCache):
    """`Int8KVCache`'s scheme with e4m3 values (`--kv-cache-dtype fp8`): scale = max|x| / 448 per (block, kv
    head), growing as the block fills; values cast to e4m3 (round to nearest even: 3 mantissa bits, a relative
    error <= 1/16 at any magnitude where int8's is absolute). The same bytes as int8."""

    dtype = torch.float8_e4m3fn
    qmax = 448.0

    @staticmethod
    def quantize(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


SCALED_KV_CACHES = {torch.int8: Int8KVCache, torch.float8_e4m3fn: Fp8KVCache}  # KV storage dtype -> its cache


def _cpu_kernels(q: torch.Tensor, cache):
    from tokenmill.model.cpu_kernels import KERNEL_DTYPES, kernels_for

    if isinstance(cache, Int8KVCache) or cache.dtype in KERNEL_DTYPES:  # the cache may differ (--kv-cache-dtype)
        return kernels_for(q)
    return None


def write_kv_scaled(cache: ScaledKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    groups: KVBlockGroups | None = None) -> None:
    """The scheme of `Int8KVCache` in PyTorch, for either storage type (int8: the fallback and the tests'
    reference for the C++ `write_kv_int8`; fp8: the only implementation). With `groups` (the blocks grouped on
    the host: off the CPU) nothing is read back from the device: the same bits, every touched block's old rows
    requantized unconditionally (rows whose scale did not grow get their own bits back)."""
    qmax = cache.qmax
    raw, stored = cache.raw(), cache.stored  # indexing on byte views: fp8 has no index kernels everywhere
    bs = cache.data.shape[3]
    blk, off = slot_mapping // bs, slot_mapping % bs
    if groups is None:
        ublk, inv = torch.unique(blk, return_inverse=True)
        o0 = torch.full((len(ublk),), bs, dtype=off.dtype, device=off.device).scatter_reduce(0, inv, off, "amin")
    else:
        ublk, inv, o0 = groups.blocks, groups.inverse, groups.first_offset
    fresh = (o0 == 0)[:, None]  # [U, 1]
    valid_rows = torch.arange(bs, device=off.device)[None, :] < o0[:, None]  # [U, bs]
    for i, x in ((0, k), (1, v)):
        xf = x.float()
        amax = torch.zeros(ublk.shape[0], x.shape[1], device=x.device).scatter_reduce_(
            0, inv[:, None].expand(-1, x.shape[1]), xf.abs().amax(-1), "amax")  # [U, kvh]
        old = cache.scales[i][ublk]
        s = torch.where(fresh, amax / qmax, torch.maximum(old, amax / qmax))
        grow = ~fresh & (s > old)
        if groups is not None or grow.any():
            d = stored(raw[i][ublk]).float()  # [U, kvh, bs, hd]
            ratio = torch.where(s > 0, old / s, torch.zeros_like(s))
            sel = (grow[:, :, None] & valid_rows[:, None, :])[..., None]
            # unselected rows hold stored values: quantizing them again gives the same bits (int8 and e4m3)
            raw[i][ublk] = cache.quantize(torch.where(sel, d * ratio[..., None, None], d)).view(raw.dtype)
        cache.scales[i][ublk] = s
        st = s[inv]  # [T, kvh]
        inv_s = torch.where(st > 0, 1 / st, torch.zeros_like(st))
        raw[i][blk, :, off] = cache.quantize(xf * inv_s[..., None]).view(raw.dtype)


def _gather(cache, i: int, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (i=0) or V (i=1) of the blocks in `block_table`, in `dtype`: [..., kvh, MB * bs, hd] (a copy)."""
    if isinstance(cache, ScaledKVCache):
        g = cache.stored(gather_kv(cache.raw()[i], block_table))
        s = cache.scales[i][block_table].transpose(-1, -2)  # [..., kvh, MB]
        s = s.repeat_interleave(cache.data.shape[3], dim=-1)  # [..., kvh, MB * bs]
        return (g.float() * s[..., None]).to(dtype)
    return gather_kv(cache[i], block_table).to(dtype)


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


def _prefill_on() -> bool:
    """TOKENMILL_PREFILL_ATTN=0 turns the C++ prefill attention off (the per-sequence PyTorch SDPA loop below is the
    reference and the fallback)."""
    import os

    return os.environ.get("TOKENMILL_PREFILL_ATTN", "1") != "0"


def _prefill_args(spans: list[SeqSpan]) -> tuple:
    """(q_starts, q_lens, ctx_lens, block_tables padded with 0) as int64 CPU tensors, for all layers of the step."""
    width = max(s.block_table.shape[0] for s in spans)
    bt = torch.zeros(len(spans), width, dtype=torch.long)
    for i, s in enumerate(spans):
        bt[i, :s.block_table.shape[0]] = s.block_table
    lens = torch.tensor([[s.q_start, s.q_len, s.ctx_len] for s in spans], dtype=torch.long).t().contiguous()
    return lens[0], lens[1], lens[2], bt


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "torch.Tensor | ScaledKVCache",
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, kvh, hd] (this step's new tokens). Returns [T, nh, hd]."""
    kernels = _cpu_kernels(q, cache)
    if isinstance(cache, ScaledKVCache):
        kc, vc, k_sc, v_sc = cache.data[0], cache.data[1], cache.scales[0], cache.scales[1]
        if kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1:  # (int8 only: _cpu_kernels)
            kernels.write_kv_int8(kc, vc, k_sc, v_sc, k, v, meta.slot_mapping)
        else:
            write_kv_scaled(cache, k, v, meta.slot_mapping, meta.kv_groups)
    else:
        kc, vc, k_sc, v_sc = cache[0], cache[1], None, None
        if kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
            kernels.write_kv(kc, vc, k.to(cache.dtype), v.to(cache.dtype), meta.slot_mapping)
        else:
            write_kv(cache, k, v, meta.slot_mapping)  # index assignment casts to the cache's dtype
    out = torch.empty_like(q)
    nh, kvh = q.shape[1], k.shape[1]
    gqa = nh != kvh
    bs = cache.shape[3]
    spans = meta.spans
    if spans and _TILES[0]:
        raise RuntimeError("fixed tiles (batch-invariant on CUDA) attend every row as a decode row; the runner "
                           "passed prefill spans")
    if spans and kernels is not None and _prefill_on() and q.stride(-1) == 1 and k.dtype == q.dtype == v.dtype:
        if meta.prefill_args is None:
            meta.prefill_args = _prefill_args(spans)
        if kernels.prefill_attention(out, q, k, v, kc, vc, *meta.prefill_args, scale, meta.sliding_window or 0,
                                     k_sc, v_sc):
            spans = ()  # every span attended in the one call
    for s in spans:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [nh, q, hd]
        window = meta.sliding_window
        if s.ctx_len == s.q_len and (window is None or window >= s.ctx_len):
            ks = k[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [kvh, q, hd]
            vs = v[s.q_start:s.q_start + s.q_len].transpose(0, 1)
            o = _sdpa(qs, ks, vs, None, scale, gqa)
        else:
            ks = _gather(cache, 0, s.block_table, q.dtype)[:, :s.ctx_len]  # [kvh, ctx, hd]
            vs = _gather(cache, 1, s.block_table, q.dtype)[:, :s.ctx_len]
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
        if _TILES[0] and not isinstance(cache, ScaledKVCache):  # batch-invariant on CUDA (model/invariant.py)
            od = decode_attention(q.index_select(0, idx), kc, vc, meta.decode_block_tables, meta.decode_ctx_lens,
                                  scale, meta.sliding_window)
            out.index_copy_(0, idx, od)
            return out
        if kernels is not None:  # K/V read in place from the cache, no padded gather
            if not meta.spans and d == q.shape[0]:  # a pure decode step: tokens are in order, no copies
                kernels.paged_decode_attention(out, q, kc, vc, meta.decode_block_tables,
                                               meta.decode_ctx_lens, scale, meta.sliding_window or 0, k_sc, v_sc)
                return out
            qd = q.index_select(0, idx)  # [D, nh, hd]
            od = torch.empty_like(qd)
            kernels.paged_decode_attention(od, qd, kc, vc, meta.decode_block_tables,
                                           meta.decode_ctx_lens, scale, meta.sliding_window or 0, k_sc, v_sc)
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
        kd = _gather(cache, 0, meta.decode_block_tables, q.dtype)  # [D, kvh, S, hd]
        vd = _gather(cache, 1, meta.decode_block_tables, q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, idx, o.squeeze(2))
    return out
