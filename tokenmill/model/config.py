"""ModelConfig: the parts of an HF `config.json` that a Llama-family model needs, validated.

Read exactly as the installed-today transformers reads it (v5), and as v4 wrote it:

* RoPE: v5 writes `rope_parameters` ({rope_type, rope_theta, factor, ...}, or one such dict per layer type
  under the `layer_types` labels); v4 wrote top-level `rope_theta` and `rope_scaling`. As in transformers,
  `rope_scaling` (when set) takes the place of `rope_parameters`, a `rope_theta` inside the dict wins over
  the top-level one, and the theta default is 10000.
* Sliding windows: Mistral applies `sliding_window` (default 4096) to every layer; Qwen2/Qwen3 only when
  `use_sliding_window`, and only on the layers `layer_types` (or `max_window_layers`) marks as sliding;
  Llama has none.
* Every default is the architecture's own transformers default (Qwen3's head_dim is 128, not
  hidden/heads; Mistral's max_position_embeddings is 131072, ...).

Anything that changes the math and is not implemented is a ModelLoadError naming the key: an unknown
`rope_type` or RoPE field, `partial_rotary_factor` != 1, a `hidden_act` other than silu, a layout that mixes
sliding and full-attention layers, RoPE that differs per layer type, a `quantization_config` other than
compressed-tensors int8 W8A8 (quant_config.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.errors import ModelLoadError


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture reads the config (the transformers modeling/config code is the reference)."""

    qkv_bias: bool | str  # True / False, or the config key that switches it
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool
    sliding: str  # "none" | "all" (Mistral: sliding_window on every layer) | "layer_types" (Qwen2/3)
    defaults: dict  # the transformers config class's defaults for fields that change the math


_COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("attention_bias", "attention_bias", "mlp_bias", False, "none",
                                 {**_COMMON_DEFAULTS, "max_position_embeddings": 2048}),
    "MistralForCausalLM": ArchSpec(False, False, False, False, "all",
                                   {**_COMMON_DEFAULTS, "max_position_embeddings": 4096 * 32,
                                    "num_key_value_heads": 8, "sliding_window": 4096}),
    "Qwen2ForCausalLM": ArchSpec(True, False, False, False, "layer_types",
                                 {**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32,
                                  "sliding_window": 4096, "max_window_layers": 28, "use_sliding_window": False}),
    "Qwen3ForCausalLM": ArchSpec("attention_bias", "attention_bias", False, True, "layer_types",
                                 {**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32,
                                  "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28,
                                  "use_sliding_window": False}),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}

# rope_type -> the fields it reads besides rope_type/type/rope_theta (all required, as transformers requires)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, whichever spelling the checkpoint used."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


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
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    quantization: str | None = None  # a pre-quantized checkpoint's format (quant_config.py), else None
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
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{p}: expected a JSON object")
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
        if arch is None and not archs:
            arch = MODEL_TYPES.get(raw.get("model_type"))
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        spec = ARCHITECTURES[arch]

        def need(key):
            if raw.get(key) is None:
                raise ModelLoadError(f"{where}: missing field {key!r} for {arch}")
            return raw[key]

        def get(key):
            """The value (null included: `"sliding_window": null` means none), or the architecture's
            transformers default when the key is absent."""
            return raw[key] if key in raw else spec.defaults.get(key)

        def number(key, kind):
            v = get(key)
            if v is None:
                raise ModelLoadError(f"{where}: missing field {key!r} for {arch}")
            return kind(v)

        def flag(v) -> bool:
            return bool(raw.get(v, False)) if isinstance(v, str) else v

        quantization = None
        if raw.get("quantization_config"):  # one pre-quantized format loads (int8 W8A8); any other is refused
            from tokenmill.model.quant_config import parse_quantization_config

            quantization = parse_quantization_config(raw["quantization_config"], where)
        act = raw.get("hidden_act") or "silu"  # every supported architecture's default
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{where}: 'hidden_act' {act!r} is not supported (only silu)")

        n_layers = int(need("num_hidden_layers"))
        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        n_kv = int(get("num_key_value_heads") or n_heads)
        head_dim = int(get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ModelLoadError(f"{where}: num_attention_heads {n_heads} not divisible by num_key_value_heads {n_kv}")
        max_pos = number("max_position_embeddings", int)
        sliding, layer_types = _sliding_window(raw, spec, get, n_layers, where)
        rope = _rope(raw, layer_types, max_pos, where)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", float),
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            qkv_bias=flag(spec.qkv_bias),
            o_bias=flag(spec.o_bias),
            mlp_bias=flag(spec.mlp_bias),
            qk_norm=spec.qk_norm,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            quantization=quantization,
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


def _sliding_window(raw: dict, spec: ArchSpec, get, n_layers: int, where: str) -> tuple[int | None, list[str]]:
    """(the window every layer uses, or None; the layer types) as the architecture's transformers code has them."""
    if spec.sliding == "none":  # transformers' Llama ignores sliding_window / layer_types
        return None, ["full_attention"] * n_layers
    window = get("sliding_window")
    if spec.sliding == "all":
        return (int(window) if window else None), ["sliding_attention" if window else "full_attention"] * n_layers
    if not get("use_sliding_window"):  # transformers: sliding_window if use_sliding_window else None
        window = None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(get("max_window_layers") or 0)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ModelLoadError(f"{where}: 'layer_types' must list one type per layer ({n_layers})")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"{where}: 'layer_types' has unsupported layer type(s) {unknown}")
    if window is None:  # sliding layers without a window attend to everything, as in transformers
        return None, layer_types
    kinds = set(layer_types)
    if kinds == {"sliding_attention"}:
        return int(window), layer_types
    if kinds == {"full_attention"}:
        return None, layer_types
    raise ModelLoadError(
        f"{where}: 'layer_types' mixes full_attention and sliding_attention layers (use_sliding_window with "
        f"max_window_layers < num_hidden_layers): per-layer sliding windows are not implemented")


