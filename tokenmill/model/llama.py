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
from tokenmill.model.cpu_kernels import kernels_for
from tokenmill.model.layers import RMSNorm, RotaryEmbedding
from tokenmill.model.linear import LINEAR_METHODS, Linear, LinearMethod, PackedWeight


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

    def forward(self, x, positions, rope: RotaryEmbedding, cache, meta: AttentionMetadata):
        t = x.shape[0]  # x: [T, hidden]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, cache, meta, self.scale)  # [T, nh, hd]
        return self.o_proj(o.reshape(t, self.nh * self.hd))


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

    def forward(self, x, positions, rope, cache, meta):
        """x is the residual stream; this layer owns it (it is updated in place and returned)."""
        a = self.self_attn(self.input_layernorm(x), positions, rope, cache, meta)
        h = self.post_attention_layernorm(x, residual=a)  # x += a, then norm
        return x.add_(self.mlp(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, quantization: str = "none"):
        """`quantization` picks the LinearMethod of the decoder's projections (linear.LINEAR_METHODS);
        embeddings and lm_head stay in `dtype`."""
        super().__init__()
        self.cfg = cfg
        method = LINEAR_METHODS[quantization]
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, method) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.tied_head: PackedWeight | None = None

    def process_weights_after_loading(self) -> None:
        """Once the weights are in and on their device: let each linear method repack its weights."""
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())  # as loaded
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.method.process_weights_after_loading(mod)
        if self.lm_head is None:
            self.tied_head = PackedWeight.maybe(self.embed_tokens.weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        if self.lm_head is None:
            if self.tied_head is not None:
                return self.tied_head(hidden).float()
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
