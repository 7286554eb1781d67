"""Model presets: HF `config.json` dicts for random-init models.

tiny* (1-5M params) are for tests, one per supported architecture; `small` (~40M) is for CPU benchmarks;
`llama-3.1-8b`, `qwen3-8b` have the real models' shapes (random weights) for GPU benchmarks.
"""

from __future__ import annotations

from tokenmill.errors import TokenmillError


def _llama(**kw) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 0,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    cfg.update(kw)
    return cfg


PRESETS: dict[str, dict] = {
    "tiny": _llama(),
    "tiny-llama3": _llama(
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    "tiny-mistral": _llama(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                           num_key_value_heads=1, head_dim=32),
    "tiny-qwen2": _llama(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                         use_sliding_window=False, sliding_window=None, rope_theta=1000000.0),
    "tiny-qwen3": _llama(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=48,
                         use_sliding_window=False, sliding_window=None, rope_theta=1000000.0),
    "small": _llama(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                    max_position_embeddings=4096),
    "llama-3.1-8b": _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, torch_dtype="bfloat16", bos_token_id=None, eos_token_id=0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen3-8b": _llama(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, torch_dtype="bfloat16",
        use_sliding_window=False, sliding_window=None,
    ),
}


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise TokenmillError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
