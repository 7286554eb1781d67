"""The bf16 lm_head on CPUs with AVX-512 BF16: the vocabulary-wide weight prepacked once for vdpbf16ps
(csrc/lm_head.cpp), logits for any number of rows, and the greedy token of each row without writing the logits.

`PackedHead.build(weight)` returns None where it does not apply (not a bf16 CPU weight, no compiled kernel, an odd
hidden size, TOKENMILL_LM_HEAD=0); then `LlamaModel.compute_logits` keeps the module path (oneDNN / linear_small),
which stays the reference. Each row's logits are the same bits whatever the number of rows in the call, and
`greedy(h)` is exactly `logits(h).argmax(-1)` (torch.argmax's first-maximum and NaN rules): the kernel compares
the same bf16-rounded values it would store (tests/model/test_lm_head.py).
"""

from __future__ import annotations

import os

import torch


def enabled_by_env() -> bool:
    v = os.environ.get("TOKENMILL_LM_HEAD", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_LM_HEAD must be 0 or 1, got {v!r}")
    return v == "1"


class PackedHead:
    """logits = h W^T for a bf16 head W [V, K] without bias (a tied embedding or an untied lm_head)."""

    def __init__(self, kernels, packed: torch.Tensor, vocab: int, hidden: int):
        self.kernels, self.packed, self.vocab, self.hidden = kernels, packed, vocab, hidden

    @classmethod
    def build(cls, weight: torch.Tensor) -> "PackedHead | None":
        from tokenmill.model.cpu_kernels import kernels_for

        if not enabled_by_env() or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
            return None
        k = kernels_for(weight)
        if k is None or not hasattr(k, "has_lm_head_bf16") or not k.has_lm_head_bf16():
            return None
        return cls(k, k.lm_head_pack_bf16(weight.detach()), weight.shape[0], weight.shape[1])

    def applies(self, h: torch.Tensor) -> bool:
        return h.dtype == torch.bfloat16 and h.device.type == "cpu" and h.dim() == 2 and h.shape[1] == self.hidden

    def applies_greedy(self, h: torch.Tensor) -> bool:
        return self.applies(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, K] bf16 -> [M, V] bf16."""
        out = torch.empty(h.shape[0], self.vocab, dtype=torch.bfloat16)
        self.kernels.lm_head_bf16(out, h.contiguous(), self.packed, self.vocab)
        return out

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, K] bf16 -> [M] int64: the argmax of `logits(h)` per row, without the logits."""
        out = torch.empty(h.shape[0], dtype=torch.long)
        self.kernels.lm_head_argmax_bf16(out, h.contiguous(), self.packed, self.vocab)
        return out


class Int8PackedHead:
    """The int8 W8A8 head (`--quantization int8`) on CPUs with AVX-512 VNNI: the head Linear's int8 weights
    prepacked for vpdpbusd; logits in the hidden states' dtype (rows quantized per token as everywhere in W8A8,
    exact int32 sums, one fp32 epilogue shared by `logits` and `greedy`), batch-invariant like PackedHead."""

    def __init__(self, kernels, packed: torch.Tensor, wsum: torch.Tensor, sw: torch.Tensor, vocab: int, hidden: int,
                 w8_t: torch.Tensor | None = None):
        self.kernels, self.packed, self.wsum, self.sw = kernels, packed, wsum, sw
        self.vocab, self.hidden = vocab, hidden
        # above MAX_ROWS: the head Linear's [K, V] int8 weight for torch._int_mm, then csrc/head_argmax.cpp (the
        # greedy token through dequant_rows' epilogue without the logits); None: those steps keep the module path
        self.w8_t = w8_t if w8_t is not None and hasattr(kernels, "head_argmax_int8") else None

    @classmethod
    def build(cls, head) -> "Int8PackedHead | Avx2Int8Head | None":
        """`head`: an Int8LinearMethod Linear (w8 [V, K], w8_sum, w_scale) without bias: this kernel with native int8,
        `Avx2Int8Head` on a CPU without int8 dot products."""
        from tokenmill.model.cpu_kernels import kernels_for

        if not enabled_by_env() or not hasattr(head, "w8") or head.bias is not None:
            return None
        if not head.int8_gemm:  # no int8 dot products (AVX2 only): the AVX2 exact head, where it applies
            return Avx2Int8Head.build(head)
        w8 = head.w8
        if w8.dim() != 2 or w8.shape[1] % 4 or w8.device.type != "cpu":
            return None
        k = kernels_for(head.w_scale)
        if k is None or not hasattr(k, "has_lm_head_int8") or not k.has_lm_head_int8():
            return None
        v, h = w8.shape
        pad = -(-v // 64) * 64
        wsum = torch.zeros(pad, dtype=torch.int32)
        wsum[:v] = head.w8_sum
        sw = torch.zeros(pad, dtype=torch.float32)
        sw[:v] = head.w_scale
        return cls(k, k.lm_head_pack_int8(w8), wsum, sw, v, h, getattr(head, "w8_t", None))

    # measured (benchmarks/lm_head_kernels.py): 1.3-4x the Int8LinearMethod path + argmax_rows up to 8 rows, but
    # 0.85-1.0x at 33-64 rows, where torch._int_mm is faster; the logits are the same bits either way
    MAX_ROWS = 8

    def applies(self, h: torch.Tensor) -> bool:
        return (h.dtype in (torch.bfloat16, torch.float32) and h.device.type == "cpu" and h.dim() == 2
                and h.shape[1] == self.hidden and h.shape[0] <= self.MAX_ROWS)

    def applies_greedy(self, h: torch.Tensor) -> bool:
        """`greedy(h)` runs: `applies`, or more rows with the int8 GEMM + fused argmax (any row count)."""
        if self.applies(h):
            return True
        return (self.w8_t is not None and h.dtype in (torch.bfloat16, torch.float32) and h.device.type == "cpu"
                and h.dim() == 2 and h.shape[1] == self.hidden and h.shape[0] > 0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty(h.shape[0], self.vocab, dtype=h.dtype)
        self.kernels.lm_head_int8(out, h.contiguous(), self.packed, self.wsum, self.sw, self.vocab)
        return out

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax per row of the head's logits in h's dtype (exactly: the same epilogue and rounding)."""
        out = torch.empty(h.shape[0], dtype=torch.long)
        h = h.contiguous()
        if h.shape[0] <= self.MAX_ROWS:
            self.kernels.lm_head_argmax_int8(out, h, self.packed, self.wsum, self.sw, self.vocab)
            return out
        # more rows: Int8LinearMethod's quantize + torch._int_mm (faster than the packed kernel here), then the
        # dequant epilogue and the argmax in one pass, without the [rows, vocab] logits
        q = torch.empty(h.shape, dtype=torch.int8)
        sx = torch.empty(h.shape[0], dtype=torch.float32)
        self.kernels.quantize_rows(q, sx, h)
        self.kernels.head_argmax_int8(out, torch._int_mm(q, self.w8_t), sx, self.sw, h.dtype == torch.bfloat16)
        return out


class Avx2Int8Head:
    """The int8 W8A8 head on CPUs without int8 dot products (AVX2 only), where `Int8PackedHead` does not apply: the
    head Linear's plain int8 weight [V, K] streamed once by csrc/int8_gemm.cpp's vpmaddubsw GEMV (exact int32 sums),
    parallel over the vocabulary. `greedy` fuses the argmax into it (`avx2_int8_head_argmax`: the logits are
    neither written nor read back); `logits` is the head Linear's own call (`avx2_int8_gemv`), so both are the
    module path's bits: `greedy(h)` is exactly `head(h).argmax(-1)` (tests/model/test_int8_avx2.py). At most
    MAX_ROWS rows (the GEMV's limit); more rows keep the module path (avx2_int8_gemm, then argmax)."""

    MAX_ROWS = 8

    def __init__(self, kernels, head):
        self.kernels, self.head = kernels, head
        self.vocab, self.hidden = head.w8.shape

    @classmethod
    def build(cls, head) -> "Avx2Int8Head | None":
        """`head`: an Int8LinearMethod Linear without bias that runs the AVX2 exact kernels (`avx2_panels` set:
        TOKENMILL_AVX2_INT8=1 on a CPU without a safe int8 GEMM); None where the kernel's shape limits rule it out."""
        from tokenmill.model.cpu_kernels import kernels_for

        if getattr(head, "avx2_panels", None) is None or head.bias is not None:
            return None
        v, h = head.w8.shape
        if v % 8 or v < 8 or h % 32 or h > 8192 or head.w8.device.type != "cpu":
            return None
        k = kernels_for(head.w_scale)
        if k is None or not hasattr(k, "avx2_int8_head_argmax"):
            return None
        return cls(k, head)

    def applies(self, h: torch.Tensor) -> bool:
        return (h.dtype in (torch.bfloat16, torch.float32) and h.device.type == "cpu" and h.dim() == 2
                and h.shape[1] == self.hidden and 0 < h.shape[0] <= self.MAX_ROWS)

    def applies_greedy(self, h: torch.Tensor) -> bool:
        return self.applies(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)  # Int8LinearMethod.apply: avx2_int8_gemv for <= 8 rows

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax per row of the head's logits in h's dtype, without the logits."""
        out = torch.empty(h.shape[0], dtype=torch.long)
        if not self.kernels.avx2_int8_head_argmax(out, h.contiguous(), self.head.w8_gemv, self.head.w_scale):
            raise RuntimeError("avx2_int8_head_argmax refused a shape applies() accepted")
        return out
