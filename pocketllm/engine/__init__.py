"""Running the model: the prefill/decode runner and generation. The per-pass context and the
decode state it keeps are the layers' own types (pocketllm.layers.context, .cache)."""
