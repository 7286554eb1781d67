"""The decoder stack as one C++ call for decode steps (the per-step fixed cost: Python and dispatch per layer).

A step whose new tokens all attend like decodes (one token per sequence, or k speculative tokens each with its own
context length: `AttentionMetadata` with no spans and every token in `decode_token_idx`), of any size, runs
through `decoder_stack` in csrc/paged_decode.cpp: every layer's norms, linears, rope, KV write, paged attention and
residuals, then the final norm, without returning to Python in between. Linears with at most `MAX_TOKENS` rows
take the small-row kernels; larger steps take oneDNN's prepacked GEMM or the int8 GEMM (`torch._int_mm` between
the C++ quantize and dequantize), as the modules do. It calls the same kernels the modules in llama.py pick for
such a step, in the same order, so its results are the same bits (tests/model/test_fused_decode.py checks that
against the module path, which stays the reference and the fallback for everything else: prefill chunks, fp16,
CUDA, no compiler). Int8 linears without a safe oneDNN int8 GEMM (AVX2 only) take the AVX2 exact kernels
(csrc/int8_gemm.cpp, KIND_AVX2_INT8) at any size, as the modules do; where some int8 linear has neither (the module
path computes it in fp32: TOKENMILL_AVX2_INT8=0) the stack takes steps of at most `MAX_TOKENS` tokens only.

`FusedDecodeStack.build(model)` returns None when some part of the model has no small-batch C++ kernel (then the
module path runs every step). TOKENMILL_FUSED_DECODE=0 turns the fused path off.

The per-step call goes through a `DecodeStackHandle` (csrc/decode_step.cpp) that holds the weight list, the kinds,
the cache list, the rope tables and the constants in C++, converted once, so a step converts only its five per-step
tensors; it calls the same `decoder_stack` (same bits). TOKENMILL_DECODE_FAST_PATH=0 passes every argument on every
call instead (the reference; it also turns off the runner's decode fast path, engine/runner.py).
"""

from __future__ import annotations

import os

import torch

from tokenmill.model.attention import AttentionMetadata, Int8KVCache

MAX_TOKENS = 8  # the small-batch linear kernels' row limit (PackedWeight.SMALL_ROWS, Int8LinearMethod.SMALL_ROWS)
ANY = 1 << 62  # max_tokens of a stack that runs decode steps of any size
LIN_SLOTS_PY, LAYER_SLOTS_PY = 6, 4 + 4 * 6  # the weight-list layout of csrc's decoder_stack (LIN_SLOTS, LAYER_SLOTS)
KIND_FLOAT, KIND_VNNI, KIND_INT8_FLOAT_ACT, KIND_AVX2_INT8 = 0, 1, 2, 3


