"""Building blocks of Llama-family models: RMSNorm, rotary embedding (incl. llama3 scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.model.config import RopeConfig
from tokenmill.model.cpu_kernels import kernels_for
from tokenmill.model.invariant import _ON as _TILES, by_row_tiles


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`, first x += residual in place (the decoder's residual stream)."""
        if _TILES[0]:  # batch-invariant on CUDA: the row reductions in calls of a fixed row count (model/invariant.py)
            if residual is not None:
                x.add_(residual)
            return by_row_tiles(self._norm, x)
        k = kernels_for(x)
        if k is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = torch.empty_like(x)
            k.rms_norm(out, x, residual, self.weight, self.eps)
            return out
        if residual is not None:
            x.add_(residual)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies as transformers computes them for rope_type default / linear / llama3."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
        old_len = float(rope.original_max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope.rope_type!r} is not implemented")  # ModelConfig refuses it first


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as HF Llama/Qwen/Mistral apply it."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_pos, head_dim/2] fp32
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, nh, hd]; k: [T, nkv, hd]
        k_ = kernels_for(q)
        if k_ is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64:
            k_.rope_inplace(q, positions, self.cos, self.sin)  # q, k are fresh views of this step's qkv
            k_.rope_inplace(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, hd/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
