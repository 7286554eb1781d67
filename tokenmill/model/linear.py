"""The linear-layer seam: every projection is a `Linear` whose math is delegated to a `LinearMethod`.

Quantized formats slot in as new LinearMethods (registered in LINEAR_METHODS) that create their own
parameters and apply them; the model code and the loader do not change. Fused projections (qkv, gate_up)
are one Linear with named output shards, loaded shard by shard from the checkpoint's separate tensors.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.cpu_kernels import get_kernels, kernels_for
from tokenmill.model.invariant import _ON as _TILES, ROW_TILE, by_row_tiles
from tokenmill.model.row_buckets import onednn_rows


_SMALL_BITS = [False]  # inside `small_row_bits(True)`: calls of any row count get the small-row kernel's bits


def small_row_bits_on() -> bool:
    """Inside `small_row_bits(True)`: callers that run their own kernels must give every row the small-row kernel's
    bits too (the fused decoder stacks' C++ linears follow the switch through `set_small_row_bits`)."""
    return _SMALL_BITS[0]


@contextmanager
def small_row_bits(on: bool):
    """Within the block, PackedWeight calls with more than `small_limit` rows (SMALL_ROWS; AMX: amx_rows()) compute
    every row with the exact bits the small-row kernel gives it (AMX, `linear_rows_bf16`, or linear_small over
    chunks of rows) instead of oneDNN.

    Why: each kernel is row-invariant on its own (linear_small's per-row sum does not depend on the row count;
    oneDNN's rows are the same bits for any count above SMALL_ROWS: tests/model/test_batch_invariant.py checks
    both), but the two differ in the last bits, which in bf16 flips near-tie argmaxes. A speculative verify step
    has more rows than the step it stands for (n decodes + their drafts), and the tail of a batch or a preemption
    changes a position's step: a batch-invariant runner (EngineConfig.batch_invariant, the bf16 default) runs every
    step under it, so a row's bits never depend on its step's row count; without that, the runner turns it on when
    the step *without* drafts would have had at most `small_row_limit(model)` rows. The fused stacks' C++ linears
    follow the switch (`set_small_row_bits`)."""
    if not on:
        yield
        return
    prev = _SMALL_BITS[0]
    _SMALL_BITS[0] = True
    k = get_kernels()
    mirror = getattr(k, "set_small_row_bits", None)  # the fused stacks' C++ linears (any_linear) follow it
    if mirror is not None:
        mirror(True)
    try:
        yield
    finally:
        _SMALL_BITS[0] = prev
        if mirror is not None:
            mirror(prev)


class LinearMethod:
    """How a Linear stores and applies its weights."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Called once the checkpoint is in and the model is on its device (repack, quantize, ...)."""


def avx2_int8_by_env() -> bool:
    """TOKENMILL_AVX2_INT8 (default 1): on a CPU without int8 dot products, int8 linears run the AVX2 exact
    kernels (csrc/int8_gemm.cpp); 0: the path before them (read when the weights are loaded)."""
    v = os.environ.get("TOKENMILL_AVX2_INT8", "1")
    if v not in ("0", "1"):
        raise ValueError(f"TOKENMILL_AVX2_INT8 must be 0 or 1, got {v!r}")
    return v == "1"


def onednn_available() -> bool:
    """oneDNN fp32 GEMM with prepacked weights: on this kind of CPU it runs the small-batch shapes of decode
    (and the vocab-wide lm_head) up to ~1.5x faster than MKL's sgemm behind F.linear.
    TOKENMILL_ONEDNN=0 turns it off."""
    if os.environ.get("TOKENMILL_ONEDNN", "1") == "0":
        return False
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def amx_on(kernels) -> bool:
    """The compiled kernels have AMX bf16 tiles and this process may use them (the CPU has amx_bf16, the OS
    grants the tile state, ONEDNN_MAX_CPU_ISA does not cap AMX away, TOKENMILL_AMX is not 0)."""
    return kernels is not None and hasattr(kernels, "has_amx_bf16") and bool(kernels.has_amx_bf16())


def onednn_bf16() -> bool:
    """oneDNN runs bf16 GEMMs on native instructions here (avx512_bf16 / AMX); elsewhere it emulates them,
    far slower than fp32, and bf16 weights stay on PyTorch's path."""
    from tokenmill.hardware import capabilities

    return capabilities().native_bf16


class PackedWeight:
    """A [N, K] fp32 or bf16 CPU weight reordered once into oneDNN's blocked layout; y = x W^T (+ b).

    Calls with at most SMALL_ROWS rows (decode at small batch: memory-bound) stream the plain weight once
    through the C++ `linear_small` kernel instead, which reads it nearer the memory bandwidth than either
    blocked GEMM. The plain weight is kept for that (weights are held twice on CPU)."""

    BATCH_HINT = 64  # the row count oneDNN picks its blocking for (decode batches; prefill is not sensitive)
    SMALL_ROWS = 8

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()  # the plain weight (same storage), for small batches
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, self.BATCH_HINT)
        from tokenmill.model.cpu_kernels import get_kernels

        k = get_kernels()
        self.small = k.linear_small if k is not None and weight.is_contiguous() else None
        self.rows_bf16 = getattr(k, "linear_rows_bf16", None) if self.small is not None else None
        # AMX CPUs: bf16 small-row calls run on AMX tiles (csrc/amx_linear.cpp), 1-16 rows at ~1-row cost, from a
        # third copy of the weight in the tiles' pair layout; every small-row path of the model then has AMX bits
        # (up to `small_limit` rows, `amx_rows()`: faster than oneDNN there, see csrc/amx_linear.cpp)
        self.amx = None
        self.small_limit = self.SMALL_ROWS  # calls of at most this many rows take the small-row kernel
        if self.small is not None and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and amx_on(k):
            self.amx = k.lm_head_pack_bf16(self.weight)
            self.amx_linear = k.linear_amx_bf16
            self.small_limit = int(k.amx_rows())

    def small_rows(self, y: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None) -> None:
        """y = x2 W^T (+ b) with the small-row kernel's bits (AMX, else linear_small: at most SMALL_ROWS rows)."""
        if self.amx is None or not self.amx_linear(y, x2, self.amx, bias):
            self.small(y, x2, self.weight, bias)

    def small_bits(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Any number of rows, each with the bits the small-row kernel gives it: AMX (any rows in one call), the
        batch-invariant bf16 kernel (one pass over the weight), else linear_small over chunks of SMALL_ROWS rows."""
        y = torch.empty(x2.shape[0], self.weight.shape[0], dtype=x2.dtype)
        if self.amx is not None and self.amx_linear(y, x2, self.amx, bias):
            return y
        if self.rows_bf16 is not None and self.rows_bf16(y, x2, self.weight, bias):
            return y
        for i in range(0, x2.shape[0], self.SMALL_ROWS):
            self.small(y[i:i + self.SMALL_ROWS], x2[i:i + self.SMALL_ROWS], self.weight, bias)
        return y

    @staticmethod
    def maybe(weight: torch.Tensor) -> "PackedWeight | None":
        if weight.device.type != "cpu" or not onednn_available():
            return None
        if weight.dtype != torch.float32 and not (weight.dtype == torch.bfloat16 and onednn_bf16()):
            return None
        try:
            return PackedWeight(weight)
        except RuntimeError:  # a build whose oneDNN lacks the op for this shape: plain F.linear
            return None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if self.small is not None and 0 < m <= self.small_limit:
            y = torch.empty(m, self.weight.shape[0], dtype=x.dtype)
            self.small_rows(y, x2.contiguous(), bias)
        elif self.small is not None and m and _SMALL_BITS[0]:
            y = self.small_bits(x2.contiguous(), bias)
        else:
            mp = onednn_rows(m)
            if mp != m:  # a bucketed row count (onednn_rows): zero rows appended, dropped after
                xp = x2.new_zeros(mp, x2.shape[1])
                xp[:m] = x2
                y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, bias, "none", [], "")[:m]
            else:
                y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")
        return y.view(*lead, y.shape[-1])


def small_row_limit(module: nn.Module) -> int:
    """The most rows for which every Linear in `module` computes with its small-row kernel (so a step of at most
    this many rows has the small-row bits without `small_row_bits`): AMX's `amx_rows()` where every linear is a
    bf16 PackedWeight on AMX, else PackedWeight.SMALL_ROWS (the AVX-512/AVX2 and int8 small-row kernels)."""
    limits = [lin.packed.small_limit if isinstance(getattr(lin, "packed", None), PackedWeight)
              and lin.packed.small is not None else PackedWeight.SMALL_ROWS
              for lin in module.modules() if isinstance(lin, Linear)]
    return min(limits, default=PackedWeight.SMALL_ROWS)


def any_row_bits_kernels(module: nn.Module) -> bool:
    """True where every Linear in `module` is a bf16 PackedWeight with a kernel of the engine's own that computes any
    number of rows with the small-row bits in one pass (AMX tiles, or `linear_rows_bf16` on AVX-512 BF16): there
    `small_row_bits(True)` on every step (EngineConfig.batch_invariant) costs little (benchmarks/batch_invariant.py)."""
    lins = [lin for lin in module.modules() if isinstance(lin, Linear)]
    return bool(lins) and all(
        isinstance(getattr(lin, "packed", None), PackedWeight) and lin.packed.weight.dtype == torch.bfloat16
        and lin.packed.small is not None and (lin.packed.amx is not None or lin.packed.rows_bf16 is not None)
        for lin in lins)


def small_bits_kernels(module: nn.Module) -> bool:
    """True where every Linear in `module` is a PackedWeight with the C++ small-row kernel (fp32 or bf16): there
    `small_row_bits(True)` makes every row's bits independent of the row count (batch_invariant "on" needs it)."""
    lins = [lin for lin in module.modules() if isinstance(lin, Linear)]
    return bool(lins) and all(isinstance(getattr(lin, "packed", None), PackedWeight) and lin.packed.small is not None
                              for lin in lins)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)
        layer.bias = (nn.Parameter(torch.zeros(layer.out_features, dtype=dtype), requires_grad=False)
                      if layer.has_bias else None)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:
            return layer.packed(x, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.packed = PackedWeight.maybe(layer.weight)  # beside the plain weight, which small batches read


class Int8LinearMethod(UnquantizedLinearMethod):
    """W8A8 dynamic: the checkpoint's weights are quantized at load time per output channel (symmetric,
    scale = max|w_n| / 127); at run time each activation row gets its own scale, and the product runs as a real
    int8 GEMM (`torch._int_mm`, int32 accumulation) between a fused C++ quantize and a fused dequantize
    (scales and bias applied in one pass). Calls with at most 8 rows (decode at small batch: memory-bound)
    stream the int8 weights once instead: with AVX-512 VNNI through `linear_small_vnni` (the same W8A8 product,
    bit-identical int32 sums, 64 int8 products per instruction: ~3x `linear_small_int8` on the demo shapes).
    On a CPU without int8 dot products (AVX2 only: oneDNN's int8 GEMM is not safe there, `int8_gemm` False) the
    same W8A8 product runs through the AVX2 exact kernels of csrc/int8_gemm.cpp: `avx2_int8_gemv` for at most 8
    rows (the int8 weight streamed once; int8 x int8 via vpmaddubsw where K % 32 == 0, from a copy of the weight
    in the order it reads them, `w8_gemv`, where N % 8 == 0 too), `avx2_int8_gemm` above (int16 weight panels packed here at load time,
    vpmaddwd into int32): bit-identical to quantize_rows + an int32 product + dequant_rows, for any row count.
    TOKENMILL_AVX2_INT8=0 restores the path before them there (`linear_small_int8`, W8 with float activations, for
    <= 8 rows; the dequantize-to-fp32 matmul above). Nothing is dequantized to a float matmul on the hot path."""

    SMALL_ROWS = 8

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self._use_int8(layer, q, scale)

    @staticmethod
    def _use_int8(layer: "Linear", q: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep int8 weights `q` [N, K] with per-output-channel fp32 `scale` [N] for apply()."""
        layer.w8 = q.contiguous()  # [N, K] for the small-batch kernel
        layer.w8_t = q.t().contiguous()  # [K, N] for torch._int_mm
        layer.w_scale = scale.contiguous()
        layer.w8_sum = q.sum(dim=1, dtype=torch.int32)  # [N]: undoes the unsigned shift of the VNNI small path
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)  # freed
        layer.packed = None
        from tokenmill.hardware import capabilities

        # oneDNN's int8 GEMM without VNNI/AMX (AVX2's vpmaddubsw) saturates 16-bit partial sums: wrong results,
        # not just slow ones. There the int8 product runs dequantized in fp32 instead (exact, and slower: the
        # dequant tax on hardware without int8 dot products).
        layer.int8_gemm = layer.w8.device.type == "cpu" and capabilities().native_int8
        # no safe oneDNN int8 GEMM: the AVX2 exact kernels, with their int16 panels (2 bytes per weight) packed once
        layer.avx2_panels = None
        layer.w8_gemv = layer.w8  # what avx2_int8_gemv streams for <= 8 rows
        if layer.w8.device.type == "cpu" and not layer.int8_gemm and avx2_int8_by_env():
            k = get_kernels()
            if k is not None and hasattr(k, "has_avx2_int8") and k.has_avx2_int8():
                layer.avx2_panels = k.avx2_int8_pack(layer.w8)
                n, k_in = layer.w8.shape
                if n % 8 == 0 and k_in % 32 == 0 and hasattr(k, "avx2_int8_pack8"):
                    # the same int8 weights in the order the vpmaddubsw GEMV reads them: one sequential stream
                    # (~1.5x its DRAM rate at 1-4 rows on the AVX2 machine, the same bits: csrc/int8_gemm.cpp)
                    layer.w8_gemv = k.avx2_int8_pack8(layer.w8)
                # the [K, N] copy serves torch._int_mm, never called on this path (the fallback below reads w8):
                # 1 byte per weight of host memory less (4 instead of 5 on the AVX2 path)
                layer.w8_t = None

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        lead, k_in = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k_in).contiguous()
        m, n = x2.shape[0], layer.out_features
        kernels = kernels_for(x2)
        if kernels is not None and m > 0 and getattr(layer, "avx2_panels", None) is not None:
            out = torch.empty(m, n, dtype=x.dtype)  # exact W8A8, the same bits for any m (csrc/int8_gemm.cpp)
            if m > self.SMALL_ROWS or not kernels.avx2_int8_gemv(out, x2, layer.w8_gemv, layer.w_scale, layer.bias):
                kernels.avx2_int8_gemm(out, x2, layer.avx2_panels, layer.w_scale, layer.bias)
        elif kernels is not None and m > 0 and (m <= self.SMALL_ROWS or layer.int8_gemm):
            out = torch.empty(m, n, dtype=x.dtype)
            if m <= self.SMALL_ROWS and k_in % 64 == 0 and layer.int8_gemm and kernels.has_vnni_small():
                kernels.linear_small_vnni(out, x2, layer.w8, layer.w8_sum, layer.w_scale, layer.bias)
            elif m <= self.SMALL_ROWS:
                kernels.linear_small_int8(out, x2, layer.w8, layer.w_scale, layer.bias)
            else:
                q = torch.empty(m, k_in, dtype=torch.int8)
                sx = torch.empty(m, dtype=torch.float32)
                kernels.quantize_rows(q, sx, x2)
                kernels.dequant_rows(out, torch._int_mm(q, layer.w8_t), sx, layer.w_scale, layer.bias)
        else:  # no int8 dot products, CUDA, fp16 or no compiler: the same W8A8 math, products in fp32
            xf = x2.float()
            sx = (xf.abs().amax(dim=1, keepdim=True) / 127.0)
            sx = torch.where(sx > 0, sx, torch.ones_like(sx))
            q = torch.round(xf * (1.0 / sx)).clamp_(-127, 127)  # quantize_rows' arithmetic (x times 1/s)
            # fp32 sums: exact while every partial sum stays below 2^24 (guaranteed for 127*127*K < 2^24: K <= 1040)
            wt = layer.w8_t if layer.w8_t is not None else layer.w8.t()
            y = (q @ wt.float()) * sx * layer.w_scale
            out = (y + layer.bias.float() if layer.bias is not None else y).to(x.dtype)
        return out.view(*lead, n)


class CheckpointInt8LinearMethod(Int8LinearMethod):
    """A pre-quantized int8 W8A8 checkpoint (compressed-tensors, see quant_config.py): the checkpoint's int8
    `weight` [N, K] and per-channel `weight_scale` load straight into the int8 storage (nothing is
    re-quantized); run time is `Int8LinearMethod`'s (activations quantized per token)."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)  # the bias (if any) in the model dtype
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.int8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, dtype=torch.float32), requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        scale = layer.weight_scale.detach()
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError("checkpoint weight_scale holds a non-positive or non-finite scale")
        self._use_int8(layer, layer.weight.detach(), scale.contiguous())


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (e4m3 values [M, K], fp32 scales [M, 1]) with x ~= q * s per row: s = max|x_row| / 448
    (an all-zero row gets s = 1), q = x / s cast to e4m3 (round to nearest even; |x / s| <= 448, nothing clips)."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8), s


class Fp8LinearMethod(UnquantizedLinearMethod):
    """FP8 W8A8 dynamic (`--quantization fp8`), the float twin of `Int8LinearMethod`: weights cast to e4m3 at load
    time with one fp32 scale per output channel (max|w_n| / 448), activations per token at run time, and the
    product through `torch._scaled_mm` with both row-wise scales applied in its epilogue (fp32 accumulation; on
    CUDA sm89+ the fp8 tensor cores: nothing is dequantized on the hot path). On a CPU (or a GPU below sm89)
    there are no fp8 instructions: PyTorch's CPU `_scaled_mm` converts both operands to fp32 first, the
    dequant tax (~60x slower than fp32 at batch 1 on an AVX2 EPYC: docs/benchmarks.md); the engine says so at
    start-up and refuses it on CUDA below sm89, where `_scaled_mm` has no kernel. The lm_head and embeddings stay
    in the model dtype (not measured safe in fp8)."""

    def process_weights_after_loading(self, layer: "Linear") -> None:
        self._use_fp8(layer, *fp8_quantize_rows(layer.weight.detach()))

    @staticmethod
    def _use_fp8(layer: "Linear", q: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep e4m3 weights `q` [N, K] with per-output-channel fp32 `scale` (N values) for apply()."""
        n, k = q.shape
        if q.device.type == "cuda" and (n % 16 or k % 16):
            raise ModelLoadError(f"fp8 weights: a [{n}, {k}] projection; torch._scaled_mm on CUDA needs both "
                                 "dimensions divisible by 16")
        layer.w_fp8 = q.contiguous()  # [N, K] row-major: its .t() is the column-major [K, N] operand _scaled_mm wants
        layer.w_scale = scale.float().reshape(1, n).contiguous()  # [1, N] fp32
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype, device=q.device), requires_grad=False)
        layer.packed = None

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        lead, k_in = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k_in)
        n = layer.out_features
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        q, sx = fp8_quantize_rows(x2)
        # CUDA's row-wise _scaled_mm writes bf16 only; the CPU one writes the activation dtype directly
        out_dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
        y = torch._scaled_mm(q, layer.w_fp8.t(), scale_a=sx, scale_b=layer.w_scale, out_dtype=out_dtype)
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.to(x.dtype).view(*lead, n)


class CheckpointFp8LinearMethod(Fp8LinearMethod):
    """A pre-quantized fp8 W8A8 checkpoint (compressed-tensors float-quantized, see quant_config.py): the checkpoint's
    float8_e4m3fn `weight` [N, K] and per-channel `weight_scale` load straight into the fp8 storage (nothing is
    re-quantized); run time is `Fp8LinearMethod`'s."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)  # the bias (if any) in the model dtype
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, dtype=torch.float32), requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        scale = layer.weight_scale.detach()
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError("checkpoint weight_scale holds a non-positive or non-finite scale")
        self._use_fp8(layer, layer.weight.detach(), scale)


LINEAR_METHODS: dict[str, Callable[[], LinearMethod]] = {"none": UnquantizedLinearMethod, "int8": Int8LinearMethod,
                                                         "fp8": Fp8LinearMethod,
                                                         "compressed-tensors-w8a8": CheckpointInt8LinearMethod,
                                                         "compressed-tensors-w8a8-fp8": CheckpointFp8LinearMethod}
QUANTIZATIONS = ("none", "int8", "fp8")  # what --quantization offers; checkpoint formats come from config.json


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names the fused outputs in order, e.g. [("q", 512), ("k", 128), ("v", 128)]."""

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 shards: list[tuple[str, int]] | None = None, dtype: torch.dtype = torch.float32,
                 method: LinearMethod | None = None):
        super().__init__()
        self.shards = shards or [("", out_features)]
        self.in_features = in_features
        self.out_features = sum(n for _, n in self.shards)
        if out_features is not None and out_features != self.out_features:
            raise ValueError("out_features disagrees with shards")
        self.has_bias = bias
        self.method = method or UnquantizedLinearMethod()
        self.packed: PackedWeight | None = None  # set by the method after loading, if it repacks
        self.method.create_weights(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _TILES[0] and x.dim() == 2 and x.shape[0] != ROW_TILE:  # batch-invariant on CUDA (model/invariant.py)
            return by_row_tiles(lambda c: self.method.apply(self, c), x)
        return self.method.apply(self, x)

    def shard_range(self, shard: str) -> tuple[int, int]:
        start = 0
        for name, n in self.shards:
            if name == shard:
                return start, start + n
            start += n
        raise KeyError(shard)

    def load(self, kind: str, shard: str, tensor: torch.Tensor, name: str) -> None:
        """Copy checkpoint tensor `name` (kind 'weight', 'bias' or, pre-quantized, 'weight_scale') into output
        shard `shard`."""
        param = getattr(self, kind, None)
        if param is None:
            raise ModelLoadError(f"unexpected tensor {name}: this layer has no {kind}")
        quantized = (torch.int8, FP8)  # stored values, not floats to convert: the checkpoint's type must be ours
        if (param.dtype in quantized or tensor.dtype in quantized) and param.dtype != tensor.dtype:
            raise ModelLoadError(f"tensor {name} is {tensor.dtype}, expected {param.dtype}")
        if kind == "weight_scale" and tensor.dim() == 2 and tensor.shape[1] == 1:
            tensor = tensor[:, 0]  # compressed-tensors stores per-channel scales as [N, 1]
        lo, hi = self.shard_range(shard)
        target = param.data[lo:hi]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor.to(param.dtype))
