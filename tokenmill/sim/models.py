"""Model shapes for the roofline cost model: what a step computes (FLOPs) and reads (weights, KV).

Catalog entries are copied from each model's Hugging Face `config.json` (the source named per entry); any
other model: `--model DIR` (or a config.json path) reads the same fields from its config.json. DeepSeek-V3's
MLA caches one compressed latent per token per layer (kv_lora_rank + qk_rope_head_dim values, shared by all
heads) instead of K and V per KV head, and its MoE layers read only the experts a batch routes to.

    kv_bytes_per_token = layers x (2 x kv_heads x head_dim          (GQA)
                                   | kv_lora_rank + qk_rope_dim)    (MLA)  x bytes per value
    attention FLOPs    = 2 x heads x (qk_dim + v_dim) per (query token, context token) per layer
                         (MLA absorbed: qk_dim = kv_lora_rank + rope, v_dim = kv_lora_rank)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenmill.cli import CLIError


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (the dense layers of an MoE model)
    vocab: int
    tie_embeddings: bool = False
    max_position: int = 131072
    # MoE (num_experts 0: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP (first_k_dense_replace)
    # MLA (kv_lora_rank 0: GQA)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    source: str = ""

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name!r}: {f} must be >= 1")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    # -- KV -------------------------------------------------------------------------------------
    def kv_values_per_token(self) -> int:
        per_layer = self.kv_lora_rank + self.qk_rope_dim if self.mla else 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        return self.kv_values_per_token() * bytes_per_value

    # -- parameters -----------------------------------------------------------------------------
    def attn_params(self) -> int:
        h, n = self.hidden, self.heads
        if self.mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + n * self.v_head_dim * h
        hd = self.head_dim
        return h * n * hd + 2 * h * self.kv_heads * hd + n * hd * h

    def _moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def params_total(self) -> int:
        dense_mlp = 3 * self.hidden * self.intermediate
        moe_layers = self._moe_layers()
        mlp = (self.layers - moe_layers) * dense_mlp + moe_layers * (
            (self.num_experts + self.shared_experts) * self.expert_params() + self.hidden * self.num_experts)
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * self.attn_params() + mlp + embed

    def params_active(self) -> int:
        """Parameters one token multiplies by (lm_head included, the embedding lookup not)."""
        moe_layers = self._moe_layers()
        mlp = (self.layers - moe_layers) * 3 * self.hidden * self.intermediate + moe_layers * (
            (self.experts_per_token + self.shared_experts) * self.expert_params() + self.hidden * self.num_experts)
        return self.layers * self.attn_params() + mlp + self.vocab * self.hidden

    def weight_params_read(self, tokens: int) -> float:
        """Parameters a step of `tokens` tokens reads from HBM: all dense weights, and for MoE the expected
        number of distinct experts the tokens route to (uniform routing)."""
        if not self.moe:
            return float(self.params_total() - self.vocab * self.hidden * (0 if self.tie_embeddings else 1))
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 1))
        moe_layers = self._moe_layers()
        dense = self.params_total() - moe_layers * self.num_experts * self.expert_params()
        return dense + moe_layers * touched * self.expert_params()

    # -- attention ------------------------------------------------------------------------------
    def attn_flops_per_pair(self) -> float:
        """FLOPs per (query token, context token) over all layers: QK^T and PV."""
        if self.mla:
            return 2.0 * self.layers * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 2.0 * self.layers * self.heads * 2 * self.head_dim

    def describe(self) -> dict:
        return {"name": self.name, "params_total": self.params_total(), "params_active": self.params_active(),
                "kv_values_per_token": self.kv_values_per_token(), "mla": self.mla, "moe": self.moe,
                "source": self.source}


HF = "https://huggingface.co/{}/blob/main/config.json"

CATALOG: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256,
                               source=HF.format("meta-llama/Llama-3.1-8B-Instruct")),
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, tie_embeddings=True,
                               source=HF.format("meta-llama/Llama-3.2-1B-Instruct")),  # a draft for the 3.1 family
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256,
                                source=HF.format("meta-llama/Llama-3.1-70B-Instruct")),
    "llama-3.1-405b": ModelShape("Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256,
                                 source=HF.format("meta-llama/Llama-3.1-405B-Instruct")),
    "qwen3-32b": ModelShape("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, max_position=40960,
                            source=HF.format("Qwen/Qwen3-32B")),
    "deepseek-v3": ModelShape("DeepSeek-V3", 61, 7168, 128, 128, 128, 18432, 129280, max_position=163840,
                              num_experts=256, experts_per_token=8, moe_intermediate=2048, shared_experts=1,
                              dense_layers=3, kv_lora_rank=512, q_lora_rank=1536, qk_rope_dim=64, qk_nope_dim=128,
                              v_head_dim=128, source=HF.format("deepseek-ai/DeepSeek-V3")),
}


def shape_from_config(cfg: dict, name: str) -> ModelShape:
    """A ModelShape from a Hugging Face config.json dict (Llama/Qwen/Mistral-style GQA, DeepSeek MLA/MoE)."""
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return ModelShape(
            name=name, layers=int(cfg["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=int(cfg.get("max_position_embeddings") or 131072),
            num_experts=int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0),
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
            shared_experts=int(cfg.get("n_shared_experts") or 0),
            dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0), qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0), source="config.json")
    except (KeyError, TypeError, ValueError) as e:
        raise CLIError(f"model {name}: config.json lacks or has a bad {e}") from None


def get_model(name: str) -> ModelShape:
    """A catalog name (case-insensitive), a shipped model (demo), an HF model directory or its config.json."""
    key = name.lower()
    if key in CATALOG:
        return CATALOG[key]
    path = Path(name)
    if not path.exists():
        from tokenmill.model.loader import resolve_model_path

        try:
            path = Path(resolve_model_path(name))
        except Exception:  # noqa: BLE001 - any failure: not a model we know
            raise CLIError(f"--model {name!r}: not in the catalog ({', '.join(CATALOG)}), not a shipped model, "
                           "and no such directory or config.json") from None
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"--model {name}: cannot read {cfg_path} ({e})") from None
    return shape_from_config(cfg, name)
