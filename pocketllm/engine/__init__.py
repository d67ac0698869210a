"""Running the model: per-pass context, state caches, the prefill/decode runner, generation."""