def fast_path_by_env() -> bool:
    """TOKENMILL_DECODE_FAST_PATH (default 1): the small-batch decode fast path (the runner's decode-only input
    building, the C++-held stack arguments); 0: the reference path for both."""
    v = os.environ.get("TOKENMILL_DECODE_FAST_PATH", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_DECODE_FAST_PATH must be 0 or 1, got {v!r}")
    return v == "1"


def enabled_by_env() -> bool:
    v = os.environ.get("TOKENMILL_FUSED_DECODE", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_FUSED_DECODE must be 0 or 1, got {v!r}")
    return v == "1"


class _HeldList(list):
    """A list whose item assignment drops its owner's C++ handle (the handle holds a copy of the list)."""

    def __init__(self, items, owner):
        super().__init__(items)
        self._owner = owner

    def __setitem__(self, i, v):
        super().__setitem__(i, v)
        self._owner._handle = None


# what DecodeStackHandle holds a copy of: setting any of them (or an item of the lists) drops the handle, so the next
# call builds it again from the new values
_HELD = frozenset({"kernels", "weights", "kinds", "final_norm", "eps", "scale", "nh", "nkv", "hd", "inter"})


class FusedDecodeStack:
    """Per-layer tensor lists for `decoder_stack`, built once after the weights are loaded."""

    def __setattr__(self, name, value):
        if name in ("weights", "kinds"):
            value = _HeldList(value, self)
        super().__setattr__(name, value)
        if name in _HELD:
            super().__setattr__("_handle", None)

    def __init__(self, kernels, weights: list[torch.Tensor], kinds: list[int], final_norm: torch.Tensor,
                 eps: float, nh: int, nkv: int, hd: int, inter: int, scale: float, max_tokens: int = MAX_TOKENS):
        self.kernels, self.weights, self.kinds, self.final_norm = kernels, weights, kinds, final_norm
        self.eps, self.nh, self.nkv, self.hd, self.inter, self.scale = eps, nh, nkv, hd, inter, scale
        self.max_tokens = max_tokens  # the largest step it runs (ANY, or MAX_TOKENS when a linear has no big path)
        # the most rows for which every linear here takes its small-row kernel (any_linear): AMX's amx_rows() when
        # every linear is bf16 with an AMX-packed weight (slot 1), else MAX_TOKENS. Under linear.small_row_bits a
        # bigger step runs here too: the C++ linears follow that switch (set_small_row_bits, csrc any_linear)
        amx = all(k == KIND_FLOAT for k in kinds) and all(
            weights[i * LAYER_SLOTS_PY + 4 + j * LIN_SLOTS_PY + 1].numel() > 0
            for i in range(len(kinds) // 4) for j in range(4))
        self.bits_rows = int(kernels.amx_rows()) if amx and hasattr(kernels, "amx_rows") else MAX_TOKENS
        self._caches_key: tuple | None = None
        self._caches: list[torch.Tensor] = []
        # the C++-held arguments (built at the first call: the rope tables come with it); None: pass them per call
        self.use_handle = fast_path_by_env() and hasattr(kernels, "DecodeStackHandle")
        self._handle = None  # also dropped whenever a held attribute is set (__setattr__, _HeldList)
        self._handle_rope: tuple | None = None  # (cos, sin) the handle holds
        self._handle_caches: tuple | None = None  # the cache-list key the handle holds

    @staticmethod
    def _linear_slots(lin, kernels) -> tuple[int, list[torch.Tensor], bool] | None:
        """(kind, [weight, int8 row sums, int8 scales, bias, oneDNN-packed weight, int8 weight [K, N]], whether
        steps of more than MAX_TOKENS rows can run it) or None when this Linear has no small-row kernel."""
        empty = torch.empty(0)
        bias = lin.bias if lin.bias is not None else empty
        if hasattr(lin, "w8") and getattr(lin, "avx2_panels", None) is not None:  # AVX2 exact int8, any row count
            return KIND_AVX2_INT8, [lin.w8_gemv, empty, lin.w_scale, bias, empty, lin.avx2_panels], True
        if hasattr(lin, "w8"):
            big = [empty, lin.w8_t] if lin.int8_gemm else [empty, empty]  # no int8 GEMM: modules use fp32 math
            if lin.int8_gemm and lin.in_features % 64 == 0 and kernels.has_vnni_small():
                return KIND_VNNI, [lin.w8, lin.w8_sum, lin.w_scale, bias] + big, lin.int8_gemm
            return KIND_INT8_FLOAT_ACT, [lin.w8, empty, lin.w_scale, bias] + big, lin.int8_gemm
        if lin.packed is None or lin.packed.small is None:  # the module path runs F.linear / oneDNN here
            return None
        amx = lin.packed.amx if lin.packed.amx is not None else empty  # any_linear runs <= amx_rows() rows on AMX with it
        return KIND_FLOAT, [lin.packed.weight, amx, empty, bias, lin.packed.packed, empty], True

    @classmethod
    def build(cls, model) -> "FusedDecodeStack | None":
        from tokenmill.model.cpu_kernels import kernels_for

        if not enabled_by_env() or not model.layers:
            return None
        w0 = model.embed_tokens.weight
        kernels = kernels_for(w0)
        if kernels is None or not hasattr(kernels, "decoder_stack"):
            return None
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        any_size = True
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
                any_size &= slots[2]
        att = model.layers[0].self_attn
        return cls(kernels, weights, kinds, model.norm.weight, model.cfg.rms_norm_eps, att.nh, att.nkv, att.hd,
                   model.layers[0].mlp.inter, att.scale, ANY if any_size else MAX_TOKENS)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """This step is one the fused path runs: all tokens decode-style, at most `max_tokens` of them, x in a
        dtype the kernels take."""
        t = x.shape[0]
        return (0 < t <= self.max_tokens and not meta.spans and meta.decode_token_idx is not None
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
        caches = self._cache_list(kv_caches)
        if self.use_handle and hasattr(self.kernels, "DecodeStackHandle"):
            h = self._handle
            if h is None or self._handle_rope[0] is not rope.cos or self._handle_rope[1] is not rope.sin:
                h = self._handle = self.kernels.DecodeStackHandle(
                    self.weights, self.kinds, rope.cos, rope.sin, self.final_norm, self.eps, self.scale, 0, self.nh,
                    self.nkv, self.hd, self.inter)
                self._handle_rope, self._handle_caches = (rope.cos, rope.sin), None
            if self._handle_caches is not self._caches_key:
                h.set_caches(caches)
                self._handle_caches = self._caches_key
            return h.run(x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_ctx_lens,
                         meta.sliding_window or 0)
        return self.kernels.decoder_stack(
            x, positions, rope.cos, rope.sin, self.weights, self.kinds, caches,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_ctx_lens, self.final_norm, self.eps, self.scale,
            meta.sliding_window or 0, self.nh, self.nkv, self.hd, self.inter)
