"""The decoder stack as one C++ call for steps with prefill chunks (the prefill / mixed-step twin of fused_decode.py).

A step with at least one span (a sequence bringing more than one new token: a fresh prefill or a chunk over cached
context), with or without decode tokens beside it, runs through `decoder_stack_mixed` (csrc/mixed_stack.cpp): every
layer's norms, linears, rope, KV write, attention (the C++ prefill attention over all spans in one call, the C++
decode attention for the decode tokens) and residuals, then the final norm, without returning to Python between ops
or layers. It calls the kernels the modules in llama.py pick for such a step, in the same order, so its results are
the module path's bits (tests/model/test_fused_mixed.py; qk-norm models within a tolerance, as in fused_decode.py).

It shares the weight lists of the model's `FusedDecodeStack` (built only where every linear has its C++ kernels) and
applies only where the module path would take the C++ prefill attention (TOKENMILL_PREFILL_ATTN not 0, AVX2+FMA).
Speculative verify steps (no spans) never come here. TOKENMILL_FUSED_MIXED=0 turns it off (the modules run).
"""

from __future__ import annotations

import os

import torch

from tokenmill.model.attention import AttentionMetadata, _prefill_args, _prefill_on
from tokenmill.model.fused_decode import FusedDecodeStack


def enabled_by_env() -> bool:
    v = os.environ.get("TOKENMILL_FUSED_MIXED", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_FUSED_MIXED must be 0 or 1, got {v!r}")
    return v == "1"


class FusedMixedStack:
    """Runs steps with prefill chunks through `decoder_stack_mixed`, on a FusedDecodeStack's weights."""

    def __init__(self, stack: FusedDecodeStack):
        self.stack = stack

    @classmethod
    def build(cls, model) -> "FusedMixedStack | None":
        stack = model.fused
        if not enabled_by_env() or not isinstance(stack, FusedDecodeStack):
            return None
        k = stack.kernels
        if not hasattr(k, "decoder_stack_mixed") or not k.has_prefill_attention():
            return None
        return cls(stack)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step with spans, of a size the stack's linears take, x contiguous, the C++ prefill attention on."""
        t = x.shape[0]
        if not meta.spans or not x.is_contiguous() or t > self.stack.max_tokens or not _prefill_on():
            return False
        dec = meta.decode_token_idx
        return dec is None or dec.shape[0] + sum(s.q_len for s in meta.spans) == t

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope, kv_caches, meta: AttentionMetadata):
        """x [T, hidden] (the embeddings; the residual stream) -> final normed hidden, [T, hidden] or, with
        `meta.logits_rows`, those rows only (as the module path)."""
        s = self.stack
        if meta.prefill_args is None:
            meta.prefill_args = _prefill_args(meta.spans)
        empty = torch.empty(0, dtype=torch.long)
        dec = meta.decode_token_idx
        dec_idx = dec if dec is not None else empty
        dec_bt = meta.decode_block_tables if dec is not None else empty.view(0, 1)
        dec_len = meta.decode_ctx_lens if dec is not None else empty
        return s.kernels.decoder_stack_mixed(
            x, positions, rope.cos, rope.sin, s.weights, s.kinds, s._cache_list(kv_caches), meta.slot_mapping,
            *meta.prefill_args, dec_idx, dec_bt, dec_len, meta.logits_rows, s.final_norm, s.eps, s.scale, meta.sliding_window or 0,
            s.nh, s.nkv, s.hd, s.inter)
