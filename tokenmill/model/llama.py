"""Llama-family decoder (Llama incl. llama3 rope scaling and attention/MLP biases, Mistral, Qwen2 qkv bias, Qwen3
q/k norm; GQA;
tied embeddings) over a paged KV cache. Takes a flat batch of new tokens from many sequences."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.config import ModelConfig
from tokenmill.model.invariant import _ON as _TILES, ROW_TILE, by_row_tiles
from tokenmill.model.cpu_kernels import kernels_for
from tokenmill.model.layers import RMSNorm, RotaryEmbedding
from tokenmill.model.lm_head import Avx2Int8Head, Int8PackedHead, PackedHead
from tokenmill.model.linear import LINEAR_METHODS, Int8LinearMethod, Linear, LinearMethod, PackedWeight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: Callable[[], LinearMethod]):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, bias=cfg.qkv_bias, dtype=dtype, method=method(),
                               shards=[("q", self.nh * self.hd), ("k", self.nkv * self.hd), ("v", self.nkv * self.hd)])
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, method=method())
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = self.hd ** -0.5

    def forward(self, x, positions, rope: RotaryEmbedding, cache, meta: AttentionMetadata, rows=None):
        """`rows` given: the output of those rows only (the attention of all, whose K/V are written)."""
        t = x.shape[0]  # x: [T, hidden]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, cache, meta, self.scale)  # [T, nh, hd]
        o = o.reshape(t, self.nh * self.hd)
        if rows is not None and rows.numel() == 0:  # no row wanted: the K/V writes were the point
            return None
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: Callable[[], LinearMethod]):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype, method=method(),
                                   shards=[("gate", self.inter), ("up", self.inter)])
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype, method=method())

    def forward(self, x):
        gu = self.gate_up_proj(x)
        k = kernels_for(gu)
        if k is not None and gu.is_contiguous():
            h = torch.empty(*gu.shape[:-1], self.inter, dtype=gu.dtype)
            k.silu_mul(h, gu)
            return self.down_proj(h)
        gate, up = gu.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: Callable[[], LinearMethod]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, method)

    def forward(self, x, positions, rope, cache, meta, rows=None):
        """x is the residual stream; this layer owns it (it is updated in place and returned). `rows` given: only
        those rows past the attention (a new residual of [len(rows), hidden] is returned)."""
        a = self.self_attn(self.input_layernorm(x), positions, rope, cache, meta, rows)
        if rows is not None:
            x = x.index_select(0, rows)
            if a is None:
                return x
        h = self.post_attention_layernorm(x, residual=a)  # x += a, then norm
        return x.add_(self.mlp(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, quantization: str = "none"):
        """`quantization` picks the LinearMethod of the decoder's projections (linear.LINEAR_METHODS);
        embeddings stay in `dtype`. Under int8 W8A8 (`int8`, or a pre-quantized checkpoint) the lm_head (tied or
        not) is quantized at load time too (the quality gate in tests/model/test_precision.py covers it: it is
        ~40% of a small model's decode FLOPs); otherwise it stays in `dtype`."""
        super().__init__()
        self.cfg = cfg
        method = LINEAR_METHODS[quantization]
        self.int8_head = quantization in ("int8", "compressed-tensors-w8a8")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, method) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                  method=Int8LinearMethod() if self.int8_head else None)
        self.tied_head: "PackedWeight | Linear | None" = None
        self.packed_head: PackedHead | Int8PackedHead | Avx2Int8Head | None = None  # the head kernel (lm_head.py), after loading
        self.fused = None  # the one-call decoder stack for decode steps (fused_decode.py), set after loading
        self.fused_mixed = None  # its twin for steps with prefill chunks (fused_mixed.py), set after loading

    def process_weights_after_loading(self) -> None:
        """Once the weights are in and on their device: let each linear method repack its weights."""
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())  # as loaded
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.method.process_weights_after_loading(mod)
        if self.lm_head is None and self.int8_head:  # an int8 copy of the tied embedding (which stays as it is)
            head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, dtype=self.embed_tokens.weight.dtype,
                          method=Int8LinearMethod())
            head.weight = nn.Parameter(self.embed_tokens.weight.detach(), requires_grad=False)
            head.method.process_weights_after_loading(head)
            self.tied_head = head
        elif self.lm_head is None:
            self.packed_head = PackedHead.build(self.embed_tokens.weight)
            if self.packed_head is None:  # the packed head replaces oneDNN's copy of the tied embedding
                self.tied_head = PackedWeight.maybe(self.embed_tokens.weight)
        if not self.int8_head and self.lm_head is not None and self.lm_head.bias is None:
            self.packed_head = PackedHead.build(self.lm_head.weight)
        if self.int8_head:  # the int8 head's own kernel (VNNI; AVX2 without it), same interface
            self.packed_head = Int8PackedHead.build(self.lm_head if self.lm_head is not None else self.tied_head)
        self.decode_read_bytes = self._decode_read_bytes()
        from tokenmill.model.fused_decode import FusedDecodeStack

        self.fused = FusedDecodeStack.build(self)  # None: every step runs the modules below
        from tokenmill.model.fused_mixed import FusedMixedStack

        self.fused_mixed = FusedMixedStack.build(self)  # None: steps with prefill chunks run the modules

    def _decode_read_bytes(self) -> int:
        """The weight bytes one batch-1 decode step must read (the bandwidth floor's numerator): every projection
        and the lm_head in the form the small-batch kernels stream (int8 + scales under W8A8), the norms, and
        one embedding row."""
        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        total = nbytes(self.embed_tokens.weight[0])
        for mod in self.modules():  # an int8 tied_head is a submodule (nn.Module attributes register as such)
            if isinstance(mod, Linear):
                w = ((mod.w8, mod.w_scale) if hasattr(mod, "w8") else (mod.w_fp8, mod.w_scale) if hasattr(mod, "w_fp8")
                     else (mod.weight,))
                total += nbytes(*w, mod.bias)
            elif isinstance(mod, RMSNorm):
                total += nbytes(mod.weight)
        if self.lm_head is None and not isinstance(self.tied_head, Linear):
            total += nbytes(self.embed_tokens.weight)  # the tied head reads the whole embedding
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (`meta.logits_rows` set: [R, hidden], those
        rows only; the last layer skips the others past its attention)."""
        x = self.embed_tokens(input_ids)
        if _TILES[0]:  # batch-invariant on CUDA: every module by fixed tiles (model/invariant.py), no fused stack
            pass
        elif self.fused is not None and self.fused.applies(x, meta) and positions.dtype == torch.int64:
            return self.fused(x, positions, self.rope, kv_caches, meta)
        elif self.fused_mixed is not None and self.fused_mixed.applies(x, meta) and positions.dtype == torch.int64:
            return self.fused_mixed(x, positions, self.rope, kv_caches, meta)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, positions, self.rope, cache, meta, meta.logits_rows if i == last else None)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab], fp32 (or, `float32=False`, in the head's output dtype)."""
        return self.compute_logits_plain(hidden, float32)

    def compute_logits_plain(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """`compute_logits` without entering inference mode (~2 us a call): for callers already inside it (the
        speculative draft loop calls the head once per draft token)."""
        if _TILES[0] and hidden.shape[0] != ROW_TILE:  # batch-invariant on CUDA: fixed row tiles (model/invariant.py)
            return by_row_tiles(lambda h: self.compute_logits_plain(h, float32), hidden)
        if self.packed_head is not None and self.packed_head.applies(hidden):
            logits = self.packed_head.logits(hidden)
        elif self.lm_head is None:
            logits = self.tied_head(hidden) if self.tied_head is not None else F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> [N] int64, each row's argmax of `compute_logits(hidden)` (exactly), computed by
        the packed head without writing the logits; None where the packed head does not apply."""
        return self.greedy_tokens_plain(hidden)

    def greedy_tokens_plain(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`greedy_tokens` without entering inference mode (see compute_logits_plain)."""
        if self.packed_head is None or not self.packed_head.applies_greedy(hidden):
            return None
        return self.packed_head.greedy(hidden)
