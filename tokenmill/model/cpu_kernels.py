"""Optional CPU kernels, compiled on first use with the system C++ compiler (torch cpp_extension).

`paged_decode_attention` reads K/V in place from the paged cache instead of gathering a padded copy;
`rms_norm` (optionally adding the residual in place first), `silu_mul` and `rope_inplace` fuse the
decoder layer's elementwise steps into one pass each. The pure-PyTorch paths in attention.py, layers.py
and llama.py are the fallback (and the reference the tests compare against).
Set TOKENMILL_CPU_KERNELS=0 to disable. Build output is cached under ~/.cache/torch_extensions, one
build per source text and ISA (shared by every checkout with the same sources).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("tokenmill.kernels")
_state: dict = {}


def _isa_flags() -> tuple[str, list[str]]:
    """(build-name suffix, compiler flags) for this CPU: AVX2+FMA, plus AVX-512 bf16 and int8 (VNNI) dot products
    where they are native (and not capped away by ONEDNN_MAX_CPU_ISA, so an older CPU can be emulated on this one)."""
    from tokenmill.hardware import capabilities

    caps = capabilities()
    if "avx2" not in caps.cpu_flags or "fma" not in caps.cpu_flags:
        return "", []
    flags, suffix = ["-mavx2", "-mfma"], "_avx2"
    avx512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
    if caps.native_bf16 and "avx512_bf16" in caps.cpu_flags:
        flags, suffix = flags + avx512 + ["-mavx512bf16"], "_avx512bf16"
    if caps.native_int8 and "avx512_vnni" in caps.cpu_flags:  # int8 dot products for small-batch W8A8
        flags, suffix = list(dict.fromkeys(flags + avx512 + ["-mavx512vnni"])), suffix + "_vnni"
    if caps.amx_bf16:  # AMX bf16 tiles: small-row linears and the lm_head at ~1-row cost for up to 16 rows
        flags, suffix = flags + ["-mamx-tile", "-mamx-bf16"], suffix + "_amx"
    return suffix, flags


# the extension's C++ sources (one module; paged_decode.cpp holds the module definition, which registers the rest)
SOURCES = ["paged_decode.cpp", "prefill_attention.cpp", "lm_head.cpp", "decode_gemv.cpp", "mixed_stack.cpp",
           "decode_step.cpp", "head_argmax.cpp", "int8_gemm.cpp", "amx_linear.cpp"]
HEADERS = ["simd_exp.h", "amx_tile.h"]  # included by the sources: part of the build digest
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # storage types; the math is fp32 in both


def kernels_for(x) -> object | None:
    """The compiled module when `x` is an fp32 or bf16 CPU tensor it can work on, else None (use PyTorch)."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES:
        return None
    return get_kernels()


def _content_addressed_sources(csrc: Path | None = None, root: Path | None = None) -> list[Path]:
    """The C++ sources, copied into a folder named after a digest of their text alone, so every checkout with the
    same sources (git worktrees, a fresh CI clone) shares one build: torch keys a build by its name *and* source
    paths, and two checkouts building the same text from their own paths would rebuild (~1-30 min each)."""
    csrc = csrc or Path(__file__).parent / "csrc"
    names = SOURCES + HEADERS
    texts = {f: (csrc / f).read_bytes() for f in names}
    digest = hashlib.sha256(b"".join(f.encode() + b"\0" + texts[f] for f in names)).hexdigest()[:12]
    root = root or Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    folder = root / "tokenmill_sources" / digest
    folder.mkdir(parents=True, exist_ok=True)
    for f in names:
        dst = folder / f
        if not dst.exists() or dst.read_bytes() != texts[f]:
            tmp = folder / f".{f}.{os.getpid()}.tmp"  # write then rename: a concurrent build never reads half a file
            tmp.write_bytes(texts[f])
            os.replace(tmp, dst)
    return [folder / f for f in SOURCES]


BUILD_NOTICE_S = 3.0  # a load still running after this long is a compile: say so (a built module loads in < 1 s)


def get_kernels():
    """The compiled module, or None when unavailable (no compiler, disabled, build error)."""
    if "mod" in _state:
        return _state["mod"]
    gemv = os.environ.get("TOKENMILL_DECODE_GEMV", "1")  # csrc/decode_gemv.cpp reads it; 0 = linear_small_vnni's loop
    if gemv not in ("0", "1"):
        raise ValueError(f"TOKENMILL_DECODE_GEMV must be 0 or 1, got {gemv!r}")
    amx = os.environ.get("TOKENMILL_AMX", "1")  # csrc/amx_tile.h reads it; 0 = no AMX tiles (the AVX-512 kernels)
    if amx not in ("0", "1"):
        raise ValueError(f"TOKENMILL_AMX must be 0 or 1, got {amx!r}")
    attn = os.environ.get("TOKENMILL_DECODE_ATTN", "1")  # csrc/paged_decode.cpp reads it; 0 = the reference kernel
    if attn not in ("0", "1"):
        raise ValueError(f"TOKENMILL_DECODE_ATTN must be 0 or 1, got {attn!r}")
    group = os.environ.get("TOKENMILL_DECODE_ATTN_GROUP", "1")  # csrc/paged_decode.cpp: 0 = a verify step's rows alone
    if group not in ("0", "1"):
        raise ValueError(f"TOKENMILL_DECODE_ATTN_GROUP must be 0 or 1, got {group!r}")
    _state["mod"] = None
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        import sys

        from torch.utils.cpp_extension import load

        # the `ninja` the project depends on lives beside this interpreter, even without an activated venv
        bindir = str(Path(sys.executable).parent)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        suffix, isa = _isa_flags()
        srcs = _content_addressed_sources()
        name = f"tokenmill_cpu_kernels_{srcs[0].parent.name}{suffix}"
        # a build that exists loads in well under a second; when it has to compile (first use of these sources
        # on this machine), say so instead of sitting silent for minutes
        what = ("compiling tokenmill's CPU kernels for this machine (%s): once per source version, 1-5 minutes on "
                "2 cores; TOKENMILL_CPU_KERNELS=0 skips them")
        notice = threading.Timer(BUILD_NOTICE_S, log.warning, (what, suffix.lstrip("_")))
        notice.daemon = True
        notice.start()
        try:
            _state["mod"] = load(name=name, sources=[str(s) for s in srcs], extra_cflags=["-O3", "-fopenmp", *isa],
                                 extra_ldflags=["-fopenmp"], verbose=False)
        finally:
            notice.cancel()
    except Exception as e:  # noqa: BLE001 - any build problem means: use the PyTorch path
        log.warning("CPU kernels unavailable (%s: %s); using the PyTorch attention path", type(e).__name__, e)
    return _state["mod"]
