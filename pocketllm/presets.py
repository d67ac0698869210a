"""Embedded model shapes with seeded random weights: `tiny` for tests, `small` (the default) for
benchmarks on a laptop-class CPU, and `qwen3.8-27b`, the seed's exact shape."""

from __future__ import annotations

from pocketllm.config import ModelConfig, hybrid_layer_types
from pocketllm.errors import UsageError

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        layer_types=hybrid_layer_types(4),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=32_768,
    ),
    "small": ModelConfig(
        vocab_size=32_000,
        hidden_size=1024,
        intermediate_size=3072,
        layer_types=hybrid_layer_types(8),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32_768,
    ),
    "qwen3.8-27b": ModelConfig(
        vocab_size=248_320,
        hidden_size=5120,
        intermediate_size=17_408,
        layer_types=hybrid_layer_types(64),
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=262_144,
    ),
}

DEFAULT_PRESET = "small"


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
