"""ModelConfig: the parts of an HF `config.json` that a Llama-family model needs, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.errors import ModelLoadError

# architecture name -> family flags
ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"{p}: missing (an HF-format model directory needs config.json)")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{p}: invalid JSON: {e}") from e
        cfg = cls.from_dict(raw, where=str(p))
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                eos = g.get("eos_token_id")
                if eos is not None:
                    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(eos if isinstance(eos, list) else [eos]))
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{gen}: invalid JSON: {e}") from e
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )

        def need(key):
            if key not in raw:
                raise ModelLoadError(f"{where}: missing field {key!r} for {arch}")
            return raw[key]

        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        n_kv = int(raw.get("num_key_value_heads") or n_heads)
        head_dim = int(raw.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ModelLoadError(f"{where}: num_attention_heads {n_heads} not divisible by num_key_value_heads {n_kv}")
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling:
            kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
            if kind not in ("llama3", "default", "linear"):
                raise ModelLoadError(f"{where}: unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", False)) or ARCHITECTURES[arch]["qkv_bias"],
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            raw=raw,
        )

    def num_params(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + L * per_layer + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
