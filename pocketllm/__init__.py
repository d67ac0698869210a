"""pocketllm: tensor-parallel inference and measurement for the Qwen3.5/Qwen3.8 hybrid decoder."""

__version__ = "0.1.0"