def _rope(raw: dict, layer_types: list[str], max_pos: int, where: str) -> RopeConfig:
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ModelLoadError(f"{where}: {key!r} must be an object, got {params!r}")
    nested = [k for k in params if k in LAYER_TYPES]
    if nested:  # one dict per layer type: only the types this model's layers use matter
        used = sorted(set(layer_types))
        missing = [t for t in used if t not in params]
        if missing or set(params) - set(nested):
            raise ModelLoadError(f"{where}: {key!r} is keyed by layer type but lacks {missing} or mixes keys "
                                 f"{sorted(set(params) - set(nested))}")
        ropes = {t: _rope_one(params[t] or {}, raw, max_pos, f"{key}.{t}", where) for t in used}
        if len(set(ropes.values())) > 1:
            raise ModelLoadError(f"{where}: {key!r} differs per layer type ({', '.join(used)}): "
                                 "per-layer RoPE is not implemented")
        return ropes[used[0]]
    return _rope_one(params, raw, max_pos, key, where)


def _rope_one(p: dict, raw: dict, max_pos: int, key: str, where: str) -> RopeConfig:
    rope_type = p.get("rope_type") or p.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: {key}.rope_type {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    partial = p.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"{where}: 'partial_rotary_factor' {partial} is not supported (only 1.0)")
    fields = ROPE_TYPES[rope_type]
    unknown = sorted(set(p) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *fields})
    if unknown:
        raise ModelLoadError(f"{where}: {key} field(s) {unknown} not understood for rope_type {rope_type!r}")
    p = dict(p)
    if rope_type == "llama3":
        # as transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings
        if raw.get("original_max_position_embeddings") is not None:
            p["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        p.setdefault("original_max_position_embeddings", max_pos)
    missing = [f for f in fields if p.get(f) is None]
    if missing:
        raise ModelLoadError(f"{where}: {key} lacks {missing} for rope_type {rope_type!r}")
    theta = p.get("rope_theta")
    if theta is None:
        theta = raw.get("rope_theta")
    try:
        return RopeConfig(
            theta=float(10000.0 if theta is None else theta),
            rope_type=rope_type,
            factor=float(p.get("factor", 1.0)),
            low_freq_factor=None if p.get("low_freq_factor") is None else float(p["low_freq_factor"]),
            high_freq_factor=None if p.get("high_freq_factor") is None else float(p["high_freq_factor"]),
            original_max_position_embeddings=(None if p.get("original_max_position_embeddings") is None
                                              else int(p["original_max_position_embeddings"])),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: {key} has a non-numeric value ({e})") from None
