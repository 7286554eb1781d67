"""HF-format Llama-family models: config, tokenizer, weights, presets, the shipped demo models."""
