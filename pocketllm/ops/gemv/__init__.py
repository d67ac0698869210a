"""The decode projections' kernels: one row (a GEMV) and a few rows (a decode step of several
sequences), torch's calls and pocketllm's compiled ones (gemv_bf16.c). Which runs where is the
kernel registry's choice (pocketllm.ops.registry)."""
