"""Weight-only quantization: the in-memory layout of int8/int4 weights and its plain forms."""
