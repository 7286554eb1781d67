"""Resolve a model name or directory and load it: config, weights (single or sharded safetensors), tokenizer.

Every checkpoint tensor must map to exactly one parameter with the right shape, and every parameter must
be filled: a missing, unexpected or mismatched tensor is an error that names it, raised before serving.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.llama import LlamaModel

log = logging.getLogger("tokenmill.loader")
SHIPPED_MODELS_DIR = Path(__file__).parent / "demo"
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


def shipped_models() -> list[str]:
    return sorted(p.name for p in SHIPPED_MODELS_DIR.iterdir() if (p / "config.json").is_file()) \
        if SHIPPED_MODELS_DIR.is_dir() else []


def resolve_model_path(model: str) -> Path:
    """A shipped model name (e.g. 'demo') or a path to an HF-format directory."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    shipped = SHIPPED_MODELS_DIR / model
    if "/" not in model and (shipped / "config.json").is_file():
        return shipped
    names = ", ".join(shipped_models()) or "none"
    raise ModelLoadError(f"model {model!r}: no such directory, and not a shipped model (shipped: {names})")


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid index ({e})") from e
        out = {}
        for name, fname in weight_map.items():
            f = path / fname
            if not f.is_file():
                raise ModelLoadError(f"{index}: shard {fname} (holding {name}) is missing")
            out[name] = f
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def _target(model: LlamaModel, name: str):
    """HF tensor name -> (Linear, kind, shard) | (Parameter, None, None)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias|weight_scale)", name)
    if m:
        i, block, proj, kind = int(m[1]), m[2], m[3], m[4]
        if i >= len(model.layers):
            return None
        layer = model.layers[i]
        if block == "self_attn" and proj in ("q", "k", "v"):
            return layer.self_attn.qkv_proj, kind, proj
        if block == "self_attn" and proj == "o":
            return layer.self_attn.o_proj, kind, ""
        if block == "mlp" and proj in ("gate", "up"):
            return layer.mlp.gate_up_proj, kind, proj
        if block == "mlp" and proj == "down":
            return layer.mlp.down_proj, kind, ""
        return None
    if name == "lm_head.weight":
        return (model.lm_head, "weight", "") if model.lm_head is not None else "skip"
    local = name[len("model."):] if name.startswith("model.") else None
    if local is None:
        return None
    params = dict(model.named_parameters())
    if local in params:
        return params[local], None, None
    return None


def load_weights(model: LlamaModel, path: Path, device: torch.device) -> None:
    from safetensors import safe_open

    files = _checkpoint_files(path)
    expected = {}  # what must be filled: (id(param or linear), kind, shard) -> description
    for lname, mod in model.named_modules():
        if hasattr(mod, "shards") and hasattr(mod, "method"):
            for shard, _ in mod.shards:
                expected[(id(mod), "weight", shard)] = f"{lname}[{shard or 'all'}].weight"
                if mod.has_bias:
                    expected[(id(mod), "bias", shard)] = f"{lname}[{shard or 'all'}].bias"
                if getattr(mod, "weight_scale", None) is not None:  # a pre-quantized checkpoint
                    expected[(id(mod), "weight_scale", shard)] = f"{lname}[{shard or 'all'}].weight_scale"
    for pname, p in model.named_parameters():
        if not any(pname.endswith(s) for s in ("proj.weight", "proj.bias", "proj.weight_scale", "lm_head.weight",
                                               "lm_head.bias")):
            expected[(id(p), None, None)] = pname
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    unexpected = []
    for f, names in sorted(by_file.items()):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sorted(names):
                if IGNORED_TENSORS.match(name):
                    continue
                tgt = _target(model, name)
                if tgt == "skip":
                    continue
                if tgt is None:
                    unexpected.append(name)
                    continue
                obj, kind, shard = tgt
                t = sf.get_tensor(name)
                if kind is None:
                    if tuple(t.shape) != tuple(obj.shape):
                        raise ModelLoadError(f"{f.name}: tensor {name} has shape {tuple(t.shape)}, "
                                             f"expected {tuple(obj.shape)}")
                    obj.data.copy_(t.to(obj.dtype))
                else:
                    try:
                        obj.load(kind, shard, t, name)
                    except ModelLoadError as e:
                        raise ModelLoadError(f"{f.name}: {e}") from None
                expected.pop((id(obj), kind, shard), None)
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected tensor(s) for {model.cfg.architecture}: "
                             f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    if expected:
        missing = sorted(expected.values())
        raise ModelLoadError(f"{path}: missing tensor(s) for {model.cfg.architecture}: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"bad device {device!r}: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return d


def pick_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    from tokenmill.hardware import capabilities

    caps = capabilities()
    if dtype != "auto":
        if device.type == "cpu" and dtype == "bfloat16" and not caps.native_bf16:
            log.warning("bfloat16 on a CPU without native bf16 dot products (%s): emulated, expect it far slower "
                        "than float32", caps.summary())
        return table[dtype]
    if device.type == "cpu":
        # bf16 where the CPU has bf16 dot products (2-4x fp32's matmul rate, half the weight and KV bytes);
        # elsewhere bf16 matmuls are emulated, up to ~400x slower than fp32. Like vLLM, an fp32 checkpoint is
        # served in bf16 too (the quality gate in tests/model/test_precision.py bounds the loss).
        return torch.bfloat16 if caps.native_bf16 else torch.float32
    if cfg.torch_dtype == "float16":
        return torch.float16
    return torch.bfloat16 if caps.cuda_bf16 else torch.float16


def check_fp8(device: torch.device) -> None:
    """`--quantization fp8` runs where torch._scaled_mm does: natively on CUDA sm89+ (refused below, with the
    device named), emulated on a CPU (allowed, with a warning: it converts to fp32 per call, the dequant tax)."""
    if device.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < (8, 9):
            raise ModelLoadError(f"--quantization fp8 needs fp8 tensor cores (CUDA sm89+: Ada, Hopper, Blackwell); "
                                 f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]} (use int8 or none)")
        from tokenmill.model.linear import FP8

        a = torch.zeros(16, 32, device=device).to(FP8)
        b = torch.zeros(16, 32, device=device).to(FP8)
        ones = torch.ones(16, 1, device=device)
        try:
            torch._scaled_mm(a, b.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=torch.bfloat16)
        except RuntimeError as e:
            raise ModelLoadError(f"--quantization fp8: torch._scaled_mm with per-row scales does not run on "
                                 f"{torch.cuda.get_device_name(device)} with this PyTorch ({e})") from None
        return
    from tokenmill.hardware import capabilities

    log.warning("--quantization fp8 on a CPU (%s): no fp8 instructions, torch._scaled_mm converts to fp32 per "
                "call: expect it far slower than float32 or int8", capabilities().summary())


def load_model(path: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int, quantization: str = "none") -> LlamaModel:
    if cfg.quantization is not None:  # a pre-quantized checkpoint: its own weights, whatever was asked
        own = "fp8" if cfg.quantization.endswith("-fp8") else "int8"
        if quantization not in ("none", own):
            raise ModelLoadError(f"quantization={quantization!r} cannot apply to a checkpoint already quantized "
                                 f"({cfg.quantization})")
        quantization = cfg.quantization
    if quantization in ("fp8", "compressed-tensors-w8a8-fp8"):
        check_fp8(device)
    with torch.device("cpu"):
        model = LlamaModel(cfg, dtype, max_positions, quantization)
    load_weights(model, path, device)
    model = model.to(device).eval()
    model.process_weights_after_loading()
    return model
