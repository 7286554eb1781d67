"""The decoder stack as one C++ call for small decode steps (the per-step fixed cost of batch-1 decode).

A step of at most `MAX_TOKENS` new tokens that all attend like decodes (one token per sequence, or k speculative
tokens each with its own context length: `AttentionMetadata` with no spans and every token in
`decode_token_idx`) runs through `decoder_stack_small` in csrc/paged_decode.cpp: every layer's norms, linears,
rope, KV write, paged attention and residuals, then the final norm, without returning to Python in between.
It calls the same kernels the modules in llama.py pick for such a step, in the same order, so its results are
the same bits (tests/model/test_fused_decode.py checks that against the module path, which stays the reference
and the fallback for everything else: prefill chunks, larger batches, fp16, CUDA, no compiler).

`FusedDecodeStack.build(model)` returns None when some part of the model has no small-batch C++ kernel (then the
module path runs every step). TOKENMILL_FUSED_DECODE=0 turns the fused path off.
"""

from __future__ import annotations

import os

import torch

from tokenmill.model.attention import AttentionMetadata, Int8KVCache

MAX_TOKENS = 8  # the small-batch linear kernels' row limit (PackedWeight.SMALL_ROWS, Int8LinearMethod.SMALL_ROWS)
KIND_FLOAT, KIND_VNNI, KIND_INT8_FLOAT_ACT = 0, 1, 2


def enabled_by_env() -> bool:
    v = os.environ.get("TOKENMILL_FUSED_DECODE", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_FUSED_DECODE must be 0 or 1, got {v!r}")
    return v == "1"


class FusedDecodeStack:
    """Per-layer tensor lists for `decoder_stack_small`, built once after the weights are loaded."""

    def __init__(self, kernels, weights: list[torch.Tensor], kinds: list[int], final_norm: torch.Tensor,
                 eps: float, nh: int, nkv: int, hd: int, inter: int, scale: float):
        self.kernels, self.weights, self.kinds, self.final_norm = kernels, weights, kinds, final_norm
        self.eps, self.nh, self.nkv, self.hd, self.inter, self.scale = eps, nh, nkv, hd, inter, scale
        self._caches_key: tuple | None = None
        self._caches: list[torch.Tensor] = []

    @staticmethod
    def _linear_slots(lin, kernels) -> tuple[int, list[torch.Tensor]] | None:
        """(kind, [weight, int8 row sums, int8 scales, bias]) or None when this Linear has no small-row kernel."""
        empty = torch.empty(0)
        bias = lin.bias if lin.bias is not None else empty
        if hasattr(lin, "w8"):
            if lin.int8_gemm and lin.in_features % 64 == 0 and kernels.has_vnni_small():
                return KIND_VNNI, [lin.w8, lin.w8_sum, lin.w_scale, bias]
            return KIND_INT8_FLOAT_ACT, [lin.w8, empty, lin.w_scale, bias]
        if lin.packed is None or lin.packed.small is None:  # the module path runs F.linear / oneDNN here
            return None
        return KIND_FLOAT, [lin.packed.weight, empty, empty, bias]

    @classmethod
    def build(cls, model) -> "FusedDecodeStack | None":
        from tokenmill.model.cpu_kernels import kernels_for

        if not enabled_by_env() or not model.layers:
            return None
        w0 = model.embed_tokens.weight
        kernels = kernels_for(w0)
        if kernels is None or not hasattr(kernels, "decoder_stack_small"):
            return None
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        empty = torch.empty(0)
        for layer in model.layers:
            att, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm, layer.post_attention_layernorm, att.q_norm, att.k_norm]
            weights.extend(n.weight if n is not None else empty for n in norms)
            for lin in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj):
                slots = cls._linear_slots(lin, kernels)
                if slots is None:
                    return None
                kinds.append(slots[0])
                weights.extend(slots[1])
        att = model.layers[0].self_attn
        return cls(kernels, weights, kinds, model.norm.weight, model.cfg.rms_norm_eps, att.nh, att.nkv, att.hd,
                   model.layers[0].mlp.inter, att.scale)

    @staticmethod
    def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """This step is one the fused path runs: few tokens, all decode-style, x in a dtype the kernels take."""
        t = x.shape[0]
        return (0 < t <= MAX_TOKENS and not meta.spans and meta.decode_token_idx is not None
                and meta.decode_token_idx.shape[0] == t and x.is_contiguous())

    def _cache_list(self, kv_caches) -> list[torch.Tensor]:
        key = self._caches_key
        if key is None or len(key) != len(kv_caches) or any(a is not b for a, b in zip(key, kv_caches)):
            # the runner's caches live as long as it does: split them once (the key holds the cache objects
            # themselves, so a freed cache's id cannot be reused under it)
            empty = torch.empty(0)
            out = []
            for c in kv_caches:
                if isinstance(c, Int8KVCache):
                    out.extend((c.data[0], c.data[1], c.scales[0], c.scales[1]))
                else:
                    out.extend((c[0], c[1], empty, empty))
            self._caches, self._caches_key = out, tuple(kv_caches)
        return self._caches

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope, kv_caches, meta: AttentionMetadata):
        """x [T, hidden] (the embeddings; updated in place as the residual stream) -> final normed hidden."""
        return self.kernels.decoder_stack_small(
            x, positions, rope.cos, rope.sin, self.weights, self.kinds, self._cache_list(kv_caches),
            meta.slot_mapping, meta.decode_block_tables, meta.decode_ctx_lens, self.final_norm, self.eps, self.scale,
            meta.sliding_window or 0, self.nh, self.nkv, self.hd, self.inter)
