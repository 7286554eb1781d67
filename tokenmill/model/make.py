"""`tokenmill model make PRESET --out DIR`: write a random-init model in HF format.

Same preset + seed -> the same bytes: tensors are drawn in a fixed order from one seeded CPU generator,
and the project's trained byte-level BPE tokenizer is copied alongside.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tokenmill.model.config import ModelConfig
from tokenmill.model.presets import get_preset
from tokenmill.model.tokenizer import SHIPPED_TOKENIZER_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes, in a fixed order."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h))]
        if cfg.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if cfg.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (cfg.head_dim,)), (p + "self_attn.k_norm.weight", (cfg.head_dim,))]
        out += [(p + "self_attn.o_proj.weight", (h, q))]
        if cfg.o_bias:
            out += [(p + "self_attn.o_proj.bias", (h,))]
        out += [(p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                (p + "mlp.up_proj.weight", (cfg.intermediate_size, h)),
                (p + "mlp.down_proj.weight", (h, cfg.intermediate_size))]
        if cfg.mlp_bias:
            out += [(p + "mlp.gate_proj.bias", (cfg.intermediate_size,)), (p + "mlp.up_proj.bias", (cfg.intermediate_size,)),
                    (p + "mlp.down_proj.bias", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, h)))
    return out


def _init(name: str, shape, gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):  # near 1, not exactly 1, so a missed norm weight shows up in tests
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    return std * torch.randn(shape, generator=gen)


def make_model(preset: str, out: str | Path, seed: int = 0, dtype: str | None = None,
               max_shard_bytes: int = 2 << 30, overrides: dict | None = None) -> Path:
    from safetensors.torch import save_file

    raw = get_preset(preset)
    raw.update(overrides or {})
    if dtype:
        raw["torch_dtype"] = dtype
    cfg = ModelConfig.from_dict(raw, where=f"preset {preset}")
    tdtype = DTYPES[raw["torch_dtype"]]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    gen = torch.Generator().manual_seed(seed)
    std = float(raw.get("initializer_range", 0.02))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in weight_shapes(cfg):
        t = _init(name, shape, gen, std).to(tdtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            for k, t in shard.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"eos_token_id": raw.get("eos_token_id"), "bos_token_id": raw.get("bos_token_id"),
               "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SHIPPED_TOKENIZER_DIR / f, out / f)
    return out
