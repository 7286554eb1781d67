"""What the machine can compute fast: CPU instruction sets (avx2, avx512, bf16 and int8 dot products, AMX)
and the CUDA device's compute capability. Read once at start-up; printed in the engine's start-up line,
exported as `tokenmill_hardware_info` and written into every benchmark's output.

Precision follows from it (`--dtype auto`): bf16 only where there are native bf16 dot products
(avx512_bf16 or AMX on a CPU, sm80+ on CUDA); elsewhere bf16 math is emulated and far slower than fp32.
`ONEDNN_MAX_CPU_ISA` (oneDNN's own switch, e.g. `AVX2`) caps what counts as native, so one machine can show
what an older CPU gets.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

# the CPU flags that decide kernels and precision, in the order they are printed
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
             "amx_int8", "avx512_fp16")
# ONEDNN_MAX_CPU_ISA values, lowest first; bf16 dot products start at AVX512_CORE_BF16, int8 at AVX2_VNNI
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")


@dataclass(frozen=True)
class Capabilities:
    cpu_model: str
    cpu_flags: tuple[str, ...]  # those of CPU_FLAGS this CPU has
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA when set
    cuda_name: str | None = None
    cuda_capability: tuple[int, int] | None = None

    def _isa_allows(self, isa: str) -> bool:
        cap = (self.onednn_max_isa or "ALL").upper()
        if cap not in _ONEDNN_ISAS:
            return True  # a value we do not know: oneDNN decides; do not guess it away
        return _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index(isa)

    @property
    def native_bf16(self) -> bool:
        """The CPU has bf16 dot products (avx512_bf16 or AMX) and oneDNN may use them."""
        has = "avx512_bf16" in self.cpu_flags or "amx_bf16" in self.cpu_flags
        return has and self._isa_allows("AVX512_CORE_BF16")

    @property
    def amx_bf16(self) -> bool:
        """AMX bf16 tiles (Sapphire Rapids and later) on top of native bf16, and oneDNN may use them."""
        return (self.native_bf16 and "amx_tile" in self.cpu_flags and "amx_bf16" in self.cpu_flags
                and self._isa_allows("AVX512_CORE_AMX"))

    @property
    def native_int8(self) -> bool:
        """The CPU has int8 dot products (VNNI or AMX) and oneDNN may use them."""
        if "avx512_vnni" in self.cpu_flags or "amx_int8" in self.cpu_flags:
            return self._isa_allows("AVX512_CORE_VNNI")
        return "avx_vnni" in self.cpu_flags and self._isa_allows("AVX2_VNNI")

    @property
    def cuda_bf16(self) -> bool:
        return self.cuda_capability is not None and self.cuda_capability >= (8, 0)

    @property
    def cuda_fp8(self) -> bool:
        """fp8 (e4m3/e5m2) tensor cores: Ada (sm89) and Hopper (sm90) on; what `torch._scaled_mm` needs."""
        return self.cuda_capability is not None and self.cuda_capability >= (8, 9)

    @property
    def cuda_fp4(self) -> bool:
        """fp4 (nvfp4/mxfp4) tensor cores: Blackwell (sm100) on."""
        return self.cuda_capability is not None and self.cuda_capability >= (10, 0)

    def cuda_precisions(self) -> list[str]:
        """The low precisions this CUDA device has tensor cores for, e.g. ['bf16', 'fp8'] on an H100/H200."""
        return [name for name, ok in (("bf16", self.cuda_bf16), ("fp8", self.cuda_fp8), ("fp4", self.cuda_fp4)) if ok]

    def summary(self) -> str:
        """One line: 'AMD EPYC 9B14: avx2 fma avx512f avx512_bf16 avx512_vnni (bf16 native, int8 native)'."""
        cap = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        line = (f"{self.cpu_model}: {' '.join(self.cpu_flags) or 'no avx2'} "
                f"(bf16 {'native' if self.native_bf16 else 'emulated'}, "
                f"int8 {'native' if self.native_int8 else 'emulated'}{cap})")
        if self.cuda_name:
            line += (f"; CUDA {self.cuda_name} sm{self.cuda_capability[0]}{self.cuda_capability[1]} "
                     f"({' '.join(self.cuda_precisions()) or 'fp16 only'} native)")
        return line

    def to_json(self) -> dict:
        return {"cpu_model": self.cpu_model, "cpu_flags": list(self.cpu_flags),
                "onednn_max_isa": self.onednn_max_isa, "native_bf16": self.native_bf16,
                "native_int8": self.native_int8, "cuda_name": self.cuda_name,
                "cuda_capability": list(self.cuda_capability) if self.cuda_capability else None,
                "cuda_bf16": self.cuda_bf16, "cuda_fp8": self.cuda_fp8, "cuda_fp4": self.cuda_fp4}


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, the CPU_FLAGS present) from /proc/cpuinfo text."""
    model, flags = "unknown CPU", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, tuple(f for f in CPU_FLAGS if f in flags)


def detect(cpuinfo: str | None = None, env: dict | None = None) -> Capabilities:
    env = os.environ if env is None else env
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = parse_cpuinfo(cpuinfo)
    cuda_name = cuda_cap = None
    try:
        import torch

        if torch.cuda.is_available():
            cuda_name = torch.cuda.get_device_name(0)
            cuda_cap = tuple(torch.cuda.get_device_capability(0))
    except Exception:  # noqa: BLE001 - no usable CUDA is simply no CUDA
        pass
    return Capabilities(model, flags, env.get("ONEDNN_MAX_CPU_ISA") or None, cuda_name, cuda_cap)


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """This machine's capabilities (detected once per process)."""
    return detect()
